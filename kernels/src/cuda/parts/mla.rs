//! Multi-head latent attention on the device (the CPU's is `models::parts::mla`): the queries
//! (through a LoRA or plain), the normalised latent and rope key written to the cache (with V3.2's
//! index key), the queries absorbed into latent space attending there (to the keys V3.2's indexer
//! picked, when it has one), the values out of latent space, then `o_proj` added to the hidden
//! state.

use super::indexer::{self, DevIndexer};
use super::layers::{self, DevLinear, DevNorm, DevRope};
use super::Step;
use crate::cuda::error::CudaError;
use crate::cuda::gpu::DeviceBuf;
use crate::cuda::launch::Arg;
use crate::cuda::weights::Up;
use crate::models::parts::mla::{MlaAttention, QueryProjection};

// Built once per layer at load: the size of a variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum DevQuery {
    Lora { a: DevLinear, norm: DevNorm, b: DevLinear },
    Plain(DevLinear),
}

pub(crate) struct DevMla {
    pub q: DevQuery,
    pub kv_a: DevLinear,
    pub kv_norm: DevNorm,
    /// Per head `[kv_lora × nope]`: q_nope → latent.
    pub absorb_k: DeviceBuf<f32>,
    /// Per head `[v_dim × kv_lora]`: latent → value.
    pub absorb_v: DeviceBuf<f32>,
    pub o: DevLinear,
    /// `None`: Kimi Linear's MLA, whose rope dims are left unrotated.
    pub rope: Option<DevRope>,
    /// DeepSeek-V3.2: the indexer picking each query's keys (`kernels/cuda/indexer.cu`).
    pub indexer: Option<DevIndexer>,
    pub heads: usize,
    pub nope: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
    pub kv_lora: usize,
    pub scale: f32,
}

pub(crate) fn upload(gpu: &Up, a: &MlaAttention) -> Result<DevMla, CudaError> {
    let q = match &a.q {
        QueryProjection::Lora { a: qa, norm: n, b } => {
            DevQuery::Lora { a: layers::linear(gpu, qa)?, norm: layers::norm(gpu, n)?, b: layers::linear(gpu, b)? }
        }
        QueryProjection::Plain(l) => DevQuery::Plain(layers::linear(gpu, l)?),
    };
    let stack = |ms: &[crate::cpu::gemm::PackedMatrix]| ms.iter().flat_map(|m| m.to_rows()).collect::<Vec<f32>>();
    Ok(DevMla {
        q,
        kv_a: layers::linear(gpu, &a.kv_a)?,
        kv_norm: layers::norm(gpu, &a.kv_norm)?,
        absorb_k: gpu.upload(&stack(&a.absorb_k))?,
        absorb_v: gpu.upload(&stack(&a.absorb_v))?,
        o: layers::linear(gpu, &a.o)?,
        rope: a.rope.as_ref().map(|r| layers::rope(gpu, r)).transpose()?,
        indexer: a.indexer.as_ref().map(|ix| indexer::upload(gpu, ix)).transpose()?,
        heads: a.heads,
        nope: a.nope,
        rope_dim: a.rope_dim,
        v_dim: a.v_dim,
        kv_lora: a.kv_lora,
        scale: a.scale,
    })
}

impl Step<'_> {
    pub(crate) fn mla(&self, h: u64, x: u64, a: &DevMla, kv_layer: usize, hidden: usize) -> Result<(), CudaError> {
        let (t, heads, nope, rd, lora) = (self.rows, a.heads, a.nope, a.rope_dim, a.kv_lora);
        let qk = nope + rd;
        // 1. queries [t × heads·qk] (and the normalised LoRA latent: V3.2's indexer reads it)
        let q = self.gpu.scratch::<f32>(t * heads * qk)?;
        let q_latent = match &a.q {
            DevQuery::Lora { a: qa, norm, b } => {
                let lat = self.gpu.scratch::<f32>(t * qa.n)?;
                self.linear(lat.ptr(), x, qa, t, hidden, qa.n, false)?;
                self.norm(lat.ptr(), 0, lat.ptr(), norm, t, 1, qa.n, 0)?;
                self.linear(q.ptr(), lat.ptr(), b, t, qa.n, heads * qk, false)?;
                Some((lat, qa.n))
            }
            DevQuery::Plain(l) => {
                self.linear(q.ptr(), x, l, t, hidden, heads * qk, false)?;
                None
            }
        };
        // 2. the cache row: normalised latent, rotated rope key (and V3.2's index key)
        let ckv_w = lora + rd;
        let row_w = ckv_w + a.indexer.as_ref().map_or(0, |ix| ix.head_dim);
        let ckv = self.gpu.scratch::<f32>(t * row_w)?;
        self.linear(ckv.ptr(), x, &a.kv_a, t, hidden, row_w, false)?;
        self.norm(ckv.ptr(), 0, ckv.ptr(), &a.kv_norm, t, 1, row_w, 0)?;
        if let Some(rope) = &a.rope {
            self.rope(ckv.ptr(), rope, 1, row_w, lora, 0)?;
            self.rope(q.ptr(), rope, heads, heads * qk, nope, qk)?;
        }
        if let Some(ix) = &a.indexer {
            self.index_keys(ckv.at(ckv_w), x, ix, row_w, hidden)?;
        }
        self.kv.write_rows(self.gpu, kv_layer, ckv.ptr(), row_w, self.at.write_rows, t)?;
        // 2b. V3.2: the keys each query attends to
        let selection = match (&a.indexer, &q_latent) {
            (Some(ix), Some((lat, rank))) => {
                Some(self.index_select(ix, lat.ptr(), *rank, x, hidden, kv_layer, ckv_w)?)
            }
            (Some(_), None) => return Err(CudaError::Unsupported("the V3.2 indexer needs the q LoRA latent".into())),
            _ => None,
        };
        // 3. absorbed queries [W_ukᵀ q_nope | q_rope] per head
        let aq = lora + rd;
        let absorbed = self.gpu.scratch::<f32>(t * heads * aq)?;
        self.linear_per_head(
            absorbed.ptr(),
            q.ptr(),
            a.absorb_k.ptr(),
            lora,
            nope,
            heads,
            heads * qk,
            heads * aq,
            qk,
            aq,
        )?;
        self.gpu.launch(
            "copy_heads",
            (t as u32, heads as u32, 1),
            32,
            0,
            &[
                Arg::Ptr(absorbed.ptr()),
                Arg::Ptr(q.ptr()),
                Arg::I32(rd as i32),
                Arg::I64((heads * aq) as i64),
                Arg::I32(lora as i32),
                Arg::I32(aq as i32),
                Arg::I64((heads * qk) as i64),
                Arg::I32(nope as i32),
                Arg::I32(qk as i32),
            ],
        )?;
        // 4. attention in latent space [t × heads·lora]
        let o_lat = self.gpu.scratch::<f32>(t * heads * lora)?;
        self.attention(
            o_lat.ptr(),
            absorbed.ptr(),
            heads * aq,
            kv_layer,
            heads,
            1,
            aq,
            lora,
            0,
            0,
            None,
            a.scale,
            selection.as_ref(),
        )?;
        // 5. values out of latent space, then the output projection
        let attn = self.gpu.scratch::<f32>(t * heads * a.v_dim)?;
        self.linear_per_head(
            attn.ptr(),
            o_lat.ptr(),
            a.absorb_v.ptr(),
            a.v_dim,
            lora,
            heads,
            heads * lora,
            heads * a.v_dim,
            lora,
            a.v_dim,
        )?;
        self.linear(h, attn.ptr(), &a.o, t, heads * a.v_dim, hidden, true)
    }
}
