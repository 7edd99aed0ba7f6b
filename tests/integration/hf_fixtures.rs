//! The executor reproduces transformers' own outputs on the tiny checkpoints in fixtures/hf
//! (greedy tokens exact, every logits vector within 1e-4), and on the extra checkpoints in
//! fixtures/hf-extra that vary shapes, seeds, rope settings and storage layouts.

use crate::common::{fixture, reproduce_fixture};

#[test]
fn llama_reproduces_transformers() {
    reproduce_fixture(&fixture("hf/llama"), 64);
}

#[test]
fn qwen3_reproduces_transformers() {
    reproduce_fixture(&fixture("hf/qwen3"), 64);
}

#[test]
fn deepseek_v3_reproduces_transformers() {
    reproduce_fixture(&fixture("hf/deepseek_v3"), 64);
}

/// Other shapes, seeds and prompts of about 300 tokens with 40 new tokens (fixtures/hf-extra,
/// made by tools/gen_hf_fixtures.py with transformers 5.17.0).
fn extra(name: &str) {
    reproduce_fixture(&fixture(&format!("hf-extra/{name}")), 64);
}

#[test]
fn llama_bf16_tied_embeddings_and_legacy_linear_rope_reproduce_transformers() {
    extra("llama_bf16_tied_legacy_linear");
}

#[test]
fn llama_sharded_checkpoint_with_llama3_rope_reproduces_transformers() {
    extra("llama_llama3_sharded");
}

#[test]
fn qwen3_f16_with_yarn_and_wide_heads_reproduces_transformers() {
    extra("qwen3_yarn_wide_head");
}

#[test]
fn qwen3_sliding_window_with_legacy_llama3_rope_reproduces_transformers() {
    extra("qwen3_sliding_legacy_llama3");
}

#[test]
fn deepseek_v3_plain_q_yarn_bf16_reproduces_transformers() {
    extra("deepseek_v3_plain_q_yarn_bf16");
}

#[test]
fn deepseek_v3_sharded_with_legacy_yarn_reproduces_transformers() {
    extra("deepseek_v3_legacy_yarn_sharded");
}
