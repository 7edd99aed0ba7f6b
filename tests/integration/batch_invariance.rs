//! Batch invariance (DESIGN §6): a prompt's logits are bit-identical alone, in a batch with other
//! prompts, and with prefill chunks of 1, 7 and 64 tokens. This is what makes "disaggregated ==
//! aggregated" an exact test later.

use crate::common::{expected, fixture, load};
use kvflow::generate::{generate, GenerateOptions, Generation};

fn bits(g: &Generation) -> (Vec<u32>, Vec<u32>, Vec<Vec<u32>>) {
    (
        g.tokens.clone(),
        g.last_logits.iter().map(|v| v.to_bits()).collect(),
        g.decode_logits.as_ref().unwrap().iter().map(|r| r.iter().map(|v| v.to_bits()).collect()).collect(),
    )
}

fn check_family(name: &str) {
    let dir = fixture(name);
    let model = load(&dir);
    let prompts: Vec<Vec<u32>> = expected(&dir).cases.iter().map(|c| c.prompt.clone()).collect();
    let opts =
        |chunk| GenerateOptions { max_new_tokens: 6, chunk_tokens: chunk, decode_logits: 5, ..Default::default() };
    let together = generate(&model, &prompts, &opts(64)).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let want = bits(&together[i]);
        for chunk in [1, 7, 64] {
            let alone = generate(&model, std::slice::from_ref(p), &opts(chunk)).unwrap();
            assert_eq!(bits(&alone[0]), want, "{name}: prompt {i} alone with chunk {chunk} differs from the batch");
        }
        // In a batch in another order, next to a different mix of prompts.
        let mut mixed: Vec<Vec<u32>> = prompts.iter().rev().cloned().collect();
        mixed.push(p[..p.len().div_ceil(2)].to_vec());
        let j = prompts.len() - 1 - i;
        let shuffled = generate(&model, &mixed, &opts(7)).unwrap();
        assert_eq!(bits(&shuffled[j]), want, "{name}: prompt {i} in a reordered batch differs");
    }
}

#[test]
fn mha_logits_do_not_depend_on_batch_or_chunking() {
    check_family("hf/llama");
    check_family("hf/qwen3");
    // sliding-window layers: the window must not move with chunk boundaries
    check_family("hf-extra/qwen3_sliding_legacy_llama3");
}

#[test]
fn recurrent_family_logits_do_not_depend_on_batch_or_chunking() {
    check_family("hf/qwen3_next");
    check_family("hf/qwen3_next_gdn");
    check_family("hf/kimi_linear");
    check_family("hf-extra/kimi_linear_mla_heavy");
}

#[test]
fn sparse_mla_logits_do_not_depend_on_batch_or_chunking() {
    // prompts longer than index_topk: the indexer really selects, and ties follow the request
    check_family("hf/deepseek_v32");
}

#[test]
fn mla_logits_do_not_depend_on_batch_or_chunking() {
    check_family("hf/deepseek_v3");
    check_family("hf-extra/deepseek_v3_plain_q_yarn_bf16");
}
