//! One decoder layer, `h += mixer(norm(h)); h += ffn(norm(h))`: its token mixer ([`Mixer`]:
//! attention over the paged cache, or linear attention over a state slot), its feed-forward
//! ([`Ffn`]: dense or MoE), where it keeps its per-request memory ([`CacheBinding`] into a
//! [`ModelCache`]), and, expert parallel, the layer stopped at its routing ([`PendingMoe`],
//! [`RoutedRows`]). The model (`decoder.rs`), its step (`step.rs`) and the MTP drafter (`mtp.rs`)
//! are built of these.

use super::batch::BatchLayout;
use super::parts::gated_delta::GatedDeltaNet;
use super::parts::gqa::GqaAttention;
use super::parts::kda::KimiDeltaAttention;
use super::parts::layers::{Mlp, RmsNorm};
use super::parts::mla::MlaAttention;
use super::parts::moe::MoeBlock;
use crate::kv::{PagedKvCache, StatePool};

/// A layer's token mixer: attention over the paged cache, or linear attention over a state slot.
pub enum Mixer {
    Gqa(GqaAttention),
    Mla(Box<MlaAttention>),
    Gdn(GatedDeltaNet),
    Kda(KimiDeltaAttention),
}

impl Mixer {
    /// Width of this layer's paged-cache row, if it keeps one.
    pub fn kv_row_width(&self) -> Option<usize> {
        match self {
            Mixer::Gqa(a) => Some(a.kv_row_width()),
            Mixer::Mla(a) => Some(a.kv_row_width()),
            Mixer::Gdn(_) | Mixer::Kda(_) => None,
        }
    }

    /// Floats of per-request state this layer keeps in a slot (0 for attention).
    pub fn state_width(&self) -> usize {
        match self {
            Mixer::Gqa(_) | Mixer::Mla(_) => 0,
            Mixer::Gdn(m) => m.state_width(),
            Mixer::Kda(m) => m.state_width(),
        }
    }

    pub(crate) fn forward(
        &self,
        x: &[f32],
        layout: &BatchLayout,
        cache: &mut ModelCache,
        at: &CacheBinding,
    ) -> Vec<f32> {
        match (self, at.kv_layer) {
            (Mixer::Gqa(a), Some(k)) => a.forward(x, layout, cache.kv.layer_mut(k)),
            (Mixer::Mla(a), Some(k)) => a.forward(x, layout, cache.kv.layer_mut(k)),
            (Mixer::Gdn(m), None) => m.forward(x, layout, &mut cache.states, at.state_offset),
            (Mixer::Kda(m), None) => m.forward(x, layout, &mut cache.states, at.state_offset),
            _ => unreachable!("cache bindings follow the mixer kinds"),
        }
    }

    pub(crate) fn macs_per_row(&self) -> usize {
        match self {
            Mixer::Gqa(a) => a.macs_per_row(),
            Mixer::Mla(a) => a.macs_per_row(),
            Mixer::Gdn(m) => m.macs_per_row(),
            Mixer::Kda(m) => m.macs_per_row(),
        }
    }

    pub(crate) fn attention_macs(&self, ctx: usize) -> usize {
        match self {
            Mixer::Gqa(a) => a.attention_macs(ctx),
            Mixer::Mla(a) => a.attention_macs(ctx),
            Mixer::Gdn(m) => m.state_macs(),
            Mixer::Kda(m) => m.state_macs(),
        }
    }
}

/// Where a layer keeps its per-request memory: a layer of the paged cache, or a range of the
/// state slot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CacheBinding {
    pub(crate) kv_layer: Option<usize>,
    pub(crate) state_offset: usize,
}

/// A layer's feed-forward.
pub enum Ffn {
    Dense(Mlp),
    Moe(Box<MoeBlock>),
}

impl Ffn {
    pub(crate) fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        match self {
            Ffn::Dense(m) => m.forward(x, t),
            Ffn::Moe(m) => m.forward(x, t),
        }
    }

    pub(crate) fn macs_per_row(&self) -> usize {
        match self {
            Ffn::Dense(m) => m.macs_per_row(),
            Ffn::Moe(m) => m.macs_per_row(),
        }
    }
}

pub struct DecoderLayer {
    pub input_norm: RmsNorm,
    pub mixer: Mixer,
    pub post_norm: RmsNorm,
    pub ffn: Ffn,
}

/// Per-rank mutable memory a model reads and writes: the paged KV cache, and the state slots and
/// snapshots of its linear-attention layers.
pub struct ModelCache {
    pub kv: PagedKvCache,
    pub states: StatePool,
}

/// A MoE layer's rows waiting for their experts: the normed input and each row's routes.
pub(crate) struct PendingMoe {
    pub(crate) x: Vec<f32>,
    pub(crate) routes: Vec<Vec<(usize, f32)>>,
}

/// The rows of one step routed at a MoE layer (expert parallel): what dispatch sends.
#[derive(Clone, Copy, Debug)]
pub struct RoutedRows<'a> {
    pub layer: usize,
    pub hidden: usize,
    /// The layer's normed input `[rows × hidden]`.
    pub x: &'a [f32],
    /// Each row's `(expert, weight)` pairs, ascending by expert.
    pub routes: &'a [Vec<(usize, f32)>],
}

/// One decoder layer over the step's hidden state: `h += mixer(norm(h)); h += ffn(norm(h))`.
pub(crate) fn run_layer(
    layer: &DecoderLayer,
    binding: &CacheBinding,
    h: &mut [f32],
    layout: &BatchLayout,
    cache: &mut ModelCache,
) {
    let x = layer.attend(binding, h, layout, cache);
    add_into(h, &layer.ffn.forward(&x, layout.rows));
}

impl DecoderLayer {
    /// `h += mixer(norm(h))`; returns the feed-forward's input, `post_norm(h)`.
    fn attend(&self, binding: &CacheBinding, h: &mut [f32], layout: &BatchLayout, cache: &mut ModelCache) -> Vec<f32> {
        let x = self.input_norm.forward(h);
        add_into(h, &self.mixer.forward(&x, layout, cache, binding));
        self.post_norm.forward(h)
    }

    /// The layer up to its experts: a dense feed-forward runs whole (`None`); a MoE block stops
    /// at its routing and returns its input and each row's routes, awaiting the experts.
    pub(crate) fn run_to_routing(
        &self,
        binding: &CacheBinding,
        h: &mut [f32],
        layout: &BatchLayout,
        cache: &mut ModelCache,
    ) -> Option<PendingMoe> {
        let x = self.attend(binding, h, layout, cache);
        match &self.ffn {
            Ffn::Dense(m) => {
                add_into(h, &m.forward(&x, layout.rows));
                None
            }
            Ffn::Moe(m) => {
                let routes = m.route_rows(&x, layout.rows);
                Some(PendingMoe { x, routes })
            }
        }
    }
}

pub(crate) fn add_into(h: &mut [f32], delta: &[f32]) {
    for (a, b) in h.iter_mut().zip(delta) {
        *a += b;
    }
}
