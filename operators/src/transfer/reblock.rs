//! A handoff from a pool of another block size (DESIGN §8). A handoff's KV is packed by layer,
//! and within a layer its blocks' rows follow one another: the prompt's token rows from the
//! first block sent, then padding to a whole block. So a producer's blocks of one size become
//! a consumer's blocks of another by cutting each layer's rows again — the same rows, from the
//! token the consumer's first missing block starts at, zeros past the prompt. The consumer's
//! inbox does it before the handoff is taken, checked against the consumer's own layout.

use super::Handoff;
use std::sync::Arc;

/// `h` (from a pool whose blocks hold `h.block_size` tokens) as blocks of `block_size` tokens,
/// the consumer's, whose layers hold `kv_rows` floats a token each. The consumer already holds
/// the prompt's first `h.to`'s `skip_tokens` (whole blocks of its own): they are not carried.
pub fn reblock(h: &Handoff, block_size: usize, kv_rows: &[usize]) -> Result<Handoff, String> {
    let per_token: usize = kv_rows.iter().sum();
    if block_size == 0 || h.block_size == 0 || per_token * h.block_size != h.floats_per_block {
        return Err(format!(
            "a handoff of {} floats a block of {} tokens cannot become blocks of {block_size} tokens of {per_token} \
             floats a token (layout)",
            h.floats_per_block, h.block_size
        ));
    }
    let prompt_len = h.prompt.len();
    let from_start = h.skip_blocks * h.block_size;
    let from_rows = (h.kv_blocks * h.block_size).min(prompt_len.saturating_sub(from_start));
    let skip = h.to.map_or(0, |b| b.skip_tokens as usize) / block_size;
    let to_start = skip * block_size;
    if to_start < from_start {
        return Err(format!(
            "the handoff starts at token {from_start}, but this rank holds only the first {to_start} (blocks of \
             {block_size})"
        ));
    }
    let to_blocks = prompt_len.div_ceil(block_size).saturating_sub(skip);
    let from = h.kv_floats();
    if h.simulated.is_some() {
        // sizes without bytes: only the blocks are cut again
        let mut cut = recut(h, block_size, skip, to_blocks, per_token * block_size, Vec::new());
        cut.simulated = h.simulated;
        return Ok(cut);
    }
    if from.len() != h.kv_blocks * h.floats_per_block {
        return Err(format!(
            "the handoff carries {} KV floats, {} expected",
            from.len(),
            h.kv_blocks * h.floats_per_block
        ));
    }
    let mut kv = vec![0.0; to_blocks * block_size * per_token];
    let (mut from_layer, mut to_layer) = (0, 0);
    for &width in kv_rows {
        // Rows of tokens to_start.. that the producer sent: at from_start.. in its layer.
        let first = to_start - from_start;
        let rows = from_rows.saturating_sub(first).min(to_blocks * block_size);
        let src = &from[from_layer + first * width..from_layer + (first + rows) * width];
        kv[to_layer..to_layer + rows * width].copy_from_slice(src);
        from_layer += h.kv_blocks * h.block_size * width;
        to_layer += to_blocks * block_size * width;
    }
    Ok(recut(h, block_size, skip, to_blocks, per_token * block_size, kv))
}

/// `h` in blocks of `block_size` tokens: `blocks` of them after the `skip` the consumer holds,
/// `floats_per_block` each, carrying `kv`.
fn recut(h: &Handoff, block_size: usize, skip: usize, blocks: usize, floats_per_block: usize, kv: Vec<f32>) -> Handoff {
    Handoff {
        transfer: h.transfer,
        request: h.request,
        prompt: h.prompt.clone(),
        max_output_tokens: h.max_output_tokens,
        warmup: h.warmup,
        sampling: h.sampling,
        delivery: h.delivery.clone(),
        drafts: h.drafts.clone(),
        t0: h.t0,
        logits_hash: h.logits_hash,
        fingerprint: h.fingerprint,
        block_size,
        skip_blocks: skip,
        kv_blocks: blocks,
        floats_per_block,
        streamed: Vec::new(),
        kv,
        source: None,
        landed: None,
        state: h.state.clone(),
        started_ms: h.started_ms,
        t0_ms: h.t0_ms,
        to: h.to,
        recycle: None,
        on_drop: Default::default(),
        simulated: None,
    }
}

/// [`reblock`] when `h`'s blocks are not the consumer's, else `h` as it is.
pub fn to_consumer_blocks(h: Arc<Handoff>, block_size: usize, kv_rows: &[usize]) -> Result<Arc<Handoff>, String> {
    if block_size == 0 || h.block_size == block_size || h.kv_blocks == 0 {
        return Ok(h);
    }
    reblock(&h, block_size, kv_rows).map(Arc::new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::BackTo;
    use crate::transfer::wire::tests::handoff;

    /// Layer widths (floats a token) of the two-layer cache the tests use.
    const ROWS: [usize; 2] = [2, 1];

    /// Tokens `from..` of a `prompt`-token prompt as `blocks` blocks of `bs`, packed by layer:
    /// each float names its layer, token and place; rows past the prompt are zeros.
    fn packed(from: usize, blocks: usize, bs: usize, prompt: usize) -> Vec<f32> {
        let mut out = Vec::new();
        for (l, &w) in ROWS.iter().enumerate() {
            for t in from..from + blocks * bs {
                out.extend((0..w).map(|i| if t < prompt { (l * 1000 + t * 10 + i) as f32 } else { 0.0 }));
            }
        }
        out
    }

    fn of_blocks(bs: usize, skip_tokens: usize) -> Handoff {
        let mut h = handoff();
        h.prompt = (0..21).collect();
        h.block_size = bs;
        h.floats_per_block = 3 * bs;
        h.skip_blocks = skip_tokens / bs;
        h.kv_blocks = 21usize.div_ceil(bs) - h.skip_blocks;
        h.kv = packed(h.skip_blocks * bs, h.kv_blocks, bs, 21);
        h.to = Some(BackTo { link: 0, rank: 0, skip_tokens: skip_tokens as u32 });
        h
    }

    #[test]
    fn blocks_of_any_size_become_the_consumers_with_the_same_rows() {
        for from in [4, 8, 16] {
            for to in [4, 8, 16] {
                // The consumer holds its first block of `to` (the producer skips what fits).
                for held in [0, to] {
                    let h = reblock(&of_blocks(from, held), to, &ROWS).unwrap();
                    let skip = held / to;
                    assert_eq!((h.block_size, h.skip_blocks, h.kv_blocks), (to, skip, 21usize.div_ceil(to) - skip));
                    assert_eq!(h.kv, packed(skip * to, h.kv_blocks, to, 21), "{from} → {to}, holding {held}");
                    assert_eq!(h.floats_per_block, 3 * to);
                }
            }
        }
    }

    #[test]
    fn a_handoff_that_does_not_fit_the_consumers_layout_is_refused() {
        assert!(reblock(&of_blocks(4, 0), 8, &[2, 2]).unwrap_err().contains("floats a token"));
        // The producer skipped a block the consumer says it does not hold.
        let mut h = of_blocks(8, 8);
        h.to = Some(BackTo { link: 0, rank: 0, skip_tokens: 0 });
        assert!(reblock(&h, 4, &ROWS).unwrap_err().contains("holds only"));
    }
}
