//! `kvflow generate`: greedy generation for a list of prompts, all run together as one
//! continuous batch (prefill in chunks, decodes batched), on one CPU executor with no pools, no
//! prefix cache and no transfer. This is also the reference path of `--verify`.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use kvflow_kernels::cpu::sampling::argmax;
use kvflow_kernels::hash;
use kvflow_kernels::kv::{block_pool, BlockTable, SlotId};
use kvflow_kernels::models::{LogitsWanted, Model, SeqInput};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::path::Path;

/// How `generate` runs.
#[derive(Clone, Copy, Debug)]
pub struct GenerateOptions {
    /// Greedy tokens per prompt (end-of-sequence does not stop).
    pub max_new_tokens: usize,
    /// Prefill chunk size.
    pub chunk_tokens: usize,
    /// Decode logits vectors kept per prompt (the logits that chose tokens[1..=K]).
    pub decode_logits: usize,
    pub block_size: usize,
    pub show_progress: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions { max_new_tokens: 16, chunk_tokens: 64, decode_logits: 0, block_size: 16, show_progress: false }
    }
}

/// One prompt's result.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub last_logits: Vec<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_logits: Option<Vec<Vec<f32>>>,
    /// Hash of the bit patterns of the logits at every sampled position, in order (what
    /// `--verify` compares; not printed).
    #[serde(skip)]
    pub logits_hash: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLine {
    prompt: Vec<u32>,
}

/// Reads a prompts JSONL file (`{"prompt": [token ids]}` per line), rejecting empty prompts and
/// tokens outside the model's vocabulary with the file and line named.
pub fn read_prompts(path: &Path, model: &Model) -> Result<Vec<Vec<u32>>> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot open prompts file {}", path.display()))?;
    let mut prompts = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}: cannot read", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed: PromptLine = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: expected {{\"prompt\": [token ids]}}", path.display(), i + 1))?;
        if parsed.prompt.is_empty() {
            bail!("{}:{}: the prompt is empty (at least one token is needed)", path.display(), i + 1);
        }
        if let Err(e) = model.check_tokens(&parsed.prompt) {
            bail!("{}:{}: {e}", path.display(), i + 1);
        }
        prompts.push(parsed.prompt);
    }
    if prompts.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(prompts)
}

struct Running {
    prompt: Vec<u32>,
    fed: usize,
    blocks: BlockTable,
    slot: Option<SlotId>,
    out: Generation,
}

impl Running {
    fn done(&self, n: usize) -> bool {
        self.out.tokens.len() >= n && self.fed >= self.prompt.len()
    }
}

/// Generates `max_new_tokens` greedy tokens for every prompt, in input order.
pub fn generate(model: &Model, prompts: &[Vec<u32>], opts: &GenerateOptions) -> Result<Vec<Generation>> {
    if opts.chunk_tokens == 0 {
        bail!("--chunk-tokens must be at least 1");
    }
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            bail!("prompt {i} is empty");
        }
        model.check_tokens(p).map_err(|e| anyhow::anyhow!("prompt {i}: {e}"))?;
    }
    let n = opts.max_new_tokens;
    let bs = opts.block_size;
    let needed: usize = if model.needs_blocks() { prompts.iter().map(|p| (p.len() + n).div_ceil(bs)).sum() } else { 0 };
    let slots = if model.needs_slots() { prompts.len() } else { 0 };
    let mut pool = block_pool(needed);
    let mut cache = model.new_cache(bs, needed, slots, 0);
    let mut seqs: Vec<Running> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| -> Result<Running> {
            let mut blocks = BlockTable::new();
            if model.needs_blocks() {
                blocks.grow_to(p.len() + n, bs, &mut pool, i as u64)?;
            }
            // Prompt i owns slot i; a new store holds the zero state.
            let slot = model.needs_slots().then_some(i as SlotId);
            Ok(Running {
                prompt: p.clone(),
                fed: 0,
                blocks,
                slot,
                out: Generation {
                    tokens: Vec::new(),
                    last_logits: Vec::new(),
                    decode_logits: (opts.decode_logits > 0).then(Vec::new),
                    logits_hash: kvflow_kernels::hash::EMPTY,
                },
            })
        })
        .collect::<Result<_>>()?;
    let total_steps =
        prompts.iter().map(|p| p.len().div_ceil(opts.chunk_tokens) + n.saturating_sub(1)).max().unwrap_or(0);
    let bar = if opts.show_progress { ProgressBar::new(total_steps as u64) } else { ProgressBar::hidden() };
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} steps {elapsed}").expect("valid template"));
    loop {
        // Each unfinished sequence contributes a prefill chunk or its last token.
        let mut fed_tokens: Vec<Vec<u32>> = Vec::new();
        let mut members = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if s.done(n) {
                continue;
            }
            if s.fed < s.prompt.len() {
                let end = (s.fed + opts.chunk_tokens).min(s.prompt.len());
                fed_tokens.push(s.prompt[s.fed..end].to_vec());
            } else {
                fed_tokens.push(vec![*s.out.tokens.last().expect("a decode follows a sampled token")]);
            }
            members.push(i);
        }
        if members.is_empty() {
            break;
        }
        let batch: Vec<SeqInput> = members
            .iter()
            .zip(&fed_tokens)
            .map(|(&i, toks)| {
                let s = &seqs[i];
                let start = if s.fed < s.prompt.len() { s.fed } else { s.prompt.len() + s.out.tokens.len() - 1 };
                let ends_prompt = s.fed < s.prompt.len() && start + toks.len() == s.prompt.len();
                let decoding = s.fed >= s.prompt.len();
                SeqInput {
                    tokens: toks,
                    start_pos: start,
                    block_table: s.blocks.blocks(),
                    slot: s.slot,
                    prompt_len: s.prompt.len(),
                    logits: if ends_prompt || decoding { LogitsWanted::Last } else { LogitsWanted::None },
                }
            })
            .collect();
        let out = model.forward(&batch, &mut cache);
        for (b, &i) in members.iter().enumerate() {
            let s = &mut seqs[i];
            let fed = fed_tokens[b].len();
            if s.fed < s.prompt.len() {
                s.fed += fed;
                if s.fed == s.prompt.len() {
                    let logits = out.last(b).expect("asked for logits");
                    s.out.last_logits = logits.to_vec();
                    if n > 0 {
                        s.out.logits_hash = hash::chain_row(s.out.logits_hash, hash::logits_row(logits));
                        s.out.tokens.push(argmax(logits));
                    }
                }
            } else {
                let logits = out.last(b).expect("asked for logits");
                if let Some(kept) = &mut s.out.decode_logits {
                    if kept.len() < opts.decode_logits {
                        kept.push(logits.to_vec());
                    }
                }
                s.out.logits_hash = hash::chain_row(s.out.logits_hash, hash::logits_row(logits));
                s.out.tokens.push(argmax(logits));
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let results = seqs
        .into_iter()
        .map(|mut s| {
            s.blocks.release_all(&mut pool);
            s.out
        })
        .collect();
    assert!(pool.all_free(), "generate leaked KV blocks");
    Ok(results)
}

/// Writes one JSON line per generation.
pub fn write_jsonl(out: &mut dyn Write, results: &[Generation]) -> Result<()> {
    for r in results {
        serde_json::to_writer(&mut *out, r)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}
