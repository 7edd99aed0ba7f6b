//! Text in and out of a model, for served requests: its tokenizer and its chat template. A
//! checkpoint folder brings `tokenizer.json` (and `tokenizer_config.json`'s `chat_template`);
//! a GGUF file brings them in its metadata — a gpt2 byte-level BPE (`tokenizer.ggml.tokens`,
//! `merges`, `token_type`, the pre-tokenizer named by `tokenizer.ggml.pre`) and
//! `tokenizer.chat_template`. Templates render with minijinja, given `messages`,
//! `add_generation_prompt`, `bos_token` and `eos_token` as Hugging Face renders them, within a
//! budget of work ([`RENDER_FUEL`]); `kvflow serve` renders one small conversation at startup
//! ([`TextModel::check_chat_template`]) so a broken template refuses the server, not every chat.
//! Trace replay needs none of this (its prompts are token ids).

use kvflow_kernels::checkpoint::gguf::{GgufFile, GgufValue};
use serde::Serialize;
use std::path::{Path, PathBuf};
use thiserror::Error;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, ModelWrapper, SplitDelimiterBehavior, Tokenizer};

/// The work one chat render may do, in minijinja's fuel: about one fuel per instruction and per
/// 64 bytes of data made or read. Hugging Face templates take a few dozen instructions a message,
/// so this serves tens of thousands of messages and a few megabytes of text, while a template
/// that loops without bound fails in well under a second instead of holding a thread for good.
pub const RENDER_FUEL: u64 = 1_000_000;

/// Why a model's text side could not be loaded or used.
#[derive(Debug, Error)]
pub enum TextError {
    #[error("{path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{path}: field `{field}`: {message}")]
    Field { path: PathBuf, field: String, message: String },
    #[error("tokenizing: {0}")]
    Tokenize(String),
    #[error("chat template: {0}")]
    Template(String),
}

/// One message of a chat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A model's tokenizer, chat template and special tokens.
pub struct TextModel {
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    bos: Option<(u32, String)>,
    eos: Option<(u32, String)>,
    /// Whether a prompt starts with BOS (`tokenizer.ggml.add_bos_token`).
    add_bos: bool,
    /// The most bytes of text one token stands for, when the vocabulary bounds it
    /// ([`max_token_bytes`]).
    max_token_bytes: Option<usize>,
}

/// A chat template and where it came from (named when it fails).
struct ChatTemplate {
    source: String,
    origin: String,
}

/// The GGUF pre-tokenizers kvflow knows (`tokenizer.ggml.pre`).
const PRE_TOKENIZERS: &str = "llama-bpe, qwen2, smollm, gpt2, default";

/// Llama 3's split (`llama-bpe`): contractions, letters with one leading non-letter, digits in
/// runs of up to three, punctuation runs, line breaks, spaces.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's split (`qwen2`): Llama 3's with every digit alone.
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl TextModel {
    /// The text side of the model at `path`: a GGUF file, or a checkpoint folder holding
    /// `tokenizer.json`.
    pub fn load(path: &Path) -> Result<TextModel, TextError> {
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            let file =
                GgufFile::open(path).map_err(|e| TextError::Load { path: path.into(), message: e.to_string() })?;
            return TextModel::from_gguf(&file);
        }
        TextModel::from_checkpoint(path)
    }

    /// A checkpoint folder's `tokenizer.json`, and `tokenizer_config.json` when present (its
    /// `chat_template`, `bos_token`, `eos_token`).
    pub fn from_checkpoint(dir: &Path) -> Result<TextModel, TextError> {
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Err(TextError::Load {
                path: dir.into(),
                message: "no tokenizer.json: serving text needs the checkpoint's tokenizer (or a GGUF file)".into(),
            });
        }
        let tokenizer =
            Tokenizer::from_file(&file).map_err(|e| TextError::Load { path: file.clone(), message: e.to_string() })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| TextError::Load { path: config_path.clone(), message: format!("not JSON: {e}") })?,
            Err(_) => serde_json::Value::Null,
        };
        let special = |key: &str| -> Option<(u32, String)> {
            let v = config.get(key)?;
            let text = v.as_str().or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            Some((tokenizer.token_to_id(text)?, text.to_string()))
        };
        let (bos, eos) = (special("bos_token"), special("eos_token"));
        let add_bos = config.get("add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
        let chat_template = config.get("chat_template").and_then(|v| v.as_str()).map(|source| ChatTemplate {
            source: source.to_string(),
            origin: format!("{}: field `chat_template`", config_path.display()),
        });
        let max_token_bytes = max_token_bytes(&tokenizer);
        Ok(TextModel { tokenizer, chat_template, bos, eos, add_bos, max_token_bytes })
    }

    /// A GGUF file's tokenizer (a gpt2 byte-level BPE) and chat template.
    pub fn from_gguf(f: &GgufFile) -> Result<TextModel, TextError> {
        let field = |key: &str, message: String| TextError::Field { path: f.path.clone(), field: key.into(), message };
        let load =
            |e: kvflow_kernels::checkpoint::LoadError| TextError::Load { path: f.path.clone(), message: e.to_string() };
        match f.get("tokenizer.ggml.model").and_then(GgufValue::as_str) {
            Some("gpt2") => {}
            Some(other) => {
                return Err(field(
                    "tokenizer.ggml.model",
                    format!("{other:?}: kvflow reads gpt2 (byte-level BPE) tokenizers"),
                ))
            }
            None => return Err(field("tokenizer.ggml.model", "missing: the file carries no tokenizer".into())),
        }
        let tokens = f.strings("tokenizer.ggml.tokens").map_err(load)?;
        let merges = f.strings("tokenizer.ggml.merges").map_err(load)?;
        let types: Vec<u64> = match f.get("tokenizer.ggml.token_type").and_then(GgufValue::as_array) {
            Some(items) => items.iter().map(|t| t.as_u64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
        let mut pairs = Vec::with_capacity(merges.len());
        for (i, m) in merges.iter().enumerate() {
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| field("tokenizer.ggml.merges", format!("item {i} ({m:?}) is not two tokens")))?;
            pairs.push((a.to_string(), b.to_string()));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, pairs)
            .build()
            .map_err(|e| field("tokenizer.ggml.merges", e.to_string()))?;
        let mut tokenizer = Tokenizer::new(bpe);
        let pre = f.get("tokenizer.ggml.pre").and_then(GgufValue::as_str).unwrap_or("default");
        let byte_level = ByteLevel::new(false, true, true);
        match pre {
            "smollm" => {
                let steps = vec![Digits::new(true).into(), byte_level.into()];
                tokenizer.with_pre_tokenizer(Some(Sequence::new(steps)));
            }
            "gpt2" | "default" => {
                tokenizer.with_pre_tokenizer(Some(byte_level));
            }
            "llama-bpe" | "qwen2" => {
                // as Llama 3's and Qwen 2's tokenizer.json: the pattern splits, then bytes map to
                // symbols without a pattern of their own; Qwen 2 composes (NFC) first
                let pattern = if pre == "qwen2" { QWEN2_SPLIT } else { LLAMA3_SPLIT };
                let split = Split::new(SplitPattern::Regex(pattern.into()), SplitDelimiterBehavior::Isolated, false)
                    .map_err(|e| field("tokenizer.ggml.pre", format!("{pre:?}: {e}")))?;
                let steps = vec![split.into(), ByteLevel::new(false, pre == "llama-bpe", false).into()];
                tokenizer.with_pre_tokenizer(Some(Sequence::new(steps)));
                if pre == "qwen2" {
                    tokenizer
                        .with_normalizer(Some(NFC))
                        .map_err(|e| field("tokenizer.ggml.pre", format!("{pre:?}: {e}")))?;
                }
            }
            other => {
                return Err(field(
                    "tokenizer.ggml.pre",
                    format!("{other:?} is not a pre-tokenizer kvflow knows ({PRE_TOKENIZERS})"),
                ))
            }
        }
        tokenizer.with_decoder(Some(ByteLevel::default()));
        // Control tokens (type 3) are special: matched whole, never split, dropped when decoding
        // with skip_special; user-defined ones (type 4) are matched whole.
        let of_type = |ty: u64, special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(&types)
                .filter(|(_, &t)| t == ty)
                .map(|(tok, _)| AddedToken::from(tok.to_string(), special))
                .collect()
        };
        tokenizer
            .add_special_tokens(of_type(3, true))
            .map_err(|e| field("tokenizer.ggml.token_type", e.to_string()))?;
        tokenizer.add_tokens(of_type(4, false)).map_err(|e| field("tokenizer.ggml.token_type", e.to_string()))?;
        let special = |key: &str| -> Result<Option<(u32, String)>, TextError> {
            let Some(v) = f.get(key) else { return Ok(None) };
            let id = v.as_u64().ok_or_else(|| field(key, format!("expected a token id, found {}", v.kind())))?;
            let text = tokens.get(id as usize).ok_or_else(|| {
                field(key, format!("token id {id} is outside the vocabulary of {} tokens", tokens.len()))
            })?;
            Ok(Some((id as u32, text.to_string())))
        };
        let chat_template = f.get("tokenizer.chat_template").and_then(GgufValue::as_str).map(|source| ChatTemplate {
            source: source.to_string(),
            origin: format!("{}: key `tokenizer.chat_template`", f.path.display()),
        });
        let add_bos = f.get("tokenizer.ggml.add_bos_token").and_then(GgufValue::as_bool).unwrap_or(false);
        Ok(TextModel {
            max_token_bytes: max_token_bytes(&tokenizer),
            tokenizer,
            chat_template,
            bos: special("tokenizer.ggml.bos_token_id")?,
            eos: special("tokenizer.ggml.eos_token_id")?,
            add_bos,
        })
    }

    /// The token ids of `text` (with BOS first when the model asks for it). Special tokens
    /// written in the text are matched as themselves.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let encoding = self.tokenizer.encode(text, false).map_err(|e| TextError::Tokenize(e.to_string()))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if let (true, Some((bos, _))) = (self.add_bos, &self.bos) {
            ids.push(*bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        self.tokenizer.decode(ids, true).map_err(|e| TextError::Tokenize(e.to_string()))
    }

    /// End of sequence: a served request stops when it samples it.
    pub fn eos(&self) -> Option<u32> {
        self.eos.as_ref().map(|(id, _)| *id)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// The most bytes of text a prompt may have: a longer one has more than `max_context` tokens
    /// (each token stands for at most [`max_token_bytes`] bytes), so it is refused before it is
    /// tokenized. `None` when the vocabulary gives no such bound.
    pub fn max_prompt_bytes(&self, max_context: usize) -> Option<usize> {
        self.max_token_bytes.map(|bytes| bytes.saturating_mul(max_context))
    }

    /// The longest text one token stands for, in bytes (see [`max_token_bytes`]).
    pub fn max_token_bytes(&self) -> Option<usize> {
        self.max_token_bytes
    }

    /// Uses `source` as the chat template (`kvflow serve --chat-template`), `origin` naming it.
    pub fn set_chat_template(&mut self, source: String, origin: String) {
        self.chat_template = Some(ChatTemplate { source, origin });
    }

    /// Renders one small conversation, so a template that does not parse, or fails or runs out
    /// of its budget on an ordinary chat, is an error at startup naming where it came from.
    pub fn check_chat_template(&self) -> Result<(), TextError> {
        let Some(template) = &self.chat_template else { return Ok(()) };
        let chat = [("user", "Hello."), ("assistant", "Hello! How can I help?"), ("user", "Say hi.")];
        let messages: Vec<ChatMessage> = chat
            .iter()
            .map(|(role, content)| ChatMessage { role: role.to_string(), content: content.to_string() })
            .collect();
        self.render_chat(&messages, true)
            .map(|_| ())
            .map_err(|e| TextError::Template(format!("{}: it fails on a three-message chat: {e}", template.origin)))
    }

    /// The prompt text of a chat, as the model's template renders it (with the assistant's turn
    /// opened when `add_generation_prompt`), within [`RENDER_FUEL`].
    pub fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TextError> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| TextError::Template("the model has no chat template (use completions)".into()))?;
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(RENDER_FUEL));
        env.add_function("raise_exception", |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
        });
        env.add_template("chat", &template.source).map_err(|e| TextError::Template(e.to_string()))?;
        let compiled = env.get_template("chat").map_err(|e| TextError::Template(e.to_string()))?;
        let token = |t: &Option<(u32, String)>| t.as_ref().map(|(_, s)| s.clone()).unwrap_or_default();
        compiled
            .render(minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => token(&self.bos),
                eos_token => token(&self.eos),
            })
            .map_err(|e| match e.kind() {
                minijinja::ErrorKind::OutOfFuel => TextError::Template(format!(
                    "rendering these messages took more than the template's budget of {RENDER_FUEL} fuel (minijinja: \
                     about one instruction or 64 bytes each): a template that loops without bound, or too many \
                     messages"
                )),
                _ => TextError::Template(e.to_string()),
            })
    }

    /// The tokenizer as a Hugging Face `tokenizer.json` (to serve the same model from a folder).
    pub fn save_tokenizer_json(&self, path: &Path) -> Result<(), TextError> {
        self.tokenizer.save(path, false).map_err(|e| TextError::Load { path: path.into(), message: e.to_string() })
    }
}

/// The most bytes of text one token of `tokenizer` stands for, when that is bounded: then a text
/// of `n` bytes has at least `n / max` tokens, so a prompt can be refused by its length in bytes
/// before the work of tokenizing it.
///
/// Each token's string is at least as long in UTF-8 as the text it matches: a byte-level BPE
/// (gpt2, every GGUF kvflow reads) spells each byte of text as one character of one or two bytes;
/// a SentencePiece-style `▁` (three bytes) stands for one space, a byte-fallback `<0x41>` for one
/// byte, a WordPiece `##ab` for two; added tokens match their own text. The bound fails only when
/// text shrinks before it is matched (a normalizer: NFKC, lowercasing, dropping control
/// characters) or when one unknown token stands for a run of text of any length (an `unk` token
/// of BPE without byte fallback, WordPiece, WordLevel, Unigram): then there is none, and such a
/// prompt is tokenized whole (off the server's async workers) before its length is checked.
fn max_token_bytes(tokenizer: &Tokenizer) -> Option<usize> {
    if tokenizer.get_normalizer().is_some() {
        return None;
    }
    match tokenizer.get_model() {
        ModelWrapper::BPE(bpe) if bpe.unk_token.is_none() || bpe.byte_fallback => {}
        _ => return None,
    }
    tokenizer.get_vocab(true).keys().map(String::len).max()
}
