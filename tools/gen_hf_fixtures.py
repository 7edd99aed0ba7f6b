#!/usr/bin/env python3
"""Generate extra tiny Hugging Face test checkpoints plus reference outputs for kvflow.

What it makes
-------------
For every variant listed in VARIANTS below, OUT_DIR/<name>/ receives a standard Hugging Face
checkpoint (config.json, generation_config.json when transformers writes one, model.safetensors or a
sharded model-0000k-of-0000n.safetensors set with model.safetensors.index.json) and expected.json,
the reference outputs.  OUT_DIR/README.md lists the variants.  The format is the one of the shared
fixtures (fixtures/hf, see its README.md); the variants cover what those do not: bf16/f16 storage,
sharded checkpoints, tied embeddings, attention/MLP biases, linear/llama3/yarn RoPE scaling, the
legacy `rope_theta` + `rope_scaling` config layout, sliding-window layers, wide heads, plain-q MLA,
non-interleaved MLA RoPE, other hybrid layer patterns, and non-zero DeepSeek
`e_score_correction_bias`.

How (per variant)
-----------------
 1. torch.manual_seed(seed); config = AutoConfig.for_model(model_type, **fields);
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32), eval mode, on CPU.
 2. Every parameter and every saved (persistent) floating-point buffer gets N(0, 0.05) noise
    (tied parameters are visited once, so they stay tied).
 3. Storage dtype: the model is cast with model.to(bf16 / f16) before saving.  Tensors the model
    class lists in `_keep_in_fp32_modules_strict` (DeepSeek's e_score_correction_bias) are kept in
    float32, exactly as `from_pretrained(..., dtype=bf16)` would keep them.  Sharded variants pass a
    small max_shard_size.  model.save_pretrained(dir) writes the files; the file set is asserted.
 4. Legacy-layout variants rewrite config.json afterwards: "rope_parameters" is removed, "rope_theta"
    goes to the top level and, for a non-default rope type, "rope_scaling" gets the remaining keys with
    the type under "type" or "rope_type" (as the variant says).
 5. The checkpoint is reloaded with AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)
    (loading report must be clean; reloaded state dict must equal what was saved, upcast to f32; the
    reloaded model must give the same logits as the in-memory model) and ALL reference outputs come
    from the reloaded model.
 6. Prompts: seeded random token ids in [3, vocab_size) of lengths 6, 97, 300.  For each prompt,
    greedy generation of 40 tokens, each step a full forward over the whole sequence
    (use_cache=False), ignoring end-of-sequence, float32, no grad.  expected.json records, per case,
    prompt, greedy, last_logits, decode_logits (8), greedy_gaps, argmax_per_position, and
    min_greedy_gap over all cases.

Usage:  python3 tools/gen_hf_fixtures.py OUT_DIR [--only NAME ...] [--list]
Needs python 3.12, torch 2.11 (CPU), transformers 5.17.0, safetensors 0.8, numpy.
Each variant runs in its own try/except; the exit status is non-zero if any variant failed.
"""

import argparse
import json
import math
import os
import random
import shutil
import struct
import sys
import time
import traceback

# CPU only, and never touch the network.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EXPECTED_TRANSFORMERS = "5.17.0"
NOISE_STD = 0.05
DEFAULT_PROMPT_LENS = [6, 97, 300]
DEFAULT_NEW_TOKENS = 40
N_DECODE_LOGITS = 8
SHARD_SIZE = "200KB"

# Special tokens, as in the shared fixtures (the class defaults of several families lie outside a
# tiny vocabulary).
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------------------------
# Variants.  `fields` go to AutoConfig.for_model(model_type, **fields); names are the exact
# transformers 5.17 spellings.  Seeds: one per variant, picked (from a scan of a few candidates per
# variant with this very script on torch 2.11 / transformers 5.17 CPU) so that min_greedy_gap stays
# above the 1e-3 near-tie threshold and the greedy continuations are not all one repeated token
# where the architecture allows (the tied-embedding llama repeats a token for every seed tried).  `expect_config` is checked against the saved config.json (after any
# legacy rewrite it is checked against the reloaded config object instead, for keys that moved).
# --------------------------------------------------------------------------------------------
VARIANTS = [
    dict(
        name="llama_bf16_tied_legacy_linear",
        model_type="llama",
        seed=1401,
        storage="bf16",
        legacy_rope="type",
        fields=dict(
            vocab_size=384,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=160,
            num_hidden_layers=3,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            attention_bias=True,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
        expect_config=dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=False),
        expect_tensors=["model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.o_proj.bias"],
        absent_tensors=["lm_head.weight"],
        exercises="bf16 weights (upcast to f32 on load); tied embeddings (no lm_head.weight in the file); "
        "q/k/v/o biases; GQA 6 heads : 2 kv heads; linear RoPE scaling (factor 2) in the LEGACY "
        'config layout (top-level rope_theta, rope_scaling with the key "type")',
    ),
    dict(
        name="llama_llama3_sharded",
        model_type="llama",
        seed=1602,
        storage="f32",
        sharded=True,
        fields=dict(
            vocab_size=512,
            hidden_size=128,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=16,
            intermediate_size=192,
            num_hidden_layers=2,
            max_position_embeddings=4096,
            mlp_bias=True,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 50000.0,
            },
        ),
        expect_config=dict(mlp_bias=True, attention_bias=False, num_key_value_heads=8),
        expect_tensors=["model.layers.0.mlp.gate_proj.bias", "model.layers.0.mlp.down_proj.bias"],
        exercises="sharded safetensors (model.safetensors.index.json + several shards); llama3 RoPE "
        "frequency scaling with all three bands present (kept / smoothed / divided); MLP biases; "
        "plain MHA (8 kv heads)",
    ),
    dict(
        name="qwen3_yarn_wide_head",
        model_type="qwen3",
        seed=1303,
        storage="f16",
        fields=dict(
            vocab_size=320,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=96,
            num_hidden_layers=3,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "rope_theta": 1000000.0,
            },
        ),
        expect_config=dict(head_dim=32, num_key_value_heads=1),
        exercises="f16 weights; head_dim 32 x 4 heads = 128-wide q/o projections on a 64-wide model; "
        "MQA (1 kv head); YaRN RoPE (factor 4, default beta_fast/beta_slow, cos/sin scaled by "
        "0.1 ln 4 + 1)",
    ),
    dict(
        name="qwen3_sliding_legacy_llama3",
        model_type="qwen3",
        seed=1904,
        storage="f32",
        legacy_rope="rope_type",
        fields=dict(
            vocab_size=256,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            num_hidden_layers=3,
            max_position_embeddings=2048,
            use_sliding_window=True,
            sliding_window=48,
            max_window_layers=1,
            rms_norm_eps=1e-6,
            # theta 10000 so that head_dim 16 has one kept, one smoothed and several divided bands
            rope_parameters={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        ),
        expect_config=dict(
            use_sliding_window=True,
            sliding_window=48,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        ),
        exercises="sliding-window attention (window 48: key j visible from query i iff i-48 < j <= i) on "
        "layers 1 and 2 only, layer 0 full (derived from max_window_layers=1 into layer_types); "
        'llama3 RoPE in the LEGACY layout with the key "rope_type"',
    ),
    dict(
        name="deepseek_v3_plain_q_yarn_bf16",
        model_type="deepseek_v3",
        seed=1505,
        storage="bf16",
        fields=dict(
            vocab_size=448,
            hidden_size=64,
            num_attention_heads=4,
            # the DeepseekV3Config default is 128 (not None): must be set to the head count
            num_key_value_heads=4,
            num_hidden_layers=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
            rope_interleave=False,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=4,
            first_k_dense_replace=2,
            n_shared_experts=2,
            moe_intermediate_size=24,
            intermediate_size=96,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            max_position_embeddings=1024,
            rms_norm_eps=1e-6,
            # NOTE: max_position_embeddings / original_max_position_embeddings = 16 != factor 4;
            # transformers only warns about it and uses the explicit factor (kept as asked).
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
        expect_config=dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, head_dim=8),
        expect_tensors=["model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias"],
        absent_tensors=["model.layers.0.self_attn.q_a_proj.weight"],
        exercises="MLA with a plain q_proj (q_lora_rank null) and NON-interleaved RoPE; v_head_dim 24 != "
        "qk_nope_head_dim 16; YaRN with mscale 1.0 != mscale_all_dim 0.8 (cos/sin scaled by the "
        "mscale ratio, softmax scale multiplied by mscale(4, 0.8)^2); 16 experts in 4 groups, top-2 "
        "groups, top-4 experts, norm_topk_prob false, routed_scaling_factor 1.5, 2 shared experts, 2 "
        "dense layers first; non-zero e_score_correction_bias (stored as F32 in a BF16 checkpoint)",
    ),
    dict(
        name="deepseek_v3_legacy_yarn_sharded",
        model_type="deepseek_v3",
        seed=1806,
        storage="f32",
        sharded=True,
        legacy_rope="type",
        fields=dict(
            vocab_size=512,
            hidden_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_hidden_layers=3,
            q_lora_rank=40,
            kv_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=16,
            v_head_dim=16,
            rope_interleave=True,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=3,
            first_k_dense_replace=1,
            n_shared_experts=1,
            moe_intermediate_size=32,
            intermediate_size=128,
            # Not given in the brief: 512 keeps every generated position (<= 340) below the limit.
            # 512/128 = 4 != factor 2 -> transformers warns and uses the explicit factor.
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 2.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 128,
            },
        ),
        expect_config=dict(q_lora_rank=40, rope_interleave=True, head_dim=16),
        expect_tensors=["model.layers.0.self_attn.q_a_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias"],
        exercises="sharded checkpoint; YaRN in the LEGACY layout with the key \"type\" (mscale = "
        "mscale_all_dim = 0.707: cos/sin unscaled, softmax scale times mscale(2, 0.707)^2); "
        "interleaved RoPE with qk_rope_head_dim 16 > qk_nope_head_dim 8; q LoRA 40; 2 heads; "
        "top-3 of 8 experts inside the best 1 of 2 groups; non-zero e_score_correction_bias",
    ),
    dict(
        name="qwen3_next_attn_every3",
        model_type="qwen3_next",
        seed=1607,
        storage="f32",
        fields=dict(
            vocab_size=384,
            hidden_size=64,
            num_hidden_layers=6,
            # layer_types is derived by Qwen3NextConfig.__post_init__ from this kwarg (it is popped and
            # not saved; the saved config carries the derived layer_types).
            full_attention_interval=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            intermediate_size=96,
            norm_topk_prob=True,
            partial_rotary_factor=0.5,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
        ),
        expect_config=dict(
            layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
            partial_rotary_factor=0.5,
        ),
        expect_rope=dict(partial_rotary_factor=0.5),
        exercises="gated full attention on every 3rd layer (layers 2 and 5); partial RoPE 0.5 (8 of 16 "
        "dims); gated delta rule with 4 value heads over 2 key heads and value dim 8 != key dim 16; "
        "MoE top-2 of 8 with norm_topk_prob true plus gated shared expert",
    ),
    dict(
        name="qwen3_next_gdn_wide",
        model_type="qwen3_next",
        seed=1408,
        storage="bf16",
        fields=dict(
            vocab_size=256,
            hidden_size=48,
            num_hidden_layers=3,
            layer_types=["linear_attention"] * 3,
            # attention fields are unused (no full-attention layer) but kept consistent
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=1,
            linear_num_value_heads=3,
            linear_key_head_dim=24,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            intermediate_size=96,
            norm_topk_prob=False,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
        ),
        expect_config=dict(layer_types=["linear_attention"] * 3, norm_topk_prob=False),
        exercises="pure gated delta rule (no attention layer, no KV cache); one key head shared by 3 value "
        "heads; key dim 24 != value dim 16; hidden 48; top-1 of 4 experts without renormalisation; "
        "bf16 weights",
    ),
    dict(
        name="kimi_linear_mla_heavy",
        model_type="kimi_linear",
        seed=1809,
        storage="f32",
        fields=dict(
            vocab_size=320,
            hidden_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
            intermediate_size=96,
            moe_intermediate_size=24,
            num_experts=8,
            num_experts_per_token=2,
            num_shared_experts=1,
            # not a config field: read from kwargs by KimiLinearConfig.__post_init__ to derive
            # mlp_layer_types (and also stored as an attribute)
            first_k_dense_replace=2,
            max_position_embeddings=8192,  # attribute_map -> model_max_length
            rms_norm_eps=1e-6,
            # layer_types is left unset so that it is derived from the 1-based kda_layers /
            # full_attn_layers lists, the way real Kimi checkpoints describe it.
            linear_attn_config={
                "full_attn_layers": [2, 4, 5],
                "kda_layers": [1, 3, 6],
                "head_dim": 24,
                "num_heads": 2,
                "short_conv_kernel_size": 4,
            },
        ),
        expect_config=dict(
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
                "full_attention",
                "linear_attention",
            ],
            mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
            linear_head_dim=24,
            linear_num_heads=2,
        ),
        expect_tensors=["model.layers.1.self_attn.kv_b_proj.weight", "model.layers.2.block_sparse_moe.gate.e_score_correction_bias"],
        exercises="3 NoPE MLA layers interleaved with 3 KDA layers (layer_types derived from the 1-based "
        "kda_layers / full_attn_layers of linear_attn_config), two of them adjacent; KDA 2 heads x 24; "
        "MLA v_head_dim 24 != qk_nope_head_dim 16; 2 dense MLP layers then MoE top-2 of 8 with a "
        "shared expert and non-zero e_score_correction_bias",
    ),
    dict(
        name="deepseek_v32_topk32",
        model_type="deepseek_v32",
        seed=1210,
        storage="f32",
        fields=dict(
            vocab_size=384,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            index_topk=32,
            index_n_heads=2,
            index_head_dim=32,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            intermediate_size=128,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
        ),
        expect_config=dict(
            index_topk=32,
            index_n_heads=2,
            index_head_dim=32,
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
        expect_tensors=["model.layers.0.self_attn.indexer.wq_b.weight", "model.layers.1.mlp.gate.e_score_correction_bias"],
        exercises="DSA indexer keeping 32 keys (the 97- and 300-token prompts exercise the top-k selection); "
        "2 indexer heads of dim 32 (rope part 8, non-interleaved); q LoRA 32; non-zero "
        "e_score_correction_bias",
    ),
]
VARIANT_BY_NAME = {v["name"]: v for v in VARIANTS}
STORAGE_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
# transformers 5.17 swaps its reference torch implementations of the gated-delta-rule / KDA
# recurrences and the causal conv for these packages whenever they are importable (whatever the
# device); the fixtures must come from the reference path.
LINEAR_ATTN_KERNEL_PACKAGES = ("fla", "causal_conv1d")
LINEAR_ATTN_MODEL_TYPES = ("qwen3_next", "kimi_linear")
SAFETENSORS_DTYPE = {"f32": "F32", "bf16": "BF16", "f16": "F16"}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def weight_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def write_json_like_transformers(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def as_plain(v):
    if isinstance(v, tuple):
        return [as_plain(x) for x in v]
    if isinstance(v, list):
        return [as_plain(x) for x in v]
    return v


def check_equal(what, got, want):
    if as_plain(got) != as_plain(want):
        raise AssertionError(f"{what}: got {got!r}, expected {want!r}")


def persistent_float_buffers(model):
    """(name, tensor) of every buffer that state_dict() saves, floating point only."""
    out, seen = [], set()
    for mod_name, mod in model.named_modules():
        for b_name, buf in mod._buffers.items():
            if buf is None or b_name in mod._non_persistent_buffers_set:
                continue
            if not buf.is_floating_point() or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{mod_name}.{b_name}" if mod_name else b_name, buf))
    return out


def non_persistent_buffers(model):
    out = {}
    for mod_name, mod in model.named_modules():
        for b_name, buf in mod._buffers.items():
            if buf is not None and b_name in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{b_name}" if mod_name else b_name] = (mod, b_name)
    return out


def keep_fp32_patterns(model):
    pats = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    return list(pats)


def rewrite_legacy_rope(config_path, key):
    """Rewrite config.json from the rope_parameters layout to the old rope_theta/rope_scaling one."""
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    rp = cfg.pop("rope_parameters", None)
    if not isinstance(rp, dict) or "rope_theta" not in rp:
        raise AssertionError(f"legacy rewrite: unexpected rope_parameters {rp!r}")
    rp = dict(rp)
    cfg["rope_theta"] = rp.pop("rope_theta")
    rope_type = rp.pop("rope_type", rp.pop("type", "default"))
    rp.pop("type", None)
    if rope_type != "default":
        cfg["rope_scaling"] = {key: rope_type, **rp}
    write_json_like_transformers(config_path, cfg)
    return cfg


# --------------------------------------------------------------------------------------------
# one variant
# --------------------------------------------------------------------------------------------
def run_variant(v, out_root, torch, transformers):
    from transformers import AutoConfig, AutoModelForCausalLM

    name = v["name"]
    if v["model_type"] in LINEAR_ATTN_MODEL_TYPES:
        import importlib.util

        found = [p for p in LINEAR_ATTN_KERNEL_PACKAGES if importlib.util.find_spec(p) is not None]
        if found:
            raise RuntimeError(
                f"{found} importable: transformers would use those kernels instead of its reference torch "
                "implementation; run in an environment without them"
            )
    out = os.path.join(out_root, name)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    storage = v.get("storage", "f32")
    sharded = bool(v.get("sharded", False))
    legacy = v.get("legacy_rope")  # None, "type" or "rope_type"
    seed = v["seed"]
    t0 = time.time()

    # 1. config + model with default initialisation
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except Exception:  # numpy is only used for seeding
        pass
    fields = dict(SPECIAL)
    fields.update(v["fields"])
    config = AutoConfig.for_model(v["model_type"], **fields)
    log(f"  config class {type(config).__name__}; rope_parameters={getattr(config, 'rope_parameters', None)!r}")
    for k in ("layer_types", "mlp_layer_types"):
        if getattr(config, k, None) is not None:
            log(f"  {k}={list(getattr(config, k))}")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  model class {type(model).__name__}, {n_params} parameters, attn={model.config._attn_implementation}")

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        if emb is not head:
            raise AssertionError("tie_word_embeddings is true but lm_head.weight is not embed_tokens.weight")

    # 2. perturb every parameter (tied ones once) and every saved floating buffer
    with torch.no_grad():
        for pname, p in model.named_parameters():  # remove_duplicate=True: tied weights visited once
            p.add_(torch.randn_like(p) * NOISE_STD)
        bufs = persistent_float_buffers(model)
        for bname, b in bufs:
            b.add_(torch.randn_like(b) * NOISE_STD)
    if bufs:
        log(f"  perturbed {len(bufs)} persistent buffers, e.g. {[n for n, _ in bufs[:3]]}")
    for pname, p in list(model.named_parameters()) + bufs:
        if not torch.isfinite(p).all():
            raise AssertionError(f"non-finite values in {pname} after init/perturbation")
    if tied:
        if model.get_input_embeddings().weight is not model.get_output_embeddings().weight:
            raise AssertionError("tied weights came apart during perturbation")

    # 3. storage dtype + save
    saved_np = {}
    np_bufs = non_persistent_buffers(model)
    for key, (mod, b_name) in np_bufs.items():
        saved_np[key] = mod._buffers[b_name].detach().clone()
    kept_fp32 = []
    if storage != "f32":
        sdtype = torch.bfloat16 if storage == "bf16" else torch.float16
        model.to(sdtype)
        pats = keep_fp32_patterns(model)
        with torch.no_grad():
            for mod_name, mod in model.named_modules():
                for coll in (mod._parameters, mod._buffers):
                    for t_name, t in coll.items():
                        full = f"{mod_name}.{t_name}" if mod_name else t_name
                        if t is not None and t.is_floating_point() and any(pt in full for pt in pats):
                            t.data = t.data.to(torch.float32)
                            kept_fp32.append(full)
        if kept_fp32:
            log(f"  kept in float32 (_keep_in_fp32_modules_strict {pats}): {len(kept_fp32)} tensors")
        if tied and model.get_input_embeddings().weight is not model.get_output_embeddings().weight:
            raise AssertionError("tied weights came apart during dtype conversion")
    saved_sd = {k: t.detach().to(torch.float32).clone() for k, t in model.state_dict().items()}

    save_kwargs = {}
    if sharded:
        save_kwargs["max_shard_size"] = SHARD_SIZE
    model.save_pretrained(out, **save_kwargs)

    files = sorted(os.listdir(out))
    wfiles = weight_files(out)
    if "config.json" not in files:
        raise AssertionError(f"config.json not written: {files}")
    if sharded:
        if "model.safetensors.index.json" not in files:
            raise AssertionError(f"sharded save wrote no index: {files}")
        if "model.safetensors" in files or len(wfiles) < 2:
            raise AssertionError(f"sharded save did not shard: {files}")
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            index = json.load(f)
        if sorted(set(index["weight_map"].values())) != wfiles:
            raise AssertionError(f"index weight_map files {sorted(set(index['weight_map'].values()))} != {wfiles}")
    else:
        if wfiles != ["model.safetensors"] or "model.safetensors.index.json" in files:
            raise AssertionError(f"single-file save expected, got {files}")

    # tensor names / dtypes actually stored
    stored = {}
    for wf in wfiles:
        for k, meta in safetensors_header(os.path.join(out, wf)).items():
            if k in stored:
                raise AssertionError(f"tensor {k} stored twice")
            stored[k] = (meta["dtype"], meta["shape"], wf)
    want_dt = SAFETENSORS_DTYPE[storage]
    for k, (dt, shape, _) in stored.items():
        exp = "F32" if any(pt in k for pt in keep_fp32_patterns(model)) else want_dt
        if dt != exp:
            raise AssertionError(f"stored tensor {k} has dtype {dt}, expected {exp}")
    for k in v.get("expect_tensors", []):
        if k not in stored:
            raise AssertionError(f"expected tensor {k} not in checkpoint")
    for k in v.get("absent_tensors", []):
        if k in stored:
            raise AssertionError(f"tensor {k} should not be in the checkpoint")
    dtypes_stored = sorted({dt for dt, _, _ in stored.values()})
    log(f"  wrote {files}; {len(stored)} tensors, dtypes {dtypes_stored}")

    # zero-tensor check (every stored tensor was perturbed) and non-zero routing bias
    from safetensors import safe_open

    for wf in wfiles:
        with safe_open(os.path.join(out, wf), framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                if t.numel() and not bool((t != 0).any()):
                    raise AssertionError(f"stored tensor {k} is all zeros")

    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        saved_cfg = json.load(f)
    for k, want in v.get("expect_config", {}).items():
        check_equal(f"saved config.json[{k!r}]", saved_cfg.get(k, "<missing>"), want)
    if v["model_type"] == "kimi_linear":
        lac = saved_cfg.get("linear_attn_config", {})
        check_equal("linear_attn_config", lac, v["fields"]["linear_attn_config"])

    # 4. legacy layout
    if legacy:
        new_cfg = rewrite_legacy_rope(os.path.join(out, "config.json"), legacy)
        log(f"  legacy layout: rope_theta={new_cfg.get('rope_theta')!r} rope_scaling={new_cfg.get('rope_scaling')!r}")

    # 5. reload exactly as a user would
    res = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    if isinstance(res, tuple):
        model2, info = res
    else:  # pragma: no cover - defensive
        model2, info = res, {}
    model2.eval()
    problems = {k: val for k, val in (info or {}).items() if val and k != "skipped_pp_keys"}
    if problems:
        raise AssertionError(f"loading report not clean: {problems}")
    rp2 = getattr(model2.config, "rope_parameters", None)
    log(f"  reloaded {type(model2).__name__}: rope_parameters={rp2!r}")
    for k in ("layer_types", "mlp_layer_types"):
        if getattr(model2.config, k, None) is not None:
            log(f"  reloaded {k}={list(getattr(model2.config, k))}")
    for k, want in v.get("expect_config", {}).items():
        check_equal(f"reloaded config.{k}", getattr(model2.config, k, "<missing>"), want)
    for k, want in v.get("expect_rope", {}).items():
        check_equal(f"reloaded rope_parameters[{k!r}]", (rp2 or {}).get(k, "<missing>"), want)
    if legacy:
        # the legacy layout must mean the same rope as the layout the model was built with
        orig = {k: val for k, val in config.rope_parameters.items() if k != "type"}
        got = {k: val for k, val in (rp2 or {}).items() if k != "type"}
        check_equal("legacy rope_parameters (without 'type')", got, orig)
    if tied and model2.get_input_embeddings().weight is not model2.get_output_embeddings().weight:
        raise AssertionError("reloaded model: lm_head is not tied to embed_tokens")

    sd2 = model2.state_dict()
    if sorted(sd2.keys()) != sorted(saved_sd.keys()):
        a, b = set(sd2), set(saved_sd)
        raise AssertionError(f"state dict keys differ: only reloaded {sorted(a - b)[:5]}, only saved {sorted(b - a)[:5]}")
    for k, t in saved_sd.items():
        t2 = sd2[k]
        if t2.dtype != torch.float32:
            raise AssertionError(f"reloaded {k} has dtype {t2.dtype}")
        if t2.shape != t.shape or not torch.equal(t2, t):
            raise AssertionError(f"reloaded tensor {k} differs from the saved one")

    # in-memory model (back in f32, with its f32 rope buffers) vs reloaded model: same logits
    model.to(torch.float32)
    for key, (mod, b_name) in np_bufs.items():
        mod._buffers[b_name] = saved_np[key]
    vocab = model2.config.vocab_size
    lens = v.get("prompt_lens", DEFAULT_PROMPT_LENS)
    rng = random.Random(seed * 1000 + 7)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]

    def full_logits(m, ids):
        with torch.no_grad():
            o = m(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
        return o.logits[0].to(torch.float32)

    la = full_logits(model, prompts[-1])
    lb = full_logits(model2, prompts[-1])
    if not torch.equal(la, lb):
        rel = float((la - lb).norm() / lb.norm())
        if rel > 1e-5:  # a legacy layout read differently, a weight not loaded, ...
            raise AssertionError(f"in-memory and reloaded models disagree: rel err {rel:.3e}")
        log(f"  WARNING: in-memory vs reloaded logits differ slightly (rel {rel:.3e})")
    else:
        log("  in-memory and reloaded models give identical logits")
    del model

    # 6. reference outputs from the reloaded model
    n_new = v.get("new_tokens", DEFAULT_NEW_TOKENS)
    cases = []
    min_gap = math.inf
    for pi, prompt in enumerate(prompts):
        seq = list(prompt)
        greedy, gaps, decode_logits = [], [], []
        last_logits = argmax_pp = None
        for step in range(n_new):
            logits = full_logits(model2, seq)
            row = logits[-1]
            if step == 0:
                last_logits = row.tolist()
                argmax_pp = [int(x) for x in logits.argmax(dim=-1).tolist()]
            elif step <= N_DECODE_LOGITS:
                decode_logits.append(row.tolist())
            top = torch.topk(row, 2).values
            tok = int(torch.argmax(row))
            gap = float(top[0] - top[1])
            greedy.append(tok)
            gaps.append(gap)
            seq.append(tok)
        min_gap = min(min_gap, min(gaps))
        if not all(math.isfinite(x) for x in last_logits):
            raise AssertionError("non-finite logits")
        cases.append(
            dict(
                prompt=prompt,
                greedy=greedy,
                last_logits=last_logits,
                decode_logits=decode_logits,
                greedy_gaps=gaps,
                argmax_per_position=argmax_pp,
            )
        )
        log(f"  case {pi}: prompt {len(prompt)} tokens, greedy[:8]={greedy[:8]}, min gap {min(gaps):.3e}")
    if min_gap < 1e-3:
        log(f"  NOTE: min_greedy_gap {min_gap:.3e} < 1e-3: a near tie; the comparison rule tolerates a divergence there")

    expected = {
        "model_type": v["model_type"],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "storage_dtype": STORAGE_NAMES[storage],
        "variant": name,
        "attn_implementation": model2.config._attn_implementation,
        "min_greedy_gap": min_gap,
        "cases": cases,
    }
    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f)

    files = sorted(os.listdir(out))
    total = dir_bytes(out)
    log(
        f"SUMMARY {name}: files={files} bytes={total} min_greedy_gap={min_gap:.6g} "
        f"storage={STORAGE_NAMES[storage]} ({time.time() - t0:.1f}s)"
    )
    return total


# --------------------------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------------------------
def write_readme(out_root, tf_version, torch_version):
    lines = [
        "# More tiny Hugging Face checkpoints: layout and model variants",
        "",
        "One folder per variant, each a standard Hugging Face checkpoint (`config.json`,",
        "`generation_config.json`, `model.safetensors` or a sharded `model-0000k-of-0000n.safetensors` set",
        "with `model.safetensors.index.json`) plus `expected.json`. They complement the per-family",
        "fixtures in `fixtures/hf` (same `expected.json` format, see its README.md).",
        "",
        f"Made by `tools/gen_hf_fixtures.py` with transformers {tf_version} and torch {torch_version} on CPU:",
        "the model class for the `model_type`, default initialisation, then every parameter and every",
        "saved buffer (including DeepSeek/Kimi `e_score_correction_bias`, so it is not zero here) perturbed",
        "by N(0, 0.05) noise in float32; then cast to the storage dtype and saved with `save_pretrained`",
        "(tensors listed in the class's `_keep_in_fp32_modules_strict`, i.e. `e_score_correction_bias`,",
        "stay float32, as `from_pretrained(dtype=bf16)` keeps them). Legacy-layout variants had",
        "`config.json` rewritten afterwards to the old form: top-level `rope_theta` and a `rope_scaling`",
        'dict naming its type with `"type"` or `"rope_type"`.',
        "",
        "All reference outputs come from the checkpoint **reloaded** with",
        "`AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)`: bf16/f16 weights upcast to",
        "float32, legacy configs interpreted by transformers itself.",
        "",
        "| folder | model_type | storage | what it exercises |",
        "|---|---|---|---|",
    ]
    for v in VARIANTS:
        st = STORAGE_NAMES[v.get("storage", "f32")]
        st += ", sharded" if v.get("sharded") else ", single file"
        if v.get("legacy_rope"):
            st += f', legacy rope layout ("{v["legacy_rope"]}")'
        lines.append(f"| {v['name']} | {v['model_type']} | {st} | {v['exercises']} |")
    lines += [
        "",
        "`expected.json` has the keys of `fixtures/hf` (`model_type`, `transformers`, `torch`, `dtype`,",
        "`min_greedy_gap`, `cases` with `prompt`, `greedy`, `last_logits`, `decode_logits`, `greedy_gaps`,",
        "`argmax_per_position`) plus `variant`, `storage_dtype` and `attn_implementation`. Here the prompts",
        f"are {', '.join(map(str, DEFAULT_PROMPT_LENS))} tokens long (seeded random ids in [3, vocab_size)) and",
        f"`greedy` has {DEFAULT_NEW_TOKENS} tokens; `decode_logits` has {N_DECODE_LOGITS} vectors (`decode_logits[j]`",
        "chose `greedy[j+1]`). Every greedy step was a full forward over the whole sequence (no cache),",
        "ignoring end-of-sequence, in float32. The comparison rule of `fixtures/hf/README.md` applies:",
        "exact greedy tokens, logits to relative error well under 1e-4, and a step whose `greedy_gaps`",
        "entry is under 1e-3 may pick the other token.",
        "",
        "Greedy continuations of tiny random models are often repetitive (the tied-embedding llama",
        "variant mostly repeats a single token, whatever the seed); the logits vectors (`last_logits`,",
        "`decode_logits`) and `argmax_per_position` carry most of the test.",
        "",
        "These checkpoints are random weights made for this project; use them freely.",
        "",
    ]
    with open(os.path.join(out_root, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


# --------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", help="output folder (one sub-folder per variant)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these variants")
    ap.add_argument("--list", action="store_true", help="list the variants and exit")
    ap.add_argument(
        "--allow-other-versions",
        action="store_true",
        help=f"run even if transformers is not {EXPECTED_TRANSFORMERS} (fixtures would not be the reference)",
    )
    args = ap.parse_args(argv)

    if args.list:
        for v in VARIANTS:
            log(f"{v['name']:34s} {v['model_type']:13s} {STORAGE_NAMES[v.get('storage', 'f32')]}")
        return 0
    if not args.out_dir:
        ap.error("OUT_DIR is required")
    names = args.only or [v["name"] for v in VARIANTS]
    unknown = [n for n in names if n not in VARIANT_BY_NAME]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {list(VARIANT_BY_NAME)}")

    import torch
    import transformers

    log(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        msg = f"transformers {transformers.__version__} is not {EXPECTED_TRANSFORMERS}"
        if not args.allow_other_versions:
            log(f"ERROR: {msg} (use --allow-other-versions to run anyway)")
            return 2
        log(f"WARNING: {msg}")
    if not torch.__version__.startswith("2.11"):
        log(f"WARNING: torch {torch.__version__} is not 2.11")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:  # keep the log readable: no per-file progress bars
        transformers.utils.logging.disable_progress_bar()
    except Exception:
        pass

    os.makedirs(args.out_dir, exist_ok=True)
    write_readme(args.out_dir, transformers.__version__, torch.__version__)

    failed, totals = [], {}
    for n in names:
        v = VARIANT_BY_NAME[n]
        log(f"=== {n} ({v['model_type']}, seed {v['seed']})")
        try:
            totals[n] = run_variant(v, args.out_dir, torch, transformers)
        except Exception:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            log(f"FAILED {n}")
            failed.append(n)

    grand = sum(totals.values())
    log(f"done: {len(totals)} ok, {len(failed)} failed; {grand} bytes in variant folders")
    if grand > 12_000_000:
        log("WARNING: output is over 12 MB")
    if failed:
        log(f"failed variants: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
