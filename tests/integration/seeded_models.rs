//! Seeded random models built from a TOML spec: deterministic, seed-sensitive, any family.

use kvflow::generate::{generate, GenerateOptions};
use kvflow_kernels::checkpoint::ModelSpec;
use kvflow_kernels::models;

const MLA_SPEC: &str = r#"
model_type = "deepseek_v3"
seed = 11
vocab_size = 300
hidden_size = 48
intermediate_size = 64
moe_intermediate_size = 16
num_hidden_layers = 3
num_attention_heads = 3
q_lora_rank = 24
kv_lora_rank = 16
qk_nope_head_dim = 8
qk_rope_head_dim = 8
v_head_dim = 8
n_routed_experts = 6
num_experts_per_tok = 2
n_group = 3
topk_group = 2
first_k_dense_replace = 1
"#;

fn tokens(spec: &str) -> Vec<u32> {
    let spec = ModelSpec::parse("spec.toml".into(), spec).unwrap();
    let model = models::build(&spec.config, &spec.weights).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 290 + 3) as u32).collect();
    let opts = GenerateOptions { max_new_tokens: 12, chunk_tokens: 16, ..Default::default() };
    generate(&model, &[prompt], &opts).unwrap().remove(0).tokens
}

#[test]
fn a_spec_always_builds_the_same_model() {
    assert_eq!(tokens(MLA_SPEC), tokens(MLA_SPEC));
}

#[test]
fn another_seed_builds_another_model() {
    let a = tokens(MLA_SPEC);
    let b = tokens(&MLA_SPEC.replace("seed = 11", "seed = 12"));
    assert_ne!(a, b);
}

#[test]
fn a_spec_without_a_seed_is_rejected_by_name() {
    let e = ModelSpec::parse("spec.toml".into(), "model_type = \"llama\"").err().unwrap().to_string();
    assert!(e.contains("spec.toml") && e.contains("seed"), "{e}");
}
