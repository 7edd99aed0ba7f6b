//! Errors of graph loading: [`GraphError`], the [`Location`] in the graph file it names, and the
//! translation of TOML errors (syntax, unknown key, wrong type) into the same
//! `FILE:LINE: key `a.b`: ...` form, finding the dotted key from the byte span the TOML parser
//! reports.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Where in a graph file an error is: the file, and the 1-based line when the value came from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub file: PathBuf,
    pub line: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}", self.file.display()),
            None => write!(f, "{}", self.file.display()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    #[error("{}: cannot read the graph file: {source}", .file.display())]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("{at}: {message}")]
    Syntax { at: Location, message: String },
    /// A key is unknown, has the wrong type or an invalid value, or is missing.
    #[error("{at}: key `{key}`: {message}")]
    Key { at: Location, key: String, message: String },
    #[error("{}: no pool named `{name}`; the pools are {}", .file.display(), quoted_list(.known))]
    UnknownPool { file: PathBuf, name: String, known: Vec<String> },
}

impl GraphError {
    /// The 1-based line in the graph file the error is about, when there is one.
    pub fn line(&self) -> Option<usize> {
        match self {
            GraphError::Syntax { at, .. } | GraphError::Key { at, .. } => at.line,
            GraphError::Read { .. } | GraphError::UnknownPool { .. } => None,
        }
    }

    /// The dotted key the error is about (`scheduler.chunk_tokens`), when there is one.
    pub fn key(&self) -> Option<&str> {
        match self {
            GraphError::Key { key, .. } => Some(key),
            _ => None,
        }
    }
}

pub(super) fn quoted_list(names: &[impl AsRef<str>]) -> String {
    names.iter().map(|name| format!("`{}`", name.as_ref())).collect::<Vec<_>>().join(", ")
}

// ---------------------------------------------------------------------------------------------
// TOML errors (syntax, unknown key, wrong type) in the same `FILE:LINE: key `a.b`: ...` form.

/// 1-based line of a byte offset.
pub(super) fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end].iter().filter(|&&b| b == b'\n').count() + 1
}

pub(super) fn toml_error(file: &Path, text: &str, error: &toml::de::Error) -> GraphError {
    let at = Location { file: file.to_path_buf(), line: error.span().map(|span| line_of(text, span.start)) };
    let message = error.message().trim_end().to_string();
    match error.span().and_then(|span| key_at(text, span.start)) {
        Some(key) if (key == "pool" || key == "link") && message.contains("expected a sequence") => {
            let hint = format!("{message}: {key}s are an array of tables, written [[{key}]]");
            GraphError::Key { at, key, message: hint }
        }
        Some(key) => GraphError::Key { at, key, message },
        None => GraphError::Syntax { at, message },
    }
}

/// The dotted key whose name or value covers byte `offset`, the innermost when several do.
/// `None` when the text is not valid TOML (the error is then a syntax error).
fn key_at(text: &str, offset: usize) -> Option<String> {
    let document = toml::de::DeTable::parse(text).ok()?;
    let mut spans = Vec::new();
    collect_key_spans(document.get_ref(), "", &mut spans);
    spans
        .into_iter()
        .filter(|(_, span)| span.contains(&offset) || (span.is_empty() && span.start == offset))
        .min_by_key(|(_, span)| span.len())
        .map(|(key, _)| key)
}

/// Every key of `table` (recursively) with the spans of its name and its value. Tables opened by
/// a header span only the header, so nested keys are collected whatever their parent's span.
fn collect_key_spans(table: &toml::de::DeTable<'_>, prefix: &str, out: &mut Vec<(String, Range<usize>)>) {
    for (name, value) in table {
        let key = if prefix.is_empty() { name.get_ref().to_string() } else { format!("{prefix}.{}", name.get_ref()) };
        out.push((key.clone(), name.span()));
        out.push((key.clone(), value.span()));
        match value.get_ref() {
            toml::de::DeValue::Table(inner) => collect_key_spans(inner, &key, out),
            toml::de::DeValue::Array(items) => {
                for item in items.iter() {
                    out.push((key.clone(), item.span()));
                    if let toml::de::DeValue::Table(inner) = item.get_ref() {
                        collect_key_spans(inner, &key, out);
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::test_support::{assert_key_error, minimal_plus, Fixture, MINIMAL};

    #[test]
    fn unknown_key_names_the_key_and_line() {
        let error = Fixture::new().error(&minimal_plus("[scheduler]\nmax_running = 4\nchunk_size = 8\n"));
        assert_key_error(&error, "scheduler.chunk_size", 8, &["unknown field `chunk_size`", "chunk_tokens"]);
    }

    #[test]
    fn unknown_key_in_a_pool_names_the_key_and_line() {
        let error = Fixture::new().error("[model]\npath = \"model\"\n[[pool]]\nname = \"a\"\nsize = 2\n");
        assert_key_error(&error, "pool.size", 5, &["unknown field `size`"]);
    }

    #[test]
    fn unknown_section_and_top_level_key_are_errors() {
        let fixture = Fixture::new();
        assert_key_error(&fixture.error(&minimal_plus("[stores]\nkind = \"disk\"\n")), "stores", 6, &["unknown field"]);
        assert_key_error(&fixture.error(&format!("title = \"x\"\n{MINIMAL}")), "title", 1, &["unknown field"]);
    }

    #[test]
    fn wrong_type_names_the_key_and_line() {
        let error = Fixture::new().error("[model]\npath = \"model\"\n[[pool]]\nname = \"a\"\nranks = \"two\"\n");
        assert_key_error(&error, "pool.ranks", 5, &["invalid type", "expected usize"]);
        let error = Fixture::new().error(&minimal_plus("[scheduler]\nmax_running = -1\n"));
        assert_key_error(&error, "scheduler.max_running", 7, &["-1"]);
    }

    #[test]
    fn a_single_bracket_pool_table_hints_at_double_brackets() {
        let error = Fixture::new().error("[model]\npath = \"model\"\n[pool]\nname = \"a\"\n");
        assert_key_error(&error, "pool", 3, &["written [[pool]]"]);
    }

    #[test]
    fn toml_syntax_error_names_the_line() {
        let error = Fixture::new().error(&minimal_plus("[slo]\nttft_ms = \n"));
        assert!(matches!(error, GraphError::Syntax { .. }), "{error}");
        assert_eq!(error.line(), Some(7), "{error}");
        assert!(error.to_string().contains("graph.toml:7: "), "{error}");
    }
}
