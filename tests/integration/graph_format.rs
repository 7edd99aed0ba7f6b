//! docs/graph-format.md documents every key the graph loader accepts. The keys are not listed
//! here by hand: the loader itself is asked. A table answers an unknown key with the keys it takes
//! (`unknown field `x`, expected one of …`), an executor's settings with theirs
//! (`unknown key; known: …`), and the pool's executor with the executors there are; the test
//! probes every table that way, following sub-tables, and looks each key up in the manual.

use crate::common::{fixture, repo};
use std::collections::BTreeSet;

const PROBE: &str = "zz_not_a_key";

/// The error `kvflow check` gives for `text` (a graph in a temporary folder).
fn check_error(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.toml");
    std::fs::write(&path, text).unwrap();
    let out = crate::common::kvflow(&["check", &path.to_string_lossy()]);
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// The backticked names after `marker` in `error`, up to the end of its line or a parenthesis.
fn listed_after(error: &str, marker: &str) -> Option<Vec<String>> {
    let at = error.find(marker)? + marker.len();
    let rest = &error[at..];
    let rest = &rest[..rest.find(['\n', '(']).unwrap_or(rest.len())];
    Some(rest.split('`').skip(1).step_by(2).map(str::to_string).collect())
}

/// A graph with a model and one pool, and `table`'s probe key; `table` is "" for the top level,
/// "pool" for the pool, "pool.x" for a pool's sub-table, else a top-level table.
fn probe(table: &str, pool_lines: &str) -> String {
    let model = format!("[model]\npath = {:?}\n", fixture("hf/llama").display().to_string());
    let pool = format!("[[pool]]\nname = \"a\"\n{pool_lines}");
    match table {
        "" => format!("{PROBE} = 1\n{model}{pool}"),
        "pool" => format!("{model}{pool}{PROBE} = 1\n"),
        "link" => format!("{model}{pool}[[link]]\n{PROBE} = 1\n"),
        t if t.starts_with("pool.") => format!("{model}{pool}[{t}]\n{PROBE} = 1\n"),
        "model" => format!("[model]\n{PROBE} = 1\n{pool}"),
        t => format!("{model}{pool}[{t}]\n{PROBE} = 1\n"),
    }
}

/// Every (table, key) the loader takes, found by probing from the top level down.
fn accepted_keys() -> BTreeSet<(String, String)> {
    let mut keys = BTreeSet::new();
    let top = check_error(&probe("", ""));
    let tables = listed_after(&top, "expected one of").unwrap_or_else(|| panic!("no key list: {top}"));
    let mut todo: Vec<String> = tables.clone();
    for table in &tables {
        keys.insert((String::new(), table.clone()));
    }
    while let Some(table) = todo.pop() {
        let error = check_error(&probe(&table, ""));
        let Some(fields) = listed_after(&error, "expected one of").or_else(|| listed_after(&error, "expected")) else {
            continue; // not a table of fixed keys
        };
        for field in fields {
            keys.insert((table.clone(), field.clone()));
            if table == "pool" {
                todo.push(format!("pool.{field}"));
            }
        }
    }
    // The executors' own settings.
    let model = format!("[model]\npath = {:?}\n", fixture("hf/llama").display().to_string());
    let error = check_error(&format!("{model}[[pool]]\nname = \"a\"\nexecutor = \"zz-no-such-executor\"\n"));
    let executors = listed_after(&error, "known:").or_else(|| listed_after(&error, "one of")).unwrap_or_default();
    assert!(executors.iter().any(|e| e == "cpu-deferred"), "no executor list: {error}");
    for executor in executors {
        let error = check_error(&probe("pool.executor_settings", &format!("executor = {executor:?}\n")));
        for key in listed_after(&error, "known:").unwrap_or_default() {
            keys.insert(("pool.executor_settings".to_string(), key));
        }
    }
    keys
}

#[test]
fn every_key_the_loader_accepts_is_in_the_graph_format_manual() {
    let manual = std::fs::read_to_string(repo().join("docs/graph-format.md")).unwrap();
    let keys = accepted_keys();
    assert!(keys.len() > 60, "the probe found only {} keys: {keys:?}", keys.len());
    for needle in [("pool.executor_settings", "cuda_graphs"), ("workload", "pool_choice"), ("link", "endpoint")] {
        assert!(keys.contains(&(needle.0.to_string(), needle.1.to_string())), "the probe missed {needle:?}");
    }
    let mut missing = Vec::new();
    for (table, key) in &keys {
        let documented = if table.is_empty() {
            manual.contains(&format!("[{key}]")) || manual.contains(&format!("[[{key}]]"))
        } else {
            manual.lines().any(|l| l.trim_start_matches("# ").starts_with(&format!("{key} = ")))
                || manual.contains(&format!("`{key}`"))
                || manual.contains(&format!("[{table}.{key}]"))
        };
        if !documented {
            missing.push(if table.is_empty() { key.clone() } else { format!("{table}.{key}") });
        }
    }
    assert!(missing.is_empty(), "docs/graph-format.md does not document the keys {missing:?}");
}
