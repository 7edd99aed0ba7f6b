//! Causal attention of query rows against keys and values read from the paged cache.
//!
//! One query row attends to the cache rows listed for it, in position order: scores
//! `q·k × scale`, a softmax whose max, exponentials and sum run over the keys in that order, and
//! `Σ p_j v_j` accumulated in the same order. Nothing depends on other rows, on chunk boundaries
//! or on the batch, so the result is batch-invariant. The same kernel serves grouped-query
//! attention (each key/value head shared by `q_heads / kv_heads` query heads) and absorbed MLA
//! (one shared "head" whose key is `[latent | rope key]` and whose value is the latent itself).

use super::simd::{axpy_rows, dot, Best};
use crate::kv::KvLayer;

/// Where keys and values sit in a cache row, and how heads share them.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    /// Width of one query head and one key head.
    pub qk_dim: usize,
    /// Width of one value head (and of one output head).
    pub v_dim: usize,
    /// Offset of key head 0 in a cache row; key head `g` follows at `g · qk_dim`.
    pub k_offset: usize,
    /// Offset of value head 0 in a cache row; value head `g` follows at `g · v_dim`.
    pub v_offset: usize,
    /// Multiplies `q·k` before the softmax.
    pub scale: f32,
}

/// Attends one query row (`q_heads × qk_dim`) to the cache rows `keys` (in position order),
/// writing `q_heads × v_dim` values into `out`. `scores` is scratch space.
pub fn attend_row(
    shape: &AttentionShape,
    q: &[f32],
    layer: &KvLayer,
    keys: &[usize],
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let AttentionShape { q_heads, kv_heads, qk_dim, v_dim, k_offset, v_offset, scale } = *shape;
    debug_assert_eq!(q.len(), q_heads * qk_dim);
    debug_assert_eq!(out.len(), q_heads * v_dim);
    let group = q_heads / kv_heads;
    scores.resize(keys.len(), 0.0);
    out.fill(0.0);
    for h in 0..q_heads {
        let g = h / group;
        let qh = &q[h * qk_dim..(h + 1) * qk_dim];
        let (k0, v0) = (k_offset + g * qk_dim, v_offset + g * v_dim);
        let mut max = f32::NEG_INFINITY;
        for (s, &r) in scores.iter_mut().zip(keys) {
            *s = dot::<Best>(qh, &layer.row(r)[k0..k0 + qk_dim]) * scale;
            max = max.max(*s);
        }
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let oh = &mut out[h * v_dim..(h + 1) * v_dim];
        for s in scores.iter_mut() {
            *s /= sum;
        }
        axpy_rows::<Best>(oh, keys.len(), |k| (scores[k], &layer.row(keys[k])[v0..v0 + v_dim]));
    }
}
