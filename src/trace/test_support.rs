//! Test fixtures shared by the trace tests: the repository's sample traces, temporary trace files,
//! and reading a malformed trace into its error message.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::{read_trace, TraceFormat};

pub(super) fn repo_trace(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("traces").join(relative)
}

/// A temporary trace file, removed on drop.
pub(super) struct ScratchFile(pub(super) PathBuf);

impl ScratchFile {
    pub(super) fn new(name: &str, contents: &str) -> Self {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let unique = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("kvflow-trace-test-{}-{unique}-{name}", std::process::id()));
        std::fs::File::create(&path).and_then(|mut file| file.write_all(contents.as_bytes())).unwrap();
        ScratchFile(path)
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

pub(super) fn read_error(name: &str, format: TraceFormat, contents: &str) -> String {
    let file = ScratchFile::new(name, contents);
    let error = read_trace(&file.0, format).expect_err("malformed trace must be rejected");
    let message = error.to_string();
    assert!(message.contains(name), "message should name the file: {message}");
    message
}
