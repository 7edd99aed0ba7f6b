//! Test fixtures shared by the graph tests: a folder holding what test graphs name, the smallest
//! valid graph, and an assertion on errors of the `FILE:LINE: key `KEY`:` form.

use std::path::PathBuf;

use super::{Graph, GraphError, Overrides};

/// A folder holding a graph file `graph.toml`, a model folder `model/` and a trace
/// `trace.jsonl`, so paths in test graphs exist.
pub(super) struct Fixture {
    pub(super) dir: tempfile::TempDir,
}

impl Fixture {
    pub(super) fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(dir.path().join("model")).expect("model dir");
        std::fs::write(dir.path().join("trace.jsonl"), "").expect("trace");
        Fixture { dir }
    }

    pub(super) fn graph_path(&self) -> PathBuf {
        self.dir.path().join("graph.toml")
    }

    fn parse(&self, text: &str) -> Result<Graph, GraphError> {
        Graph::parse(&self.graph_path(), text)
    }

    /// `text` with command-line `overrides` written in.
    pub(super) fn parse_overridden(&self, text: &str, overrides: &Overrides) -> Result<Graph, GraphError> {
        Graph::parse_overridden(&self.graph_path(), text, &super::ComponentNames::builtin(), overrides)
    }

    pub(super) fn graph(&self, text: &str) -> Graph {
        self.parse(text).unwrap_or_else(|error| panic!("{error}"))
    }

    pub(super) fn error(&self, text: &str) -> GraphError {
        match self.parse(text) {
            Ok(graph) => panic!("expected an error, got {graph:?}"),
            Err(error) => error,
        }
    }
}

pub(super) const MINIMAL: &str = "[model]\npath = \"model\"\n\n[[pool]]\nname = \"main\"\n";

/// `MINIMAL` with `extra` appended (its first line is line 6).
pub(super) fn minimal_plus(extra: &str) -> String {
    format!("{MINIMAL}{extra}")
}

/// A graph of the pools `(name, role)`, each written `[[pool]]`, `name`, `role` (pool `i`'s header
/// is line `3 + 3 * i`, its role line `5 + 3 * i`), with `extra` appended (its first line is line
/// `3 + 3 * pools.len()`).
pub(super) fn pools_plus(pools: &[(&str, &str)], extra: &str) -> String {
    let mut text = "[model]\npath = \"model\"\n".to_string();
    for (name, role) in pools {
        text.push_str(&format!("[[pool]]\nname = \"{name}\"\nrole = \"{role}\"\n"));
    }
    text.push_str(extra);
    text
}

/// A `[[link]]` from `from` to `to`: three lines.
pub(super) fn link(from: &str, to: &str) -> String {
    format!("[[link]]\nfrom = \"{from}\"\nto = \"{to}\"\n")
}

/// Prefill pool `p` and decode pool `d`, linked, with `extra` appended: its first line is line
/// 12, inside the `[[link]]` table (so `backend` and `endpoint` keys may follow), or a new table.
pub(super) fn linked_plus(extra: &str) -> String {
    pools_plus(&[("p", "prefill"), ("d", "decode")], &format!("{}{extra}", link("p", "d")))
}

/// The error names `key`, the `line` and the file, in the `FILE:LINE: key `KEY`:` form, and its
/// message contains each of `fragments`.
#[track_caller]
pub(super) fn assert_key_error(error: &GraphError, key: &str, line: usize, fragments: &[&str]) {
    let shown = error.to_string();
    assert_eq!(error.key(), Some(key), "{shown}");
    assert_eq!(error.line(), Some(line), "{shown}");
    assert!(shown.contains(&format!("graph.toml:{line}: key `{key}`: ")), "{shown}");
    for fragment in fragments {
        assert!(shown.contains(fragment), "`{fragment}` not in: {shown}");
    }
}
