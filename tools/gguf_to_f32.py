"""Writes a GGUF file's tensors dequantized to F32 (metadata copied as is), with the `gguf`
package's own dequantization: the f32 file llama.cpp's f32 figures in issue 19 are measured on.
(kvflow dequantizes at load, so it reads either file the same way.)

    python3 tools/gguf_to_f32.py SmolLM2-135M-Instruct.Q4_1.gguf SmolLM2-135M-Instruct.F32.gguf
"""

import sys

import gguf
import numpy as np
from gguf.quants import dequantize


def main():
    source, target = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_key_value(field.name, int(gguf.LlamaFileType.ALL_F32), kind)
            continue
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        # GGUF lists dims fastest-first; numpy wants them the other way round.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        data = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(target)


if __name__ == "__main__":
    main()
