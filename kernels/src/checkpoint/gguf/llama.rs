//! A llama-architecture GGUF file as the llama family reads a Hugging Face checkpoint: its config
//! from the metadata (`llama.block_count`, `llama.embedding_length`, heads, kv heads, rope base,
//! RMS epsilon, context length; the output head tied when the file has no `output.weight`), and
//! its tensors under Hugging Face names, dequantized. llama.cpp's converter permutes the rows of
//! each head of `attn_q` and `attn_k` so that rotary pairs sit side by side (GGUF's rope layout);
//! they are put back in halves here, as the family's rotate-half rope reads them.

use super::{GgufFile, GgufValue};
use crate::checkpoint::{ConfigOrigin, ConfigSource, LoadError, WeightSource};
use serde_json::{json, Value};

/// The config of llama-architecture GGUF file `f`, as a Hugging Face `config.json` says it.
pub fn gguf_config(f: &GgufFile) -> Result<ConfigSource, LoadError> {
    let arch = match f.get("general.architecture") {
        Some(GgufValue::String(a)) => a.as_str(),
        Some(v) => return Err(f.field_error("general.architecture", format!("expected a string, found {}", v.kind()))),
        None => return Err(f.field_error("general.architecture", "missing from the GGUF metadata")),
    };
    if arch != "llama" {
        return Err(f.field_error(
            "general.architecture",
            format!("{arch:?}: kvflow reads llama-architecture GGUF files (others as Hugging Face checkpoints)"),
        ));
    }
    let hidden = f.uint("llama.embedding_length")?;
    let heads = f.uint("llama.attention.head_count")?;
    let kv_heads = match f.get("llama.attention.head_count_kv") {
        None => heads,
        Some(_) => f.uint("llama.attention.head_count_kv")?,
    };
    if heads == 0 || kv_heads == 0 || hidden % heads != 0 || heads % kv_heads != 0 {
        return Err(f.field_error(
            "llama.attention.head_count",
            format!("{heads} heads ({kv_heads} kv heads) do not split llama.embedding_length {hidden}"),
        ));
    }
    let head_dim = match f.get("llama.attention.key_length") {
        None => hidden / heads,
        Some(_) => f.uint("llama.attention.key_length")?,
    };
    if let Some(rotary) = f.get("llama.rope.dimension_count") {
        if rotary.as_u64() != Some(head_dim) {
            return Err(f.field_error(
                "llama.rope.dimension_count",
                format!("{rotary:?}: rope over part of a head is not supported (the head has {head_dim} dimensions)"),
            ));
        }
    }
    if let Some(scaling) = f.get("llama.rope.scaling.type").filter(|s| s.as_str() != Some("none")) {
        return Err(f.field_error("llama.rope.scaling.type", format!("{scaling:?}: rope scaling is not supported")));
    }
    // Both floats read here (the RMS epsilon, the rope base) must be finite and above 0; checked
    // here, under the GGUF key, since a NaN put into the JSON config reads back as `null`.
    let float = |key: &str, default: f64| -> Result<f64, LoadError> {
        let Some(v) = f.get(key) else { return Ok(default) };
        match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            Some(x) => Err(f.field_error(key, format!("{x}: expected a finite number above 0"))),
            None => Err(f.field_error(key, format!("expected a number, found {}", v.kind()))),
        }
    };
    let vocab = match f.get("llama.vocab_size") {
        Some(_) => f.uint("llama.vocab_size")?,
        None => f.tensors.get("token_embd.weight").and_then(|t| t.dims.get(1)).copied().unwrap_or(0) as u64,
    };
    let mut config = json!({
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": f.uint("llama.feed_forward_length")?,
        "num_hidden_layers": f.uint("llama.block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float("llama.attention.layer_norm_rms_epsilon", 1e-5)?,
        "rope_theta": float("llama.rope.freq_base", 10000.0)?,
        "vocab_size": vocab,
        "tie_word_embeddings": !f.tensors.contains_key("output.weight"),
        "attention_bias": f.tensors.contains_key("blk.0.attn_q.bias"),
        "mlp_bias": false,
    });
    if let Some(context) = f.get("llama.context_length") {
        let context = context.as_u64().ok_or_else(|| f.field_error("llama.context_length", "expected an integer"))?;
        config["max_position_embeddings"] = Value::from(context);
    }
    ConfigSource::from_value(f.path.clone(), config, ConfigOrigin::Checkpoint)
}

/// A llama GGUF file's tensors under the names the llama family reads.
pub struct GgufWeights<'a> {
    pub file: &'a GgufFile,
    heads: usize,
    kv_heads: usize,
}

impl<'a> GgufWeights<'a> {
    pub fn new(file: &'a GgufFile, config: &ConfigSource) -> GgufWeights<'a> {
        let count = |key: &str| config.value.get(key).and_then(Value::as_u64).unwrap_or(1) as usize;
        GgufWeights { file, heads: count("num_attention_heads"), kv_heads: count("num_key_value_heads") }
    }

    /// The GGUF tensor behind Hugging Face name `name`, and the heads whose rows it permutes.
    fn source(&self, name: &str) -> Option<(String, Option<usize>)> {
        let fixed = match name {
            "model.embed_tokens.weight" => Some("token_embd.weight"),
            "model.norm.weight" => Some("output_norm.weight"),
            "lm_head.weight" => Some("output.weight"),
            _ => None,
        };
        if let Some(f) = fixed {
            return Some((f.to_string(), None));
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, part) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let (gguf, heads) = match part {
            "input_layernorm.weight" => ("attn_norm.weight", None),
            "post_attention_layernorm.weight" => ("ffn_norm.weight", None),
            "self_attn.q_proj.weight" => ("attn_q.weight", Some(self.heads)),
            "self_attn.k_proj.weight" => ("attn_k.weight", Some(self.kv_heads)),
            "self_attn.q_proj.bias" => ("attn_q.bias", Some(self.heads)),
            "self_attn.k_proj.bias" => ("attn_k.bias", Some(self.kv_heads)),
            "self_attn.v_proj.weight" => ("attn_v.weight", None),
            "self_attn.v_proj.bias" => ("attn_v.bias", None),
            "self_attn.o_proj.weight" => ("attn_output.weight", None),
            "mlp.gate_proj.weight" => ("ffn_gate.weight", None),
            "mlp.up_proj.weight" => ("ffn_up.weight", None),
            "mlp.down_proj.weight" => ("ffn_down.weight", None),
            _ => return None,
        };
        Some((format!("blk.{layer}.{gguf}"), heads))
    }
}

impl WeightSource for GgufWeights<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let path = self.file.path.clone();
        let missing = || LoadError::MissingTensor { path: path.clone(), name: name.to_string() };
        let (gguf, heads) = self.source(name).ok_or_else(missing)?;
        let t = self
            .file
            .tensors
            .get(&gguf)
            .ok_or_else(|| LoadError::MissingTensor { path: path.clone(), name: format!("{gguf} (for {name})") })?;
        if t.shape() != shape {
            return Err(LoadError::WrongShape { path, name: gguf, expected: shape.to_vec(), found: t.shape() });
        }
        let values = self.file.dequantize(&gguf)?;
        Ok(match heads {
            Some(heads) => rope_halves(&values, heads, shape),
            None => values,
        })
    }

    fn contains(&self, name: &str) -> bool {
        self.source(name).is_some_and(|(gguf, _)| self.file.tensors.contains_key(&gguf))
    }
}

/// Undoes the converter's permutation of each head's rows: GGUF row `2i + half` of a head is
/// Hugging Face row `half × d/2 + i` (`d` rows a head; a bias is a column of rows of one).
fn rope_halves(values: &[f32], heads: usize, shape: &[usize]) -> Vec<f32> {
    let rows = shape[0];
    let width = values.len() / rows.max(1);
    let per_head = rows / heads.max(1);
    let half = per_head / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..half {
            for side in 0..2 {
                let from = (h * per_head + 2 * i + side) * width;
                let to = (h * per_head + side * half + i) * width;
                out[to..to + width].copy_from_slice(&values[from..from + width]);
            }
        }
    }
    out
}
