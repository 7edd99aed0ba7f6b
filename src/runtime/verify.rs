//! `--verify` (DESIGN §11): every request, warmup included, is run again on the reference path —
//! `kvflow generate` on that one request: no pools, no prefix cache, no transfer — and its tokens
//! and the hash of the bit patterns of its logits at every sampled position are compared with the
//! run's. Exact, because the executor is batch-invariant. Touches no report counter.

use crate::generate::{generate, GenerateOptions};
use crate::report::{RequestRecord, VerifySummary};
use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use kvflow_kernels::models::Model;

pub fn verify(
    model: &Model,
    records: &[RequestRecord],
    chunk_tokens: usize,
    show_progress: bool,
) -> Result<VerifySummary> {
    let mut summary = VerifySummary::default();
    let bar = if show_progress { ProgressBar::new(records.len() as u64) } else { ProgressBar::hidden() };
    bar.set_style(ProgressStyle::with_template("verify {bar:30} {pos}/{len}").expect("valid template"));
    for r in records {
        bar.inc(1);
        if r.error.is_some() || r.output_tokens.is_empty() {
            continue;
        }
        let opts = GenerateOptions { max_new_tokens: r.output_tokens.len(), chunk_tokens, ..Default::default() };
        let reference = generate(model, std::slice::from_ref(&r.prompt_tokens), &opts)?.remove(0);
        summary.checked += 1;
        if reference.tokens != r.output_tokens || reference.logits_hash != r.logits_hash {
            summary.mismatched += 1;
            summary.mismatched_ids.push(r.id);
        }
        summary.checked_ids.push(r.id);
    }
    bar.finish_and_clear();
    Ok(summary)
}
