//! README.md stays an honest first screen: its two commands head their code blocks under the
//! headings CI reads, its picture of a pool names exactly the operators `kvflow check --dot`
//! draws, its layout table names every folder and every operator file, and docs/features.md names
//! only graphs that exist.

use crate::common::repo;
use std::collections::BTreeSet;
use std::path::Path;

fn readme() -> String {
    std::fs::read_to_string(repo().join("README.md")).unwrap()
}

/// The lines of the section under `## heading` (up to the next `## `).
fn section<'a>(text: &'a str, heading: &str) -> Vec<&'a str> {
    let mut lines = text.lines().skip_while(|l| *l != heading);
    assert!(lines.next().is_some(), "README.md has no `{heading}`");
    lines.take_while(|l| !l.starts_with("## ")).collect()
}

/// The first line inside the first fenced block of `lines`.
fn first_command(lines: &[&str]) -> Option<String> {
    let fence = lines.iter().position(|l| l.starts_with("```"))?;
    lines.get(fence + 1).map(|l| l.to_string())
}

#[test]
fn the_two_commands_head_their_code_blocks() {
    let text = readme();
    let main_job = first_command(&section(&text, "## Run the main job"));
    assert_eq!(main_job.as_deref(), Some("cargo run --release -- run graphs/quickstart.toml --verify"));
    let tests = first_command(&section(&text, "## Run the tests"));
    assert_eq!(tests.as_deref(), Some("bash tools/test.sh"));
    let ci = std::fs::read_to_string(repo().join(".ci/run")).unwrap();
    assert!(ci.contains("/^## Run the tests/"), ".ci/run must run the README's test command");
}

/// Operator names in a picture or a DOT label: `name(t)`, `name[ℓ](t)` (the layer dropped), and
/// `admit`.
fn operator_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices("(t)") {
        let head = &text[..at];
        let head = head.strip_suffix(']').map_or(head, |h| &h[..h.rfind('[').unwrap_or(h.len())]);
        let name: String = head.chars().rev().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if !name.is_empty() {
            names.insert(name.chars().rev().collect());
        }
    }
    if text.contains("admit") {
        names.insert("admit".to_string());
    }
    names
}

#[test]
fn the_pool_picture_names_exactly_the_operators_kvflow_check_draws() {
    let text = readme();
    let start = text.find("One pool's operators").expect("README.md has the pool picture");
    let block = &text[start..];
    let open = block.find("```\n").unwrap() + 4;
    let picture = &block[open..open + block[open..].find("```").unwrap()];
    let pictured = operator_names(picture);
    // Every graph the repository ships (the SmolLM2 graph names a model fetched elsewhere; its
    // pool is an aggregated one like quickstart's).
    let mut drawn = BTreeSet::new();
    for entry in std::fs::read_dir(repo().join("graphs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") || path.ends_with("smollm2.toml") {
            continue;
        }
        let out = crate::common::kvflow(&["check", &path.to_string_lossy(), "--dot"]);
        assert!(out.status.success(), "{}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
        for label in String::from_utf8_lossy(&out.stdout).split("label=\"").skip(1) {
            let label = &label[..label.find(['"', '\\']).unwrap_or(label.len())];
            if label.ends_with("(t)") || label == "admit" {
                drawn.extend(operator_names(label));
            }
        }
    }
    assert_eq!(pictured, drawn, "README.md's pool picture against the operators `kvflow check --dot` draws");
}

/// The README's layout table: the backticked spans of its rows.
fn layout_spans(text: &str) -> BTreeSet<String> {
    section(text, "## Layout")
        .iter()
        .filter(|l| l.starts_with('|'))
        .flat_map(|l| l.split('`').skip(1).step_by(2).map(str::to_string).collect::<Vec<_>>())
        .collect()
}

/// Folders a newcomer must find in the table: every top-level folder and every folder holding
/// Rust sources.
fn folders_to_name(root: &Path) -> BTreeSet<String> {
    let mut folders = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            let rel = path.strip_prefix(root).unwrap().to_string_lossy().to_string();
            if path.is_dir() {
                if name.starts_with('.') || rel == "target" || rel.starts_with("target/") {
                    continue;
                }
                if dir == root {
                    folders.insert(format!("{rel}/"));
                }
                stack.push(path);
            } else if name.ends_with(".rs") && dir != root {
                folders.insert(format!("{}/", dir.strip_prefix(root).unwrap().to_string_lossy()));
            }
        }
    }
    folders
}

/// Files of operators/src that define a timely operator.
fn operator_files(root: &Path) -> BTreeSet<String> {
    let markers = ["unary_frontier", "binary_frontier", "OperatorBuilder", "builder_rc", ".sink(", ".unary("];
    let mut files = BTreeSet::new();
    let mut stack = vec![root.join("operators/src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                if markers.iter().any(|m| text.contains(m)) {
                    files.insert(path.file_name().unwrap().to_string_lossy().to_string());
                }
            }
        }
    }
    files
}

#[test]
fn the_layout_table_names_every_folder_and_every_operator_file() {
    let spans = layout_spans(&readme());
    let root = repo();
    let missing_folders: Vec<_> = folders_to_name(&root).into_iter().filter(|f| !spans.contains(f)).collect();
    assert!(missing_folders.is_empty(), "README.md's layout table lacks the folders {missing_folders:?}");
    let operators = operator_files(&root);
    assert!(operators.contains("align.rs") && operators.contains("admit.rs"), "{operators:?}");
    let missing_files: Vec<_> = operators.into_iter().filter(|f| !spans.contains(f)).collect();
    assert!(missing_files.is_empty(), "README.md's layout table lacks the operator files {missing_files:?}");
}

#[test]
fn every_graph_the_features_name_exists() {
    let features = std::fs::read_to_string(repo().join("docs/features.md")).unwrap();
    let mut named = 0;
    for span in features.split('`').skip(1).step_by(2) {
        for word in span.split_whitespace() {
            if let Some(at) = word.find("graphs/") {
                let path = word[at..].trim_end_matches([',', '.', ')']);
                if path.ends_with(".toml") {
                    named += 1;
                    assert!(repo().join(path).is_file(), "docs/features.md names {path}, which does not exist");
                }
            }
        }
    }
    assert!(named >= 10, "docs/features.md names {named} graphs");
    // Each feature section says which graph shows it or which command runs it.
    for part in features.split("\n## ").skip(2) {
        let title = part.lines().next().unwrap();
        assert!(part.contains("Run: `"), "docs/features.md's section `{title}` has no command");
    }
}
