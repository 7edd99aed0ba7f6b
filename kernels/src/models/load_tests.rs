//! Hostile model sources: each class of impossible input is an error at load naming the field,
//! tensor or file — never a panic in a kernel, never NaN logits — and the repository's
//! fixtures still load. Ends with seeded random mutations of the fixture configs.

use super::{build, check, load, LogitsWanted, Model, SeqInput};
use crate::checkpoint::{parse_safetensors_header, ConfigSource, ModelSpec, RandomWeights};
use serde_json::Value;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

const FIXTURES: [&str; 7] =
    ["llama", "qwen3", "deepseek_v3", "deepseek_v32", "qwen3_next", "qwen3_next_gdn", "kimi_linear"];

const LLAMA_SPEC: &str = r#"
model_type = "llama"
seed = 3
vocab_size = 64
hidden_size = 32
intermediate_size = 48
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 8
"#;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hf").join(name)
}

/// A fresh folder under the system temp dir, removed first if a previous run left it.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvflow-kernels-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The error building `spec` gives.
fn spec_error(spec: &str) -> String {
    let spec = ModelSpec::parse("spec.toml".into(), spec).unwrap();
    match build(&spec.config, &spec.weights) {
        Ok(_) => panic!("the spec built"),
        Err(e) => e.to_string(),
    }
}

fn llama_with(line: &str) -> String {
    let key = line.split('=').next().unwrap().trim();
    let kept: Vec<&str> = LLAMA_SPEC.lines().filter(|l| !l.starts_with(&format!("{key} "))).collect();
    format!("{}\n{line}\n", kept.join("\n"))
}

/// One prefill step of three tokens; the logits must be finite.
fn step_is_finite(model: &Model) -> bool {
    let mut cache = model.new_cache(4, 2, 1, 0);
    let tokens: Vec<u32> = (0..3).map(|i| i % model.vocab_size as u32).collect();
    let batch = [SeqInput {
        tokens: &tokens,
        start_pos: 0,
        block_table: &[0],
        slot: model.needs_slots().then_some(0),
        prompt_len: 3,
        logits: LogitsWanted::Last,
    }];
    model.forward(&batch, &mut cache).logits.iter().all(|v| v.is_finite())
}

#[test]
fn a_zero_hidden_size_is_rejected_by_name() {
    let e = spec_error(&llama_with("hidden_size = 0"));
    assert!(e.contains("spec.toml") && e.contains("`hidden_size`") && e.contains("found 0"), "{e}");
}

#[test]
fn zero_layers_are_rejected_by_name() {
    let e = spec_error(&llama_with("num_hidden_layers = 0"));
    assert!(e.contains("`num_hidden_layers`") && e.contains("found 0"), "{e}");
}

#[test]
fn an_unknown_spec_key_is_rejected_with_the_known_ones() {
    let e = spec_error(&format!("{LLAMA_SPEC}hiden_size = 64\n"));
    assert!(e.contains("`hiden_size`") && e.contains("known keys") && e.contains("hidden_size, "), "{e}");
    let e = spec_error(&format!("{LLAMA_SPEC}[rope_scaling]\nrope_type = \"linear\"\nfactr = 2.0\n"));
    assert!(e.contains("`rope_scaling.factr`"), "{e}");
}

#[test]
fn an_unknown_key_in_a_checkpoint_config_is_ignored() {
    let text = std::fs::read_to_string(fixture("llama/config.json")).unwrap().replacen('{', "{\"hiden_size\": 3,", 1);
    let cfg = ConfigSource::parse("config.json".into(), &text).unwrap();
    check(&cfg).unwrap();
}

#[test]
fn a_negative_eps_is_rejected_by_name() {
    let e = spec_error(&llama_with("rms_norm_eps = -1e-6"));
    assert!(e.contains("`rms_norm_eps`") && e.contains("> 0"), "{e}");
}

#[test]
fn a_negative_rope_theta_is_rejected_by_name() {
    let e = spec_error(&llama_with("rope_theta = -10000.0"));
    assert!(e.contains("`rope_theta`") && e.contains("found -10000"), "{e}");
}

#[test]
fn a_wrongly_typed_value_names_its_key() {
    let e = spec_error(&llama_with("intermediate_size = -48"));
    assert!(e.contains("`intermediate_size`"), "{e}");
}

#[test]
fn a_nan_weight_names_the_tensor_and_the_file() {
    let dir = scratch("nan-weight");
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama").join(file), dir.join(file)).unwrap();
    }
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let norm = parse_safetensors_header(&path, &bytes).unwrap().into_iter().find(|t| t.name == "model.norm.weight");
    let start = norm.unwrap().start + 4 * 5;
    bytes[start..start + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let e = load(&dir).err().unwrap().to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(e.contains("`model.norm.weight`") && e.contains("model.safetensors") && e.contains("index 5"), "{e}");
}

#[test]
fn a_spec_too_large_for_memory_names_the_estimate_and_the_biggest_keys() {
    let e = spec_error(&llama_with("vocab_size = 16000000").replace("hidden_size = 32", "hidden_size = 1000000"));
    assert!(e.contains("spec.toml") && e.contains("TiB") && e.contains("vocab_size × hidden_size"), "{e}");
}

#[test]
fn a_dimension_beyond_the_bound_is_rejected_before_any_product() {
    let e = spec_error(&llama_with("vocab_size = 1000000000"));
    assert!(e.contains("`vocab_size`") && e.contains("1..=16777216"), "{e}");
}

#[test]
fn a_path_to_config_json_loads_its_folder() {
    let model = load(&fixture("llama").join("config.json")).unwrap();
    assert_eq!(model.model_type, "llama");
}

#[test]
fn another_json_file_says_a_spec_is_toml_and_a_checkpoint_a_folder() {
    let e = load(&fixture("llama").join("expected.json")).err().unwrap().to_string();
    assert!(e.contains("expected.json") && e.contains("TOML") && e.contains("folder"), "{e}");
}

#[test]
fn every_fixture_checkpoint_loads_and_computes_finite_logits() {
    for name in FIXTURES {
        let model = load(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(step_is_finite(&model), "{name}");
    }
}

/// splitmix64: a seeded stream for the mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<T: Clone>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())].clone()
    }
}

/// A hostile replacement for `old`.
fn hostile(rng: &mut Rng, old: &Value) -> Option<Value> {
    let v = |s: &str| serde_json::from_str::<Value>(s).unwrap();
    Some(match rng.below(9) {
        0 => v(rng.pick(&["0", "1", "2", "3", "-1", "7", "16"])),
        1 => v(rng.pick(&["16777217", "1099511627776", "18446744073709551615", "1e300"])),
        2 => v(rng.pick(&["-1.0", "0.0", "1e-40", "0.5", "2.5", "1e30", "-0.0"])),
        3 => v(rng.pick(&["\"x\"", "\"full_attention\"", "\"sparse\"", "\"yarn\"", "\"llama3\"", "\"linear\""])),
        4 => Value::Null,
        5 => return None,
        6 => match old {
            Value::Array(a) if !a.is_empty() => {
                let mut a = a.clone();
                if rng.below(2) == 0 {
                    a.pop();
                } else {
                    a.push(a[0].clone());
                }
                Value::Array(a)
            }
            _ => v("[1, 2]"),
        },
        7 => Value::Bool(rng.below(2) == 0),
        _ => match old.as_u64() {
            Some(n) => {
                v(&rng.pick(&[n.saturating_mul(2), n / 2, n.saturating_add(1), n.saturating_sub(1)]).to_string())
            }
            None => v("{\"rope_type\": \"yarn\", \"factor\": 4}"),
        },
    })
}

/// Mutates one to three keys of `cfg` (top level, or inside one of its objects).
fn mutate(rng: &mut Rng, cfg: &mut Value) {
    for _ in 0..1 + rng.below(3) {
        let Some(top) = cfg.as_object_mut() else { return };
        let keys: Vec<String> = top.keys().cloned().collect();
        let key = rng.pick(&keys);
        let target = match top.get_mut(&key) {
            Some(Value::Object(inner)) if !inner.is_empty() && rng.below(2) == 0 => inner,
            _ => top,
        };
        let keys: Vec<String> = target.keys().cloned().collect();
        let key = rng.pick(&keys);
        match hostile(rng, &target[&key]) {
            Some(new) => target.insert(key, new),
            None => target.remove(&key),
        };
    }
}

/// Seeded mutations of every fixture's `config.json` (and some of its text) go through parsing,
/// the checks, and — when they pass and the model is tiny — a build with random weights and one
/// step: none may panic, and a model that builds computes finite logits.
#[test]
fn mutated_fixture_configs_never_panic() {
    const MUTATIONS: usize = 5000;
    const BUILDS: usize = 200;
    let originals: Vec<String> =
        FIXTURES.iter().map(|f| std::fs::read_to_string(fixture(f).join("config.json")).unwrap()).collect();
    let mut rng = Rng(0x5EED);
    let (mut accepted, mut built) = (0, 0);
    let weights = RandomWeights::new(1, 0.05);
    for i in 0..MUTATIONS {
        let original = &originals[i % originals.len()];
        let text = if rng.below(10) == 0 {
            // Text damage: a cut or a flipped byte.
            let mut bytes = original.as_bytes().to_vec();
            let at = rng.below(bytes.len());
            if rng.below(2) == 0 {
                bytes.truncate(at);
            } else {
                bytes[at] ^= 1 << rng.below(8);
            }
            String::from_utf8_lossy(&bytes).into_owned()
        } else {
            let mut value: Value = serde_json::from_str(original).unwrap();
            mutate(&mut rng, &mut value);
            value.to_string()
        };
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let Ok(cfg) = ConfigSource::parse("config.json".into(), &text) else { return (false, false) };
            let Ok(size) = check(&cfg) else { return (false, false) };
            if built >= BUILDS || size.params() > 1 << 19 {
                return (true, false);
            }
            let model = build(&cfg, &weights).unwrap_or_else(|e| panic!("checked, then failed to build: {e}"));
            assert!(step_is_finite(&model), "non-finite logits");
            (true, true)
        }));
        match outcome {
            Ok((a, b)) => {
                accepted += a as usize;
                built += b as usize;
            }
            Err(_) => panic!("mutation {i} panicked; its config:\n{text}"),
        }
    }
    assert!(accepted > 100 && built == BUILDS, "accepted {accepted}, built {built}");
}

/// What a simulated run reads of a model: its geometry and its cost.
#[allow(clippy::type_complexity)]
fn geometry(m: &Model) -> (Vec<usize>, usize, Vec<(usize, usize)>, usize, usize, [usize; 4], bool, u64, u64) {
    let macs = [m.num_layers(), m.body_macs_per_token(), m.lm_head_macs(), m.attention_macs(64)];
    let fingerprints = (m.layout_fingerprint(16), m.config_fingerprint);
    (
        m.kv_row_widths(),
        m.state_width(),
        m.moe_layers(),
        m.expert_bytes(),
        m.experts_per_token(),
        macs,
        m.mtp().is_some(),
        fingerprints.0,
        fingerprints.1,
    )
}

#[test]
fn a_model_built_from_its_config_alone_has_the_loaded_models_geometry_and_no_weights() {
    for name in FIXTURES {
        let loaded = load(&fixture(name)).unwrap();
        let shapes = super::load_shapes(&fixture(name)).unwrap();
        assert_eq!(geometry(&shapes), geometry(&loaded), "{name}");
        assert_eq!(
            (shapes.vocab_size, shapes.hidden_size, shapes.max_positions),
            (loaded.vocab_size, loaded.hidden_size, loaded.max_positions)
        );
        assert!(shapes.embeddings().is_empty() && !loaded.embeddings().is_empty(), "{name}");
    }
    // Its config.json names the same model.
    let config = fixture("llama").join("config.json");
    assert_eq!(geometry(&super::load_shapes(&config).unwrap()), geometry(&load(&fixture("llama")).unwrap()));
}

#[test]
fn a_trillion_parameter_config_builds_from_its_shapes_and_refuses_its_weights() {
    let k3 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/kimi-k3-shape");
    let e = load(&k3).err().expect("a model of a trillion parameters does not fit").to_string();
    assert!(e.contains("config.json") && e.contains("experts"), "{e}");
    let m = super::load_shapes(&k3).unwrap();
    assert_eq!(m.num_layers(), 61);
    assert_eq!(m.moe_layers().len(), 60);
    assert!(m.moe_layers().iter().all(|&(_, n)| n == 384) && m.experts_per_token() == 8);
    // MLA on every fourth layer (a latent of 512 and 64 rope dims a position), KDA state between.
    assert_eq!(m.kv_row_widths(), vec![576; 15]);
    assert!(m.state_width() > 0);
    // 384 × 60 experts of 3 × 7,168 × 2,048 parameters: about a trillion, in f32 bytes.
    let expert_params = m.expert_bytes() as f64 / 4.0;
    assert!((expert_params / (384.0 * 60.0 * 3.0 * 7168.0 * 2048.0) - 1.0).abs() < 0.01, "{expert_params}");
}
