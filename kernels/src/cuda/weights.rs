//! A model's weights in device memory, uploaded once from the CPU model (the same checkpoint
//! tensors, unpacked to row-major `[out × in]`), for the families the CUDA executor runs: `mha`
//! (llama, qwen3), `mla` (deepseek_v3, with its MoE), `gdn` and `hybrid_gdn` (qwen3_next: Gated
//! DeltaNet layers, gated attention, the gated shared expert), `hybrid_kda` (kimi_linear: Kimi
//! Delta Attention and MLA without rope) and `sparse_mla` (deepseek_v32: MLA whose keys the DSA
//! indexer picks). Anything else is refused by name.

use super::gpu::{CudaError, DeviceBuf, Gpu};
use crate::cpu::rope::{Rope, RopeStyle};
use crate::models::decoder::{Ffn, Mixer};
use crate::models::parts::gated_delta::GatedDeltaNet;
use crate::models::parts::gqa::GqaAttention;
use crate::models::parts::indexer::Indexer;
use crate::models::parts::kda::KimiDeltaAttention;
use crate::models::parts::layers::{Linear, Mlp, RmsNorm};
use crate::models::parts::mla::{MlaAttention, QueryProjection};
use crate::models::parts::moe::{MoeBlock, Scoring};
use crate::models::{Family, Model};

/// How a model's products hold their weights on the device (the cuda executor's `dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dtype {
    #[default]
    Float32,
    /// bf16 weights (rounded to nearest even) for every product but the narrow ones (routers,
    /// low-rank projections, MLA's absorbed heads), which stay f32; inputs rounded to bf16 at each
    /// bf16 product, tensor-core products with f32 accumulation (`kernels/cuda/bf16.cu`), the
    /// paged KV cache in bf16 (`kernels/src/cuda/kv.rs`), f32 everywhere else.
    Bfloat16,
}

impl Dtype {
    /// `float32` or `bfloat16`.
    pub fn parse(s: &str) -> Option<Dtype> {
        match s {
            "float32" => Some(Dtype::Float32),
            "bfloat16" => Some(Dtype::Bfloat16),
            _ => None,
        }
    }

    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::Float32 => 4,
            Dtype::Bfloat16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Float32 => "float32",
            Dtype::Bfloat16 => "bfloat16",
        }
    }
}

/// The bf16 bits of `f`, rounded to nearest even (a NaN stays a NaN): `kernels/cuda/common.cuh`'s
/// bf16_bits.
pub fn bf16_bits(f: f32) -> u16 {
    let u = f.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// A product's weights on the device.
pub(crate) enum DevWeight {
    F32(DeviceBuf<f32>),
    Bf16(DeviceBuf<u16>),
}

impl DevWeight {
    pub fn ptr(&self) -> u64 {
        match self {
            DevWeight::F32(b) => b.ptr(),
            DevWeight::Bf16(b) => b.ptr(),
        }
    }

    pub fn is_bf16(&self) -> bool {
        matches!(self, DevWeight::Bf16(_))
    }
}

pub(crate) struct DevLinear {
    pub w: DevWeight,
    pub bias: Option<DeviceBuf<f32>>,
    pub n: usize,
    pub k: usize,
}

pub(crate) struct DevNorm {
    pub w: DeviceBuf<f32>,
    pub eps: f32,
    pub dim: usize,
}

pub(crate) struct DevRope {
    pub inv_freq: DeviceBuf<f32>,
    pub half: usize,
    pub scaling: f32,
    pub interleaved: bool,
}

pub(crate) struct DevGqa {
    pub qkv: DevLinear,
    pub o: DevLinear,
    pub q_norm: Option<DevNorm>,
    pub k_norm: Option<DevNorm>,
    pub rope: DevRope,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub window: Option<usize>,
    pub scale: f32,
    /// Qwen3-Next: q_proj yields `[query | gate]` per head; the output is × sigmoid(gate).
    pub output_gate: bool,
}

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

/// DeepSeek-V3.2's DSA indexer of one layer. Its index key sits after the latent and rope key
/// in each cache row.
pub(crate) struct DevIndexer {
    pub wq_b: DevLinear,
    pub wk: DevLinear,
    pub k_norm_weight: DeviceBuf<f32>,
    pub k_norm_bias: DeviceBuf<f32>,
    pub weights_proj: DevLinear,
    /// Rotate-half, on the first `qk_rope_head_dim` dims of index queries and keys.
    pub rope: DevRope,
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
}

/// A Gated DeltaNet layer (`kernels/cuda/linear.cu`).
pub(crate) struct DevGdn {
    /// `[in_proj_qkvz; in_proj_ba]`.
    pub in_proj: DevLinear,
    /// `[channels × kernel]`.
    pub conv_weight: DeviceBuf<f32>,
    pub neg_a: DeviceBuf<f32>,
    pub dt_bias: DeviceBuf<f32>,
    /// The gated RMSNorm of each head's output.
    pub norm: DevNorm,
    pub out_proj: DevLinear,
    pub k_heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
    pub kernel: usize,
    /// Floats of the conv window at the start of the layer's state.
    pub conv_width: usize,
}

/// A Kimi Delta Attention layer (`kernels/cuda/linear.cu`).
pub(crate) struct DevKda {
    /// `[q; k; v; f_a; g_a; b]`.
    pub in_proj: DevLinear,
    pub f_b: DevLinear,
    pub g_b: DevLinear,
    /// `[3·heads·d × kernel]`.
    pub conv_weight: DeviceBuf<f32>,
    pub neg_a: DeviceBuf<f32>,
    pub dt_bias: DeviceBuf<f32>,
    pub o_norm: DevNorm,
    pub o_proj: DevLinear,
    pub heads: usize,
    pub head_dim: usize,
    pub kernel: usize,
    pub conv_width: usize,
}

// Built once per layer at load: the size of a variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum DevMixer {
    Gqa(DevGqa),
    Mla(DevMla),
    Gdn(DevGdn),
    Kda(DevKda),
}

pub(crate) struct DevMlp {
    pub gate_up: DevLinear,
    pub down: DevLinear,
    pub inter: usize,
}

pub(crate) struct DevMoe {
    pub router: DevLinear,
    pub correction_bias: Option<DeviceBuf<f32>>,
    pub num_experts: usize,
    pub top_k: usize,
    pub softmax: bool,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scaling: f32,
    /// Every expert's `[gate; up]` rows, `[experts × 2·inter × hidden]`.
    pub gate_up: DevWeight,
    /// Every expert's down rows, `[experts × hidden × inter]`.
    pub down: DevWeight,
    pub inter: usize,
    pub shared: Option<DevMlp>,
    /// Qwen-style gate on the shared expert: `sigmoid(x·g)` per row.
    pub shared_gate: Option<DevLinear>,
}

// Built once per layer at load: the size of a variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum DevFfn {
    Dense(DevMlp),
    Moe(DevMoe),
}

pub(crate) struct DevLayer {
    pub input_norm: DevNorm,
    pub mixer: DevMixer,
    /// Which layer of the paged cache this layer writes (attention layers).
    pub kv_layer: usize,
    /// Where its state starts in a slot (linear layers).
    pub state_offset: usize,
    pub post_norm: DevNorm,
    pub ffn: DevFfn,
}

/// A model on one GPU.
pub struct DeviceModel {
    pub vocab: usize,
    pub hidden: usize,
    pub(crate) embed: DeviceBuf<f32>,
    pub(crate) layers: Vec<DevLayer>,
    pub(crate) final_norm: DevNorm,
    pub(crate) lm_head: DevLinear,
    /// Row width of each KV layer.
    pub kv_widths: Vec<usize>,
    /// Floats of recurrent state per request (0: the family keeps none).
    pub state_width: usize,
    /// Bytes of the weights a step reads whole (all but the embedding table, of which a step
    /// reads only its tokens' rows).
    pub weight_bytes: usize,
    pub dtype: Dtype,
}

/// The GPU weights go to, and how the products' weights are held there.
struct Up<'a> {
    gpu: &'a Gpu,
    dtype: Dtype,
}

impl std::ops::Deref for Up<'_> {
    type Target = Gpu;
    fn deref(&self) -> &Gpu {
        self.gpu
    }
}

impl Up<'_> {
    /// `rows` (a product's weights) as the dtype says; `narrow` products always in f32.
    fn weight(&self, rows: &[f32], narrow: bool) -> Result<DevWeight, CudaError> {
        if self.dtype == Dtype::Bfloat16 && !narrow {
            let bits: Vec<u16> = rows.iter().map(|&v| bf16_bits(v)).collect();
            return Ok(DevWeight::Bf16(self.gpu.upload(&bits)?));
        }
        Ok(DevWeight::F32(self.gpu.upload(rows)?))
    }
}

/// The widest linear-attention head the recurrent kernels take (threads of one block).
pub const MAX_LINEAR_HEAD: usize = 256;

/// Why the CUDA executor cannot run `model`, if it cannot.
pub fn unsupported(model: &Model) -> Option<String> {
    let family = model.family;
    if !matches!(
        family,
        Family::Mha | Family::Mla | Family::SparseMla | Family::Gdn | Family::HybridGdn | Family::HybridKda
    ) {
        return Some(format!(
            "the cuda executor runs the mha, mla, sparse_mla, gdn, hybrid_gdn and hybrid_kda families (llama, \
             qwen3, deepseek_v3, deepseek_v32, qwen3_next, kimi_linear); model_type {} is family {family}",
            model.model_type
        ));
    }
    if !model.holds_every_expert() {
        return Some("the model holds only one rank's experts (expert parallelism runs on the cpu executor)".into());
    }
    for (l, layer) in model.layers.iter().enumerate() {
        match &layer.mixer {
            // one thread per value of a head's output, in one block (`kernels/cuda/linear.cu`)
            Mixer::Gdn(g) if g.dv > MAX_LINEAR_HEAD => {
                return Some(format!("layer {l}: linear_value_head_dim {} over {MAX_LINEAR_HEAD}", g.dv))
            }
            Mixer::Kda(k) if k.head_dim > MAX_LINEAR_HEAD => {
                return Some(format!("layer {l}: linear-attention head_dim {} over {MAX_LINEAR_HEAD}", k.head_dim))
            }
            _ => {}
        }
        if let Ffn::Moe(m) = &layer.ffn {
            if m.routing.num_experts > 512 || m.routing.top_k > 32 {
                return Some(format!("layer {l}: MoE over 512 experts or over top-32"));
            }
        }
    }
    None
}

impl DeviceModel {
    /// Whether a layer runs DeepSeek-V3.2's indexer (its scores are as wide as the step's
    /// longest row, so its steps are not captured: `graph.rs`).
    pub fn has_indexer(&self) -> bool {
        self.layers.iter().any(|l| matches!(&l.mixer, DevMixer::Mla(a) if a.indexer.is_some()))
    }

    /// Uploads `model` to `gpu` in f32 (waits for the copies: this is load time, not a step).
    pub fn upload(gpu: &Gpu, model: &Model) -> Result<DeviceModel, CudaError> {
        DeviceModel::upload_as(gpu, model, Dtype::Float32)
    }

    /// Uploads `model` to `gpu` with its products' weights in `dtype`.
    pub fn upload_as(gpu: &Gpu, model: &Model, dtype: Dtype) -> Result<DeviceModel, CudaError> {
        if let Some(why) = unsupported(model) {
            return Err(CudaError::Unsupported(why));
        }
        let gpu = &Up { gpu, dtype };
        let uploaded_before = gpu.uploaded_bytes();
        let mut layers = Vec::with_capacity(model.layers.len());
        for (l, layer) in model.layers.iter().enumerate() {
            let (kv_layer, state_offset) = model.binding(l);
            let mixer = match &layer.mixer {
                Mixer::Gqa(a) => DevMixer::Gqa(gqa(gpu, a)?),
                Mixer::Mla(a) => DevMixer::Mla(mla(gpu, a)?),
                Mixer::Gdn(g) => DevMixer::Gdn(gdn(gpu, g)?),
                Mixer::Kda(k) => DevMixer::Kda(kda(gpu, k)?),
            };
            let ffn = match &layer.ffn {
                Ffn::Dense(m) => DevFfn::Dense(mlp(gpu, m)?),
                Ffn::Moe(m) => DevFfn::Moe(moe(gpu, m)?),
            };
            layers.push(DevLayer {
                input_norm: norm(gpu, &layer.input_norm)?,
                mixer,
                kv_layer: kv_layer.unwrap_or(0),
                state_offset,
                post_norm: norm(gpu, &layer.post_norm)?,
                ffn,
            });
        }
        let final_norm = norm(gpu, &model.final_norm)?;
        let lm_head = linear(gpu, &model.lm_head)?;
        let weight_bytes = (gpu.uploaded_bytes() - uploaded_before) as usize;
        let dm = DeviceModel {
            vocab: model.vocab_size,
            hidden: model.hidden_size,
            embed: gpu.upload(&model.embed)?,
            layers,
            final_norm,
            lm_head,
            kv_widths: model.kv_row_widths(),
            state_width: model.state_width(),
            weight_bytes,
            dtype,
        };
        gpu.wait()?;
        Ok(dm)
    }
}

fn linear(gpu: &Up, l: &Linear) -> Result<DevLinear, CudaError> {
    Ok(DevLinear {
        w: gpu.weight(&l.weight.to_rows(), super::forward::is_narrow(l.out_dim(), l.in_dim()))?,
        bias: l.bias.as_ref().map(|b| gpu.upload(b)).transpose()?,
        n: l.out_dim(),
        k: l.in_dim(),
    })
}

fn norm(gpu: &Up, n: &RmsNorm) -> Result<DevNorm, CudaError> {
    Ok(DevNorm { w: gpu.upload(&n.weight)?, eps: n.eps, dim: n.weight.len() })
}

fn rope(gpu: &Up, r: &Rope) -> Result<DevRope, CudaError> {
    Ok(DevRope {
        inv_freq: gpu.upload(&r.inv_freq)?,
        half: r.inv_freq.len(),
        scaling: r.attention_scaling,
        interleaved: r.style == RopeStyle::Interleaved,
    })
}

fn mlp(gpu: &Up, m: &Mlp) -> Result<DevMlp, CudaError> {
    Ok(DevMlp { gate_up: linear(gpu, &m.gate_up)?, down: linear(gpu, &m.down)?, inter: m.inter })
}

fn gqa(gpu: &Up, a: &GqaAttention) -> Result<DevGqa, CudaError> {
    let s = a.shape;
    Ok(DevGqa {
        qkv: linear(gpu, &a.qkv)?,
        o: linear(gpu, &a.o)?,
        q_norm: a.q_norm.as_ref().map(|n| norm(gpu, n)).transpose()?,
        k_norm: a.k_norm.as_ref().map(|n| norm(gpu, n)).transpose()?,
        rope: rope(gpu, &a.rope)?,
        q_heads: s.q_heads,
        kv_heads: s.kv_heads,
        head_dim: s.qk_dim,
        window: a.sliding_window,
        scale: s.scale,
        output_gate: a.output_gate,
    })
}

fn mla(gpu: &Up, a: &MlaAttention) -> Result<DevMla, CudaError> {
    let q = match &a.q {
        QueryProjection::Lora { a: qa, norm: n, b } => {
            DevQuery::Lora { a: linear(gpu, qa)?, norm: norm(gpu, n)?, b: linear(gpu, b)? }
        }
        QueryProjection::Plain(l) => DevQuery::Plain(linear(gpu, l)?),
    };
    let stack = |ms: &[crate::cpu::gemm::PackedMatrix]| ms.iter().flat_map(|m| m.to_rows()).collect::<Vec<f32>>();
    Ok(DevMla {
        q,
        kv_a: linear(gpu, &a.kv_a)?,
        kv_norm: norm(gpu, &a.kv_norm)?,
        absorb_k: gpu.upload(&stack(&a.absorb_k))?,
        absorb_v: gpu.upload(&stack(&a.absorb_v))?,
        o: linear(gpu, &a.o)?,
        rope: a.rope.as_ref().map(|r| rope(gpu, r)).transpose()?,
        indexer: a.indexer.as_ref().map(|ix| indexer(gpu, ix)).transpose()?,
        heads: a.heads,
        nope: a.nope,
        rope_dim: a.rope_dim,
        v_dim: a.v_dim,
        kv_lora: a.kv_lora,
        scale: a.scale,
    })
}

fn indexer(gpu: &Up, ix: &Indexer) -> Result<DevIndexer, CudaError> {
    Ok(DevIndexer {
        wq_b: linear(gpu, &ix.wq_b)?,
        wk: linear(gpu, &ix.wk)?,
        k_norm_weight: gpu.upload(&ix.k_norm_weight)?,
        k_norm_bias: gpu.upload(&ix.k_norm_bias)?,
        weights_proj: linear(gpu, &ix.weights_proj)?,
        rope: rope(gpu, &ix.rope)?,
        heads: ix.heads,
        head_dim: ix.head_dim,
        topk: ix.topk,
    })
}

fn gdn(gpu: &Up, g: &GatedDeltaNet) -> Result<DevGdn, CudaError> {
    Ok(DevGdn {
        in_proj: linear(gpu, &g.in_proj)?,
        conv_weight: gpu.upload(&g.conv_weight)?,
        neg_a: gpu.upload(&g.neg_a)?,
        dt_bias: gpu.upload(&g.dt_bias)?,
        norm: norm(gpu, &g.norm)?,
        out_proj: linear(gpu, &g.out_proj)?,
        k_heads: g.k_heads,
        v_heads: g.v_heads,
        dk: g.dk,
        dv: g.dv,
        kernel: g.kernel,
        conv_width: g.conv_state_width(),
    })
}

fn kda(gpu: &Up, k: &KimiDeltaAttention) -> Result<DevKda, CudaError> {
    Ok(DevKda {
        in_proj: linear(gpu, &k.in_proj)?,
        f_b: linear(gpu, &k.f_b)?,
        g_b: linear(gpu, &k.g_b)?,
        conv_weight: gpu.upload(&k.conv_weight)?,
        neg_a: gpu.upload(&k.neg_a)?,
        dt_bias: gpu.upload(&k.dt_bias)?,
        o_norm: norm(gpu, &k.o_norm)?,
        o_proj: linear(gpu, &k.o_proj)?,
        heads: k.heads,
        head_dim: k.head_dim,
        kernel: k.kernel,
        conv_width: k.conv_state_width(),
    })
}

fn moe(gpu: &Up, m: &MoeBlock) -> Result<DevMoe, CudaError> {
    let r = &m.routing;
    let inter = m.experts.first().map_or(0, |e| e.inter);
    let gate_up: Vec<f32> = m.experts.iter().flat_map(|e| e.gate_up.weight.to_rows()).collect();
    let down: Vec<f32> = m.experts.iter().flat_map(|e| e.down.weight.to_rows()).collect();
    if m.experts.iter().any(|e| e.gate_up.bias.is_some() || e.down.bias.is_some()) {
        return Err(CudaError::Unsupported("MoE experts with biases".into()));
    }
    Ok(DevMoe {
        router: linear(gpu, &m.router)?,
        correction_bias: r.correction_bias.as_ref().map(|b| gpu.upload(b)).transpose()?,
        num_experts: r.num_experts,
        top_k: r.top_k,
        softmax: r.scoring == Scoring::Softmax,
        n_group: r.n_group,
        topk_group: r.topk_group,
        norm_topk_prob: r.norm_topk_prob,
        scaling: r.scaling,
        gate_up: gpu.weight(&gate_up, false)?,
        down: gpu.weight(&down, false)?,
        inter,
        shared: m.shared.as_ref().map(|s| mlp(gpu, s)).transpose()?,
        shared_gate: m.shared_gate.as_ref().map(|g| linear(gpu, g)).transpose()?,
    })
}
