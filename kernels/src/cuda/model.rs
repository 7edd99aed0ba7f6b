//! A model's weights in device memory, uploaded once from the CPU model (the same checkpoint
//! tensors, unpacked to row-major `[out × in]`), for the families the CUDA executor runs: `mha`
//! (llama, qwen3), `mla` (deepseek_v3, with its MoE), `gdn` and `hybrid_gdn` (qwen3_next: Gated
//! DeltaNet layers, gated attention, the gated shared expert), `hybrid_kda` (kimi_linear: Kimi
//! Delta Attention and MLA without rope) and `sparse_mla` (deepseek_v32: MLA whose keys the DSA
//! indexer picks). Anything else is refused by name.
//!
//! This file holds the model and its layers; each part's weights and their upload are in `parts/`.

use super::error::CudaError;
use super::gpu::{DeviceBuf, Gpu};
use super::parts::gated_delta::{self, DevGdn};
use super::parts::gqa::{self, DevGqa};
use super::parts::kda::{self, DevKda};
use super::parts::layers::{self, DevLinear, DevMlp, DevNorm};
use super::parts::mla::{self, DevMla};
use super::parts::moe::{self, DevMoe};
use super::weights::{Dtype, Up};
use crate::models::layer::{DecoderLayer, Ffn, Mixer};
use crate::models::mtp::MtpLayer;
use crate::models::{Family, Model};

// Built once per layer at load: the size of a variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum DevMixer {
    Gqa(DevGqa),
    Mla(DevMla),
    Gdn(DevGdn),
    Kda(DevKda),
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
    /// DeepSeek's MTP layer, when the checkpoint holds one (`mtp.rs`).
    pub(crate) mtp: Option<DevMtp>,
    /// Row width of each KV layer.
    pub kv_widths: Vec<usize>,
    /// Floats of recurrent state per request (0: the family keeps none).
    pub state_width: usize,
    /// Bytes of the weights a step reads whole (all but the embedding table, of which a step
    /// reads only its tokens' rows).
    pub weight_bytes: usize,
    pub dtype: Dtype,
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

    /// Whether the forward's decoder layers write every KV layer (an MTP layer's KV is written
    /// by the draft passes after it): what [`DeviceModel::enqueue_step`] can mark.
    pub fn forward_writes_every_kv_layer(&self) -> bool {
        let written: std::collections::BTreeSet<usize> = self
            .layers
            .iter()
            .filter(|l| matches!(l.mixer, DevMixer::Gqa(_) | DevMixer::Mla(_)))
            .map(|l| l.kv_layer)
            .collect();
        !self.kv_widths.is_empty() && written.len() == self.kv_widths.len()
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
            layers.push(upload_layer(gpu, layer, kv_layer.unwrap_or(0), state_offset)?);
        }
        let mtp = model.mtp().map(|m| upload_mtp(gpu, m)).transpose()?;
        let final_norm = layers::norm(gpu, &model.final_norm)?;
        let lm_head = layers::linear(gpu, &model.lm_head)?;
        let weight_bytes = (gpu.uploaded_bytes() - uploaded_before) as usize;
        let dm = DeviceModel {
            vocab: model.vocab_size,
            hidden: model.hidden_size,
            embed: gpu.upload(&model.embed)?,
            layers,
            final_norm,
            lm_head,
            mtp,
            kv_widths: model.kv_row_widths(),
            state_width: model.state_width(),
            weight_bytes,
            dtype,
        };
        gpu.wait()?;
        Ok(dm)
    }
}

/// One decoder layer's weights on the device, writing KV layer `kv_layer` (attention) or its
/// state from `state_offset` in a slot (linear attention).
pub(crate) fn upload_layer(
    gpu: &Up,
    layer: &DecoderLayer,
    kv_layer: usize,
    state_offset: usize,
) -> Result<DevLayer, CudaError> {
    let mixer = match &layer.mixer {
        Mixer::Gqa(a) => DevMixer::Gqa(gqa::upload(gpu, a)?),
        Mixer::Mla(a) => DevMixer::Mla(mla::upload(gpu, a)?),
        Mixer::Gdn(g) => DevMixer::Gdn(gated_delta::upload(gpu, g)?),
        Mixer::Kda(k) => DevMixer::Kda(kda::upload(gpu, k)?),
    };
    let ffn = match &layer.ffn {
        Ffn::Dense(m) => DevFfn::Dense(layers::mlp(gpu, m)?),
        Ffn::Moe(m) => DevFfn::Moe(moe::upload(gpu, m)?),
    };
    Ok(DevLayer {
        input_norm: layers::norm(gpu, &layer.input_norm)?,
        mixer,
        kv_layer,
        state_offset,
        post_norm: layers::norm(gpu, &layer.post_norm)?,
        ffn,
    })
}

/// DeepSeek's MTP layer on the device (its pass: `mtp.rs`).
pub(crate) struct DevMtp {
    pub enorm: DevNorm,
    pub hnorm: DevNorm,
    /// `[hidden × 2·hidden]`: the normed embedding, then the normed hidden state.
    pub eh_proj: DevLinear,
    pub block: DevLayer,
    pub head_norm: DevNorm,
    pub head: DevLinear,
}

fn upload_mtp(gpu: &Up, m: &MtpLayer) -> Result<DevMtp, CudaError> {
    let kv_layer = m.binding.kv_layer.unwrap_or(0);
    Ok(DevMtp {
        enorm: layers::norm(gpu, &m.enorm)?,
        hnorm: layers::norm(gpu, &m.hnorm)?,
        eh_proj: layers::linear(gpu, &m.eh_proj)?,
        block: upload_layer(gpu, &m.block, kv_layer, 0)?,
        head_norm: layers::norm(gpu, &m.head_norm)?,
        head: layers::linear(gpu, &m.head)?,
    })
}
