//! What `kvflow bench speed` measures at and against: the shapes (`--shapes 64x256,1x32768`:
//! batch × prompt tokens) and the anchors `benches/device/transformers_speed.py` measured for
//! each shape and dtype in the same device call (transformers eager, with a static cache and a
//! compiled decode step, the step's weight products alone through cuBLAS, SDPA prefill, the
//! flash-linear-attention kernels), read from its JSON.

use anyhow::{anyhow, Context, Result};
use kvflow_kernels::cuda::Dtype;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// One measured shape: `batch` sequences of `prompt` tokens each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub batch: usize,
    pub prompt: usize,
}

impl Shape {
    /// Parses `BATCHxPROMPT` (`64x256`; `×` is accepted too), both whole numbers ≥ 1.
    pub fn parse(text: &str) -> Result<Shape, String> {
        let t = text.trim();
        let (b, p) = t
            .split_once(['x', 'X', '×'])
            .ok_or_else(|| format!("expected BATCHxPROMPT (say 64x256: batch × prompt tokens), got {text:?}"))?;
        let field = |what: &str, v: &str| crate::flags::count(v).map_err(|e| format!("{text:?}: the {what}: {e}"));
        Ok(Shape { batch: field("batch (before the x)", b)?, prompt: field("prompt tokens (after the x)", p)? })
    }

    /// The key of the shape in transformers_speed.py's JSON (`64x256`).
    pub fn key(&self) -> String {
        format!("{}x{}", self.batch, self.prompt)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} × {}", self.batch, self.prompt)
    }
}

/// One way transformers (or torch alone) ran a shape: what it measured, or why it did not.
#[derive(Deserialize, Debug, Clone)]
pub struct Anchor {
    /// What ran ("transformers eager, dynamic cache (attention sdpa)", …).
    pub name: String,
    #[serde(default)]
    pub prefill_tokens_per_s: Option<f64>,
    #[serde(default)]
    pub decode_ms_per_step: Option<f64>,
    /// How it was measured (rounds, compile time, context), printed beside the figure.
    #[serde(default)]
    pub note: Option<String>,
    /// Why it measured nothing (compile failed, a package missing, out of the time budget).
    #[serde(default)]
    pub error: Option<String>,
}

/// A shape's anchors per dtype, in the order the script measured them.
#[derive(Deserialize, Debug, Default)]
struct ShapeAnchors {
    #[serde(default)]
    float32: Vec<Anchor>,
    #[serde(default)]
    bfloat16: Vec<Anchor>,
}

/// `benches/device/transformers_speed.py`'s output.
#[derive(Deserialize, Debug)]
pub struct Baseline {
    pub transformers: String,
    pub torch: String,
    /// torch.matmul of two 8192² matrices, TFLOP/s (float32 without TF32; bfloat16); `None`
    /// where the script did not measure them (its dry run).
    pub matmul_tflops_float32: Option<f64>,
    pub matmul_tflops_bfloat16: Option<f64>,
    /// Anchors by shape key (`64x256`).
    shapes: BTreeMap<String, ShapeAnchors>,
}

impl Baseline {
    /// Reads the JSON at `path`; the older one-shape format (figures under `float32` and
    /// `bfloat16` at the top) is refused, saying what is expected instead.
    pub fn read(path: &Path) -> Result<Baseline> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Baseline> {
        let value: serde_json::Value =
            serde_json::from_str(text).with_context(|| format!("{}: not JSON", path.display()))?;
        let Some(top) = value.as_object() else {
            return Err(anyhow!(
                "{}: expected a JSON object from benches/device/transformers_speed.py",
                path.display()
            ));
        };
        if !top.contains_key("shapes") {
            let old = top.contains_key("float32") || top.contains_key("bfloat16");
            return Err(anyhow!(
                "{}: {}expected transformers_speed.py's figures keyed by shape: {{\"shapes\": {{\"64x256\": \
                 {{\"bfloat16\": [anchors]}}}}}} — run benches/device/transformers_speed.py again",
                path.display(),
                if old {
                    "the old one-shape format (figures under `float32` and `bfloat16`); "
                } else {
                    "no `shapes`; "
                }
            ));
        }
        serde_json::from_value(value).with_context(|| {
            format!(
                "{}: not transformers_speed.py's JSON (expected `transformers`, `torch`, the matmul rates and \
                 `shapes`: {{\"BATCHxPROMPT\": {{\"float32\"|\"bfloat16\": [{{\"name\", \"prefill_tokens_per_s\", \
                 \"decode_ms_per_step\", \"note\", \"error\"}}]}}}})",
                path.display()
            )
        })
    }

    /// torch.matmul's rate in `dtype`, TFLOP/s, if measured.
    pub fn matmul_tflops(&self, dtype: Dtype) -> Option<f64> {
        match dtype {
            Dtype::Bfloat16 => self.matmul_tflops_bfloat16,
            Dtype::Float32 => self.matmul_tflops_float32,
        }
        .filter(|r| *r > 0.0)
    }

    /// The anchors measured at `shape` in `dtype` (empty when the shape was not measured).
    pub fn anchors(&self, shape: Shape, dtype: Dtype) -> &[Anchor] {
        match self.shapes.get(&shape.key()) {
            Some(s) if dtype == Dtype::Bfloat16 => &s.bfloat16,
            Some(s) => &s.float32,
            None => &[],
        }
    }

    /// The shapes the baseline holds figures for in `dtype` (for the line saying one is missing).
    pub fn shape_keys(&self, dtype: Dtype) -> Vec<&str> {
        let holds = |s: &ShapeAnchors| !if dtype == Dtype::Bfloat16 { &s.bfloat16 } else { &s.float32 }.is_empty();
        self.shapes.iter().filter(|(_, s)| holds(s)).map(|(k, _)| k.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_bad_ones_say_what_was_expected() {
        assert_eq!(Shape::parse("64x256").unwrap(), Shape { batch: 64, prompt: 256 });
        assert_eq!(Shape::parse(" 1×32768 ").unwrap(), Shape { batch: 1, prompt: 32768 });
        assert_eq!(Shape::parse("16x4096").unwrap().key(), "16x4096");
        for bad in ["64", "0x256", "64x", "x256", "64x-1", "axb"] {
            let e = Shape::parse(bad).unwrap_err();
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn the_old_one_shape_format_is_refused_naming_the_file_and_the_new_one() {
        let old = r#"{"transformers": "5.17.0", "torch": "2.11", "matmul_tflops_float32": 50.0,
            "matmul_tflops_bfloat16": 700.0, "float32": {"prefill_tokens_per_s": 1.0, "decode_ms_per_step": 2.0},
            "bfloat16": {"prefill_tokens_per_s": 1.0, "decode_ms_per_step": 2.0}}"#;
        let e = format!("{:#}", Baseline::parse(Path::new("/tmp/t.json"), old).unwrap_err());
        assert!(e.contains("/tmp/t.json") && e.contains("old one-shape format") && e.contains("\"shapes\""), "{e}");
        let e = format!("{:#}", Baseline::parse(Path::new("b.json"), "[1]").unwrap_err());
        assert!(e.contains("b.json") && e.contains("JSON object"), "{e}");
        let bad = r#"{"transformers": "5", "torch": "2", "shapes": {"1x2": {"bfloat16": [{"note": "no name"}]}}}"#;
        let e = format!("{:#}", Baseline::parse(Path::new("c.json"), bad).unwrap_err());
        assert!(e.contains("c.json") && e.contains("name"), "{e}");
    }

    #[test]
    fn anchors_are_found_by_shape_and_dtype() {
        let text = r#"{"transformers": "5.17.0", "torch": "2.11", "matmul_tflops_float32": null,
            "matmul_tflops_bfloat16": 700.0, "shapes": {"64x256": {
              "bfloat16": [{"name": "eager", "prefill_tokens_per_s": 5.0, "decode_ms_per_step": 60.0},
                           {"name": "compiled", "error": "compile failed"}],
              "float32": [{"name": "eager", "decode_ms_per_step": 70.0}]}}}"#;
        let b = Baseline::parse(Path::new("b.json"), text).unwrap();
        let s = Shape { batch: 64, prompt: 256 };
        let bf = b.anchors(s, Dtype::Bfloat16);
        assert_eq!(bf.len(), 2);
        assert_eq!(bf[1].error.as_deref(), Some("compile failed"));
        assert_eq!(b.anchors(s, Dtype::Float32)[0].decode_ms_per_step, Some(70.0));
        assert!(b.anchors(Shape { batch: 1, prompt: 256 }, Dtype::Bfloat16).is_empty());
        assert_eq!(b.matmul_tflops(Dtype::Float32), None);
        assert_eq!(b.matmul_tflops(Dtype::Bfloat16), Some(700.0));
        assert_eq!(b.shape_keys(Dtype::Float32), ["64x256"]);
        assert!(b.anchors(s, Dtype::Bfloat16).len() == 2 && b.shape_keys(Dtype::Bfloat16) == ["64x256"]);
    }
}
