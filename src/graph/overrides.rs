//! Command-line overrides of a graph (`kvflow run`, `compare` and `serve` flags).
//!
//! They are written into the graph as read — the raw layer — before it is checked, so a flag
//! stands in for a value the file lacks or gets wrong: `kvflow serve graph.toml --model FILE`
//! starts though the graph's own `model.path` does not exist. A value set on the command line goes
//! through the same rules as one in the file; its error names the key, no line, and says
//! "(set on the command line)". Paths given as flags are used as given (relative to the working
//! directory), not resolved against the graph's folder.

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::PathBuf;

use toml::Spanned;

use super::raw::RawGraph;

/// Command-line overrides of a graph. Paths are used as given (relative to the working
/// directory), not resolved against the graph file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub model: Option<PathBuf>,
    pub trace: Option<PathBuf>,
    pub format: Option<String>,
    pub limit: Option<usize>,
    pub warmup: Option<usize>,
    pub block_tokens: Option<usize>,
    pub max_output_tokens: Option<usize>,
    /// Switches the workload to concurrency mode with this many requests in flight.
    pub concurrency: Option<usize>,
    /// Sets the ranks of every pool.
    pub ranks: Option<usize>,
    pub out: Option<PathBuf>,
}

/// The keys whose values came from the command line.
pub(super) type CommandLineKeys = BTreeSet<&'static str>;

/// A value with no place in the file.
fn unplaced<T>(value: T) -> Spanned<T> {
    const NOWHERE: Range<usize> = 0..0;
    Spanned::new(NOWHERE, value)
}

fn path_text(path: &std::path::Path) -> String {
    path.to_string_lossy().into_owned()
}

impl Overrides {
    /// Writes the overrides into the graph as read; the keys they set.
    pub(super) fn write_into(&self, raw: &mut RawGraph) -> CommandLineKeys {
        let mut keys = CommandLineKeys::new();
        let mut set = |key: &'static str| {
            keys.insert(key);
        };
        if let Some(model) = &self.model {
            raw.model.path = Some(unplaced(path_text(model)));
            set("model.path");
        }
        let workload = &mut raw.workload;
        if let Some(trace) = &self.trace {
            workload.trace = Some(unplaced(path_text(trace)));
            set("workload.trace");
        }
        if let Some(format) = &self.format {
            workload.format = Some(unplaced(format.clone()));
            set("workload.format");
        }
        if let Some(limit) = self.limit {
            workload.limit = Some(unplaced(limit));
            set("workload.limit");
        }
        if let Some(warmup) = self.warmup {
            workload.warmup = Some(warmup);
        }
        if let Some(block_tokens) = self.block_tokens {
            workload.block_tokens = Some(unplaced(block_tokens));
            set("workload.block_tokens");
        }
        if let Some(max_output_tokens) = self.max_output_tokens {
            workload.max_output_tokens = Some(unplaced(max_output_tokens));
            set("workload.max_output_tokens");
        }
        if let Some(concurrency) = self.concurrency {
            // The flag switches the mode: the other modes' keys go with it.
            workload.mode = Some(unplaced("concurrency".to_string()));
            workload.concurrency = Some(unplaced(concurrency));
            workload.time_scale = None;
            workload.rate = None;
            set("workload.mode");
            set("workload.concurrency");
        }
        if let Some(ranks) = self.ranks {
            for pool in &mut raw.pool {
                pool.get_mut().ranks = Some(unplaced(ranks));
            }
            set("pool.ranks");
        }
        if let Some(out) = &self.out {
            raw.report.out = Some(unplaced(path_text(out)));
            set("report.out");
        }
        keys
    }
}
