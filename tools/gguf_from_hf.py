#!/usr/bin/env python3
"""Writes a llama Hugging Face checkpoint (config.json + model.safetensors) as a GGUF file the way
llama.cpp's converter does: llama metadata keys, tensors under GGUF names, and the rows of each head
of q_proj and k_proj permuted so rotary pairs sit side by side (GGUF's rope layout). 2-D weights
whose rows split into 32-element blocks are stored as --type (F32, F16 or Q8_0, quantized by the
`gguf` package); norms stay F32.

    pip install gguf numpy safetensors
    python3 tools/gguf_from_hf.py fixtures/hf/llama fixtures/gguf/llama-q8_0.gguf --type Q8_0

kvflow's GGUF loader must undo the permutation itself; this script is its independent counterpart
(tests/integration and kernels' gguf tests load what it wrote and compare with transformers'
outputs in the checkpoint's expected.json).
"""
import argparse
import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file


def permute(w, n_head):
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--type", default="F32", choices=["F32", "F16", "Q8_0"])
    a = ap.parse_args()
    ckpt = Path(a.checkpoint)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    t = load_file(str(ckpt / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // heads)
    rope = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    qtype = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
             "Q8_0": gguf.GGMLQuantizationType.Q8_0}[a.type]
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    parts = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for name in sorted(t):
        data = t[name].astype(np.float32)
        if name in names:
            out = names[name]
        else:
            layer, part = name[len("model.layers."):].split(".", 1)
            out = f"blk.{layer}.{parts[part]}"
            if part == "self_attn.q_proj.weight":
                data = permute(data, heads)
            elif part == "self_attn.k_proj.weight":
                data = permute(data, kv_heads)
        if data.ndim == 2 and data.shape[1] % 32 == 0 and qtype != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(data, qtype)
            w.add_tensor(out, q, raw_dtype=qtype)
        else:
            w.add_tensor(out, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
