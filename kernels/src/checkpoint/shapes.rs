//! A model's shapes without its values: what a simulated run builds from a config alone (issue
//! 44), so that a model far larger than this machine — or one that has no checkpoint yet — gives
//! its cost and its memory geometry (KV rows, state slots, experts, FLOPs per token). Which
//! optional tensors are present (an MTP layer, fused forms) the checkpoint's headers say when it
//! has any; a config alone holds every one, as a seeded spec does. Its matrices keep their
//! dimensions and hold nothing; the small vectors (norms, biases, convolutions) are zeros. A model
//! built from it can be measured, never run.

use super::{LoadError, WeightSource};
use std::path::PathBuf;

/// The most values a small tensor may have here (16 Mi floats): a larger one must be read by a
/// part that keeps only its shape ([`WeightSource::shapes_only`]), or the load fails naming it.
const SMALL_TENSOR: usize = 1 << 24;

/// Hands out shapes: matrices carry no values.
pub struct ShapesOnly<'a> {
    /// The checkpoint whose headers say which tensors exist (`None`: a config alone, every one).
    pub present: Option<&'a dyn WeightSource>,
}

impl WeightSource for ShapesOnly<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let n = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).unwrap_or(usize::MAX);
        if n > SMALL_TENSOR {
            return Err(LoadError::NotAModel {
                path: PathBuf::from("<shapes only>"),
                message: format!(
                    "tensor `{name}` of shape {shape:?} is read with its values by a part that cannot be built from \
                     its shape alone (a model built from its config for a simulated run holds no weights)"
                ),
            });
        }
        Ok(vec![0.0; n])
    }

    fn contains(&self, name: &str) -> bool {
        self.present.is_none_or(|w| w.contains(name))
    }

    fn shapes_only(&self) -> bool {
        true
    }
}
