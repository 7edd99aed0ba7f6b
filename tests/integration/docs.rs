//! The documentation stays true to the repository: every "DESIGN §N" citation names a section of
//! docs/design.md, nothing points at a folder outside the repository, every path the docs write
//! in backticks exists (and defines the function named after it), and the dataflow pictures in
//! docs/design.md are what `kvflow check GRAPH --dot` prints today.

use crate::common::repo;
use std::process::Command;

/// The design document every "DESIGN §N" citation refers to.
const DESIGN: &str = "docs/design.md";

/// The repository's tracked files (what a newcomer gets from a clone).
fn tracked_files() -> Vec<String> {
    let out = Command::new("git").args(["ls-files", "-z"]).current_dir(repo()).output().expect("git ls-files runs");
    assert!(out.status.success(), "git ls-files: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().split('\0').filter(|p| !p.is_empty()).map(str::to_string).collect()
}

/// Tracked files that read as text (binary fixtures and checkpoints are left out), with their
/// text. A tracked file deleted in the working tree but not yet in git is skipped.
fn tracked_texts() -> Vec<(String, String)> {
    tracked_files()
        .into_iter()
        .filter_map(|path| {
            let bytes = std::fs::read(repo().join(&path)).ok()?;
            let text = String::from_utf8(bytes).ok()?;
            (!text.contains('\0')).then_some((path, text))
        })
        .collect()
}

fn is_source_doc_or_test(path: &str) -> bool {
    [".rs", ".md", ".cu", ".toml", ".py"].iter().any(|ext| path.ends_with(ext))
}

/// The section numbers `## N.` of docs/design.md.
fn design_sections() -> Vec<u32> {
    let text = std::fs::read_to_string(repo().join(DESIGN)).expect("docs/design.md exists");
    text.lines()
        .filter_map(|l| l.strip_prefix("## "))
        .filter_map(|rest| rest.split_once('.').and_then(|(n, _)| n.parse().ok()))
        .collect()
}

/// Every section number cited as "DESIGN §N" (or "docs/design.md §N") in `text`, with its line
/// number; a list ("DESIGN §4, §9" or "DESIGN §4 and §9") cites each of its sections.
fn citations(text: &str) -> Vec<(usize, u32)> {
    let mut found = Vec::new();
    for (index, line) in text.lines().enumerate() {
        for prefix in ["DESIGN §", "DESIGN.md §", "design.md §"] {
            let mut rest = line;
            while let Some(at) = rest.find(prefix) {
                rest = &rest[at + prefix.len()..];
                loop {
                    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                    let Ok(section) = digits.parse() else { break };
                    found.push((index + 1, section));
                    rest = &rest[digits.len()..];
                    match [", §", " and §"].iter().find(|sep| rest.starts_with(*sep)) {
                        Some(sep) => rest = &rest[sep.len()..],
                        None => break,
                    }
                }
            }
        }
    }
    found
}

#[test]
fn every_design_citation_names_a_section_of_docs_design_md() {
    let sections = design_sections();
    for n in 1..=12 {
        assert!(sections.contains(&n), "{DESIGN} has no section `## {n}.`; code cites DESIGN §1 to §12");
    }
    let mut wrong = Vec::new();
    let mut cited = 0;
    for (path, text) in tracked_texts().iter().filter(|(p, _)| is_source_doc_or_test(p)) {
        for (line, section) in citations(text) {
            cited += 1;
            if !sections.contains(&section) {
                wrong.push(format!("{path}:{line}: cites DESIGN §{section}, which {DESIGN} does not have"));
            }
        }
    }
    assert!(cited > 50, "only {cited} citations found: is the search still reading the sources?");
    assert!(wrong.is_empty(), "citations of missing sections:\n{}", wrong.join("\n"));
}

/// What would send a reader outside the repository. Recorded outputs of past runs
/// (benches/results/) quote the paths of the machine they ran on; they cite nothing.
fn outside_references(line: &str) -> Vec<&'static str> {
    const OUTSIDE: [&str; 8] = [
        "../shared",
        "shared design folder",
        "shared/DESIGN",
        "shared/STYLE",
        "/work/",
        "DESIGN.md",
        "GUARANTEES.md",
        "TIMELY.md",
    ];
    OUTSIDE.iter().copied().filter(|pattern| line.contains(pattern)).collect()
}

#[test]
fn nothing_in_the_repository_points_at_a_folder_outside_it() {
    let this_file = "tests/integration/docs.rs";
    let mut found = Vec::new();
    for (path, text) in tracked_texts() {
        if path == this_file || path.starts_with("benches/results/") {
            continue;
        }
        for (index, line) in text.lines().enumerate() {
            for pattern in outside_references(line) {
                found.push(format!("{path}:{}: `{pattern}` refers to something outside the repository", index + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the design is {DESIGN} (cite it as DESIGN §N); the guarantees are its §5:\n{}",
        found.join("\n")
    );
}

/// A span written in backticks that names a file of the repository: a path with a folder in it
/// and a known extension, optionally followed by `::item` names (`src/runtime/pool.rs::build_pool_graph`).
/// Returns the path and the item names.
fn file_reference(span: &str) -> Option<(&str, Vec<&str>)> {
    let (path, items) = match span.find(".rs::") {
        Some(at) => (&span[..at + 3], span[at + 5..].split("::").collect()),
        None => (span, Vec::new()),
    };
    let extensions = [".rs", ".toml", ".md", ".cu", ".py", ".jsonl", ".json", ".csv", ".sh", ".txt"];
    let is_path = path.contains('/')
        && extensions.iter().any(|ext| path.ends_with(ext))
        && path.chars().all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c))
        && !path.starts_with('/');
    let items_are_names =
        items.iter().all(|i| !i.is_empty() && i.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    (is_path && items_are_names).then_some((path, items))
}

/// The backticked spans of a markdown line outside fenced code blocks.
fn backticked(line: &str) -> impl Iterator<Item = &str> {
    line.split('`').skip(1).step_by(2)
}

/// Whether `source` defines `name` as a function (or, for a name after a path, a type or module).
fn defines(source: &str, name: &str) -> bool {
    ["fn", "struct", "enum", "trait", "type", "mod", "const", "static"].iter().any(|kind| {
        let needle = format!("{kind} {name}");
        source.match_indices(&needle).any(|(at, _)| {
            let after = source[at + needle.len()..].chars().next();
            !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        })
    })
}

/// Whether `path` is where a run writes its output (`out/quickstart/report.json`): a path git
/// ignores names no file of the repository.
fn is_ignored_output(path: &str) -> bool {
    Command::new("git")
        .args(["check-ignore", "-q", "--no-index", path])
        .current_dir(repo())
        .status()
        .is_ok_and(|status| status.success())
}

/// Every broken file reference of one markdown document, as "doc:line: why".
fn broken_references(doc: &str, text: &str) -> Vec<String> {
    let mut broken = Vec::new();
    let mut in_fence = false;
    for (index, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        for (path, items) in backticked(line).filter_map(file_reference) {
            let at = format!("{doc}:{}", index + 1);
            if is_ignored_output(path) {
                continue;
            }
            let Ok(source) = std::fs::read_to_string(repo().join(path)) else {
                broken.push(format!("{at}: `{path}` does not exist"));
                continue;
            };
            for item in items {
                if !defines(&source, item) {
                    broken.push(format!("{at}: `{path}` defines no `fn {item}` (nor a type or module of that name)"));
                }
            }
        }
    }
    broken
}

#[test]
fn every_path_the_docs_write_in_backticks_exists() {
    let mut docs: Vec<String> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| format!("docs/{}", p.file_name().unwrap().to_string_lossy()))
        .collect();
    docs.push("README.md".to_string());
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let text = std::fs::read_to_string(repo().join(doc)).unwrap();
        checked += text.lines().flat_map(backticked).filter_map(file_reference).count();
        broken.extend(broken_references(doc, &text));
    }
    assert!(checked > 50, "only {checked} paths found in {docs:?}: is the search still reading them?");
    assert!(
        broken.is_empty(),
        "paths in the docs that the repository no longer has (code moved? fix the doc to name where it is now):\n{}",
        broken.join("\n")
    );
}

/// The graphs whose operator graph docs/design.md draws, each as `kvflow check GRAPH --dot`
/// prints it from the repository root.
const PICTURED: [&str; 2] = ["graphs/quickstart.toml", "graphs/pd-1p1d.toml"];

/// The text docs/design.md shows for `graph`: the fenced block after the line
/// `<!-- kvflow check GRAPH --dot -->`.
fn pictured(design: &str, graph: &str) -> Option<String> {
    let marker = format!("<!-- kvflow check {graph} --dot -->");
    let after = &design[design.find(&marker)? + marker.len()..];
    let fence = after.find("```dot\n")? + "```dot\n".len();
    let body = &after[fence..];
    Some(body[..body.find("```")?].to_string())
}

fn check_dot(graph: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["check", graph, "--dot"])
        .current_dir(repo())
        .output()
        .expect("kvflow runs");
    assert!(out.status.success(), "kvflow check {graph} --dot: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_dataflow_pictures_in_the_design_are_what_kvflow_check_draws() {
    let design = std::fs::read_to_string(repo().join(DESIGN)).unwrap();
    for graph in PICTURED {
        let refresh = format!(
            "refresh it: run `cargo build && target/debug/kvflow check {graph} --dot` at the repository root and \
             put its output in the ```dot block after `<!-- kvflow check {graph} --dot -->` in {DESIGN}"
        );
        let shown =
            pictured(&design, graph).unwrap_or_else(|| panic!("{DESIGN} shows no picture of {graph}: {refresh}"));
        let drawn = check_dot(graph);
        if shown != drawn {
            let first = shown
                .lines()
                .zip(drawn.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(shown.lines().count().min(drawn.lines().count()));
            panic!(
                "{DESIGN}'s picture of {graph} is not the dataflow the runtime builds today (first difference at line \
                 {} of the picture: shown {:?}, drawn {:?}): {refresh}",
                first + 1,
                shown.lines().nth(first),
                drawn.lines().nth(first)
            );
        }
    }
}
