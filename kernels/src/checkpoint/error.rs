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
    #[error("{path}: not a valid GGUF file: {message}")]
    Gguf { path: PathBuf, message: String },
    #[error("missing tensor `{name}` in {path}")]
    MissingTensor { path: PathBuf, name: String },
    #[error("tensor `{name}` in {path}: expected shape {expected:?}, found {found:?}")]
    WrongShape { path: PathBuf, name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor `{name}` in {path}: expected dtype F32, BF16 or F16, found {found}")]
    WrongDtype { path: PathBuf, name: String, found: String },
    #[error("tensor `{name}` in {path}: expected finite values, found {value} at flat index {index}")]
    NonFinite { path: PathBuf, name: String, index: usize, value: f32 },
    #[error(
        "{path}: the model needs about {estimate} of f32 weights, more than the {limit} {limit_source}; \
         biggest terms: {biggest}"
    )]
    TooLarge { path: PathBuf, estimate: String, limit: String, limit_source: String, biggest: String },
    #[error("{path}: {message}")]
    NotAModel { path: PathBuf, message: String },
}

impl LoadError {
    pub(crate) fn config(path: impl Into<PathBuf>, field: &str, message: impl Into<String>) -> Self {
        LoadError::Config { path: path.into(), field: field.to_string(), message: message.into() }
    }
}
