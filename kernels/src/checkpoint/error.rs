use std::path::PathBuf;
use thiserror::Error;

/// Why a model could not be loaded or built.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not valid JSON/TOML: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: unknown model_type {found:?}; supported: {supported}")]
    UnknownModelType { path: PathBuf, found: String, supported: String },
    #[error("{path}: field `{field}`: {message}")]
    Config { path: PathBuf, field: String, message: String },
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("missing tensor `{name}` in {path}")]
    MissingTensor { path: PathBuf, name: String },
    #[error("tensor `{name}` in {path}: expected shape {expected:?}, found {found:?}")]
    WrongShape { path: PathBuf, name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor `{name}` in {path}: expected dtype F32, BF16 or F16, found {found}")]
    WrongDtype { path: PathBuf, name: String, found: String },
}

impl LoadError {
    pub(crate) fn config(path: impl Into<PathBuf>, field: &str, message: impl Into<String>) -> Self {
        LoadError::Config { path: path.into(), field: field.to_string(), message: message.into() }
    }
}
