//! Multi-head latent attention (MLA) in its absorbed form, after DeepSeek-V2/V3 and transformers'
//! `DeepseekV3Attention`; DeepSeek-V3, DeepSeek-V3.2 (with the [`Indexer`] picking the keys) and
//! Kimi Linear's NoPE attention layers use it.
//!
//! The cache row per token and layer is `[latent: kv_lora_rank | rope key: qk_rope_head_dim]`
//! (then V3.2's index key): the RMS-normalised compressed KV and the rotated shared rope key.
//! Attention runs in the absorbed form, which is the same math as transformers' expanded keys and
//! values: `q_nope·(W_uk·c) = (W_ukᵀ·q_nope)·c` and `Σ p·(W_uv·c) = W_uv·(Σ p·c)`. So each head's
//! query becomes `[W_ukᵀ q_nope | q_rope]` against the cache row, its value is the latent itself,
//! and `W_uv` is applied after the softmax.
//!
//! Shapes for `t` rows: `x [t × hidden]` → queries `[t × heads·(nope + rope)]` and compressed KV
//! `[t × (kv_lora + rope)]` → absorbed queries `[t × heads·(kv_lora + rope)]` → latent outputs
//! `[t × heads·kv_lora]` → values `[t × heads·v_head_dim]` → `[t × hidden]`.

use super::indexer::Indexer;
use super::layers::{Linear, RmsNorm};
use crate::checkpoint::{LoadError, WeightSource};
use crate::cpu::attention::{attend_row, AttentionShape};
use crate::cpu::gemm::PackedMatrix;
use crate::cpu::rope::Rope;
use crate::kv::KvLayer;
use crate::models::batch::BatchLayout;

/// transformers builds `q_a_layernorm` and `kv_a_layernorm` with the default eps, not
/// `rms_norm_eps`.
const LATENT_NORM_EPS: f32 = 1e-6;

/// How queries are projected: through a LoRA bottleneck with its own norm, or directly.
pub enum QueryProjection {
    Lora { a: Linear, norm: RmsNorm, b: Linear },
    Plain(Linear),
}

impl QueryProjection {
    /// The queries, and the normalised LoRA latent when there is one (V3.2's indexer reads it).
    fn forward(&self, x: &[f32], t: usize) -> (Vec<f32>, Option<Vec<f32>>) {
        match self {
            QueryProjection::Lora { a, norm, b } => {
                let mut qa = a.forward(x, t);
                norm.forward_inplace(&mut qa);
                (b.forward(&qa, t), Some(qa))
            }
            QueryProjection::Plain(q) => (q.forward(x, t), None),
        }
    }

    /// Multiply-adds per token.
    pub fn macs_per_row(&self) -> usize {
        match self {
            QueryProjection::Lora { a, b, .. } => a.macs_per_row() + b.macs_per_row(),
            QueryProjection::Plain(q) => q.macs_per_row(),
        }
    }
}

/// Latent attention of one layer.
pub struct MlaAttention {
    pub(crate) q: QueryProjection,
    pub(crate) kv_a: Linear,
    pub(crate) kv_norm: RmsNorm,
    /// Per head, `W_ukᵀ`: q_nope (`qk_nope_head_dim`) → latent space (`kv_lora_rank`).
    pub(crate) absorb_k: Vec<PackedMatrix>,
    /// Per head, `W_uv`: latent (`kv_lora_rank`) → value (`v_head_dim`).
    pub(crate) absorb_v: Vec<PackedMatrix>,
    pub(crate) o: Linear,
    /// `None`: no positional encoding (Kimi Linear's MLA layers are NoPE).
    pub(crate) rope: Option<Rope>,
    /// DeepSeek-V3.2's sparse-attention indexer: which keys each query attends to.
    pub(crate) indexer: Option<Indexer>,
    pub(crate) heads: usize,
    pub(crate) nope: usize,
    pub(crate) rope_dim: usize,
    pub(crate) v_dim: usize,
    pub(crate) kv_lora: usize,
    pub(crate) scale: f32,
}

/// The sizes of an MLA layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MlaDims {
    pub hidden: usize,
    pub heads: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
}

impl MlaAttention {
    /// Cache row: `[latent | rope key | index key (V3.2)]`.
    pub fn kv_row_width(&self) -> usize {
        self.kv_lora + self.rope_dim + self.indexer.as_ref().map_or(0, Indexer::key_width)
    }

    pub fn forward(&self, x: &[f32], layout: &BatchLayout, kv: &mut KvLayer) -> Vec<f32> {
        let t = layout.rows;
        let (h, nope, rd, lora) = (self.heads, self.nope, self.rope_dim, self.kv_lora);
        let qk = nope + rd;
        // 1. queries                                              [t × heads·(nope + rope)]
        let (mut q, q_latent) = self.q.forward(x, t);
        // 2. compressed kv: normalised latent and rotated rope key (and V3.2's index key) → cache
        let ckv = self.kv_a.forward(x, t);
        let index_keys = self.indexer.as_ref().map(|ix| ix.index_keys(x, layout));
        let width = self.kv_row_width();
        for r in 0..t {
            let mut cached = vec![0.0f32; width];
            cached[..lora + rd].copy_from_slice(&ckv[r * (lora + rd)..(r + 1) * (lora + rd)]);
            self.kv_norm.forward_inplace(&mut cached[..lora]);
            if let Some(rope) = &self.rope {
                let (cos, sin) = rope.cos_sin(layout.positions[r]);
                rope.rotate_heads(&mut cached[lora..lora + rd], rd, &cos, &sin);
                let qr = &mut q[r * h * qk..(r + 1) * h * qk];
                for head in qr.chunks_exact_mut(qk) {
                    rope.rotate_heads(&mut head[nope..], rd, &cos, &sin);
                }
            }
            if let (Some(ix), Some(keys)) = (&self.indexer, &index_keys) {
                let kw = ix.key_width();
                cached[lora + rd..].copy_from_slice(&keys[r * kw..(r + 1) * kw]);
            }
            kv.row_mut(layout.write_row(r)).copy_from_slice(&cached);
        }
        // 2b. V3.2: the keys each query may attend to
        let selected = self.indexer.as_ref().map(|ix| {
            let latent = q_latent.as_ref().expect("the V3.2 indexer needs the q LoRA latent");
            ix.select(latent, x, layout, kv, lora + rd)
        });
        // 3. absorbed queries [W_ukᵀ q_nope | q_rope] per head     [t × heads·(lora + rope)]
        let aq = lora + rd;
        let mut absorbed = vec![0.0f32; t * h * aq];
        for head in 0..h {
            let q_nope: Vec<f32> =
                (0..t).flat_map(|r| q[(r * h + head) * qk..(r * h + head) * qk + nope].iter().copied()).collect();
            let q_lat = self.absorb_k[head].apply(&q_nope, t);
            for r in 0..t {
                let dst = &mut absorbed[(r * h + head) * aq..(r * h + head + 1) * aq];
                dst[..lora].copy_from_slice(&q_lat[r * lora..(r + 1) * lora]);
                dst[lora..].copy_from_slice(&q[(r * h + head) * qk + nope..(r * h + head + 1) * qk]);
            }
        }
        // 4. attention in latent space                            [t × heads·lora]
        let shape = AttentionShape {
            q_heads: h,
            kv_heads: 1,
            qk_dim: aq,
            v_dim: lora,
            k_offset: 0,
            v_offset: 0,
            scale: self.scale,
        };
        let mut o_lat = vec![0.0f32; t * h * lora];
        let mut scores = Vec::new();
        for r in 0..t {
            let keys = match &selected {
                Some(sel) => &sel[r][..],
                None => layout.visible_rows(r, None),
            };
            attend_row(
                &shape,
                &absorbed[r * h * aq..(r + 1) * h * aq],
                kv,
                keys,
                &mut o_lat[r * h * lora..(r + 1) * h * lora],
                &mut scores,
            );
        }
        // 5. values out of latent space, then the output projection [t × hidden]
        let mut attn = vec![0.0f32; t * h * self.v_dim];
        for head in 0..h {
            let lat: Vec<f32> =
                (0..t).flat_map(|r| o_lat[(r * h + head) * lora..(r * h + head + 1) * lora].iter().copied()).collect();
            let v = self.absorb_v[head].apply(&lat, t);
            for r in 0..t {
                attn[(r * h + head) * self.v_dim..(r * h + head + 1) * self.v_dim]
                    .copy_from_slice(&v[r * self.v_dim..(r + 1) * self.v_dim]);
            }
        }
        self.o.forward(&attn, t)
    }

    pub fn macs_per_row(&self) -> usize {
        self.q.macs_per_row()
            + self.indexer.as_ref().map_or(0, Indexer::macs_per_row)
            + self.kv_a.macs_per_row()
            + self.heads * (self.nope + self.v_dim) * self.kv_lora
            + self.o.macs_per_row()
    }

    pub fn attention_macs(&self, ctx: usize) -> usize {
        let keys = self.indexer.as_ref().map_or(ctx, |ix| ctx.min(ix.topk()));
        self.heads * (2 * self.kv_lora + self.rope_dim) * keys
            + self.indexer.as_ref().map_or(0, |ix| ix.scoring_macs(ctx))
    }
}

/// Loads one layer's latent attention under `{prefix}` (= `model.layers.{l}.self_attn`).
impl MlaDims {
    /// Parameters of one latent attention layer of these sizes (projections and norms).
    pub(crate) fn params(&self) -> u128 {
        let [h, heads, kv, nope, rope, v] =
            [self.hidden, self.heads, self.kv_lora, self.nope, self.rope_dim, self.v_dim].map(|x| x as u128);
        let q = match self.q_lora_rank {
            Some(r) => h * r as u128 + r as u128 + r as u128 * heads * (nope + rope),
            None => h * heads * (nope + rope),
        };
        q + h * (kv + rope) + kv + heads * (nope + v) * kv + heads * v * h
    }
}

pub(crate) fn load_mla(
    w: &dyn WeightSource,
    prefix: &str,
    dims: MlaDims,
    bias: bool,
    rope: Option<Rope>,
    indexer: Option<Indexer>,
    scale: f32,
) -> Result<MlaAttention, LoadError> {
    let MlaDims { hidden, heads, q_lora_rank, kv_lora, nope, rope_dim, v_dim } = dims;
    let qk = nope + rope_dim;
    let q = match q_lora_rank {
        Some(rank) => QueryProjection::Lora {
            a: Linear::load(w, &format!("{prefix}.q_a_proj"), hidden, rank, bias)?,
            norm: RmsNorm::load(w, &format!("{prefix}.q_a_layernorm.weight"), rank, LATENT_NORM_EPS)?,
            b: Linear::load(w, &format!("{prefix}.q_b_proj"), rank, heads * qk, false)?,
        },
        None => QueryProjection::Plain(Linear::load(w, &format!("{prefix}.q_proj"), hidden, heads * qk, false)?),
    };
    let mut absorb_k = Vec::with_capacity(heads);
    let mut absorb_v = Vec::with_capacity(heads);
    let kv_b = match w.shapes_only() {
        true => Vec::new(),
        false => w.tensor(&format!("{prefix}.kv_b_proj.weight"), &[heads * (nope + v_dim), kv_lora])?,
    };
    for head in 0..heads {
        if w.shapes_only() {
            absorb_k.push(PackedMatrix::shape_only(kv_lora, nope));
            absorb_v.push(PackedMatrix::shape_only(v_dim, kv_lora));
            continue;
        }
        let base = head * (nope + v_dim) * kv_lora;
        // rows [nope × lora] of W_uk: q_lat = q_nope · W_uk
        absorb_k.push(PackedMatrix::from_columns(&kv_b[base..base + nope * kv_lora], nope, kv_lora));
        // rows [v × lora] of W_uv: v = W_uv · latent
        absorb_v.push(PackedMatrix::from_rows(
            &kv_b[base + nope * kv_lora..base + (nope + v_dim) * kv_lora],
            v_dim,
            kv_lora,
        ));
    }
    Ok(MlaAttention {
        q,
        kv_a: Linear::load(w, &format!("{prefix}.kv_a_proj_with_mqa"), hidden, kv_lora + rope_dim, bias)?,
        kv_norm: RmsNorm::load(w, &format!("{prefix}.kv_a_layernorm.weight"), kv_lora, LATENT_NORM_EPS)?,
        absorb_k,
        absorb_v,
        o: Linear::load(w, &format!("{prefix}.o_proj"), heads * v_dim, hidden, bias)?,
        rope,
        indexer,
        heads,
        nope,
        rope_dim,
        v_dim,
        kv_lora,
        scale,
    })
}
