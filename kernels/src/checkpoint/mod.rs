//! Where weights come from: a Hugging Face checkpoint folder (`config.json` + safetensors, single
//! file or sharded), a llama-architecture GGUF file, or a seeded random model built from a TOML
//! spec. Each implements [`WeightSource`], so a model family is built by one code path whatever
//! the source.

mod checks;
mod config;
mod error;
mod fields;
pub mod gguf;
mod random;
mod safetensors_dir;
mod shapes;

pub use checks::{MAX_DIM, MAX_LAYERS};
pub use config::{parse_rope, ConfigOrigin, ConfigSource, CONTEXT_KEYS, ROPE_KEYS};
pub use error::LoadError;
pub(crate) use fields::keys_of;
pub use random::{ModelSpec, RandomWeights};
pub use safetensors_dir::{parse_safetensors_header, SafetensorsDir, TensorHeader};
pub use shapes::ShapesOnly;

/// A source of named f32 tensors.
pub trait WeightSource {
    /// The tensor `name`, checked against `shape`, converted to f32.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError>;
    /// Whether the source holds `name` (for optional tensors: biases, tied heads, fused forms).
    fn contains(&self, name: &str) -> bool;
    /// Which of a MoE layer's `num_experts` routed experts to load: all of them, unless the
    /// source serves one rank of an expert-parallel pool
    /// ([`ExpertShard`](crate::models::parts::moe::ExpertShard)).
    fn experts_to_load(&self, num_experts: usize) -> std::ops::Range<usize> {
        0..num_experts
    }
    /// Whether the source holds shapes and no values ([`ShapesOnly`]): the parts that read a
    /// large tensor keep its dimensions alone.
    fn shapes_only(&self) -> bool {
        false
    }
}
