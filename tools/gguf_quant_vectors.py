#!/usr/bin/env python3
"""Test vectors for kvflow's GGUF dequantization, from the `gguf` package's own (numpy)
dequantization: for each ggml type kvflow reads, two blocks of seeded random bytes (scales kept
finite) and the f32 values the `gguf` package gives them.

    pip install gguf numpy
    python3 tools/gguf_quant_vectors.py > fixtures/gguf/quant_vectors.json
"""
import json

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

rng = np.random.default_rng(20261203)
out = {"gguf": getattr(gguf, "__version__", "unknown"), "types": {}}
for t in [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K]:
    _, block_bytes = GGML_QUANT_SIZES[t]
    while True:
        raw = rng.integers(0, 256, size=(2 * max(block_bytes, 4),), dtype=np.uint8)
        values = gguf.quants.dequantize(raw.reshape(1, -1), t).ravel().astype(np.float32)
        # keep scales small and finite: random bytes often make an f16 scale huge or NaN
        if np.all(np.isfinite(values)) and np.max(np.abs(values)) < 1e6:
            break
    out["types"][t.name] = {"id": int(t), "bytes": raw.tobytes().hex(), "values": [float(v) for v in values]}
print(json.dumps(out))
