//! The parts every family builds its layers from, one file each, shared wherever two families
//! compute the same thing: token mixers (attention over the paged KV cache, or linear attention
//! over a state slot), feed-forwards, and the linear layers and norms under them. A part knows
//! its sizes and its Hugging Face tensor names, never a family's `config.json`: the family files
//! turn a config into parts, and `decoder.rs` stacks them.
//!
//! | part | computes | used by |
//! |---|---|---|
//! | [`gqa`] | grouped-query attention (and Qwen3-Next's gated variant) | llama, qwen3, qwen3_next |
//! | [`mla`] | absorbed multi-head latent attention | deepseek_v3, deepseek_v32, kimi_linear |
//! | [`indexer`] | DeepSeek-V3.2's sparse-attention key selection | deepseek_v32 |
//! | [`gated_delta`] | Gated DeltaNet linear attention | qwen3_next |
//! | [`kda`] | Kimi Delta Attention linear attention | kimi_linear |
//! | [`moe`] | routed and shared SwiGLU experts | deepseek_v3, deepseek_v32, qwen3_next, kimi_linear |
//! | `layers` | linear layers, RMSNorm, the SwiGLU MLP | all |
//!
//! Dependencies among parts point one way: `mla → indexer`, `kda → gated_delta` (the shared
//! L2-norm eps), everything → `layers`.

pub mod gated_delta;
pub mod gqa;
pub mod indexer;
pub mod kda;
pub(crate) mod layers;
pub mod mla;
pub mod moe;
