//! `kvflow generate`: generation (greedy, or seeded sampling) for a list of prompts, all run together as one
//! continuous batch (prefill in chunks, decodes batched), on one CPU executor with no pools, no
//! prefix cache and no transfer. This is also the reference path of `--verify`.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use kvflow_kernels::cpu::sampling::{RequestSampling, Sampler};
use kvflow_kernels::hash;
use kvflow_kernels::kv::{block_pool, BlockPool, BlockTable, SlotId};
use kvflow_kernels::models::{available_memory, human_bytes, LogitsWanted, Model, ModelCache, SeqInput};
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
    /// How tokens are picked (greedy by default); prompt i's draws are keyed on request id
    /// `first_request_id + i`, so `--verify` reproduces a run's seeded sampling.
    pub sampling: RequestSampling,
    pub first_request_id: u64,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 16,
            chunk_tokens: 64,
            decode_logits: 0,
            block_size: 16,
            show_progress: false,
            sampling: RequestSampling::default(),
            first_request_id: 0,
        }
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
    /// Why this prompt has no (complete) output: refused at admission (it does not fit the
    /// model's context), or its logits became non-finite (no token is sampled from those).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Generation {
    fn empty(decode_logits: usize) -> Self {
        Generation {
            tokens: Vec::new(),
            last_logits: Vec::new(),
            decode_logits: (decode_logits > 0).then(Vec::new),
            logits_hash: kvflow_kernels::hash::EMPTY,
            error: None,
        }
    }
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
    sampler: Sampler,
    out: Generation,
}

impl Running {
    fn done(&self, n: usize) -> bool {
        self.out.error.is_some() || (self.out.tokens.len() >= n && self.fed >= self.prompt.len())
    }

    /// This step's input for the sequence, feeding `toks`: logits are wanted when they end the
    /// prompt or decode.
    fn input<'a>(&'a self, toks: &'a [u32]) -> SeqInput<'a> {
        let start = if self.fed < self.prompt.len() { self.fed } else { self.prompt.len() + self.out.tokens.len() - 1 };
        let ends_prompt = self.fed < self.prompt.len() && start + toks.len() == self.prompt.len();
        let decoding = self.fed >= self.prompt.len();
        SeqInput {
            tokens: toks,
            start_pos: start,
            block_table: self.blocks.blocks(),
            slot: self.slot,
            prompt_len: self.prompt.len(),
            logits: if ends_prompt || decoding { LogitsWanted::Last } else { LogitsWanted::None },
        }
    }

    /// Picks the next token from `logits`, or fails the prompt when they are not all finite.
    fn sample(&mut self, index: usize, logits: &[f32]) {
        match self.sampler.pick(logits, self.prompt.len() + self.out.tokens.len()) {
            Some(token) => {
                self.out.logits_hash = hash::chain_row(self.out.logits_hash, hash::logits_row(logits));
                self.out.tokens.push(token);
            }
            None => {
                let position = self.prompt.len() + self.out.tokens.len() - 1;
                self.out.error = Some(format!(
                    "prompt {index}: the logits at position {position} hold NaN or infinite values (the model's \
                     weights or config give non-finite numbers); no token was sampled"
                ));
            }
        }
    }
}

/// Generates `max_new_tokens` greedy tokens for every prompt, in input order. A prompt that does
/// not fit the model's context is refused (its generation carries the error, the others run).
pub fn generate(model: &Model, prompts: &[Vec<u32>], opts: &GenerateOptions) -> Result<Vec<Generation>> {
    check_inputs(model, prompts, opts)?;
    let (n, bs) = (opts.max_new_tokens, opts.block_size);
    let refused: Vec<Option<String>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| model.check_context(p.len(), n).err().map(|e| format!("prompt {i}: {e}")))
        .collect();
    let admitted = || prompts.iter().zip(&refused).filter(|(_, r)| r.is_none()).map(|(p, _)| p);
    let needed: usize =
        if model.needs_blocks() { admitted().map(|p| p.len().saturating_add(n).div_ceil(bs)).sum() } else { 0 };
    let slots = if model.needs_slots() { prompts.len() } else { 0 };
    check_memory(model, needed, slots, opts)?;
    let mut pool = block_pool(needed);
    let mut cache = model.new_cache(bs, needed, slots, 0);
    let mut seqs = admit(model, prompts, &refused, opts, &mut pool)?;
    let bar = progress_bar(prompts, opts);
    while step(model, &mut cache, &mut seqs, opts) {
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

/// Refuses options and prompts no generation can run: a zero chunk or block size, an empty
/// prompt, a token outside the vocabulary.
fn check_inputs(model: &Model, prompts: &[Vec<u32>], opts: &GenerateOptions) -> Result<()> {
    if opts.chunk_tokens == 0 {
        bail!("--chunk-tokens must be at least 1");
    }
    if opts.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            bail!("prompt {i} is empty");
        }
        model.check_tokens(p).map_err(|e| anyhow::anyhow!("prompt {i}: {e}"))?;
    }
    Ok(())
}

/// Refuses a cache of `blocks` KV blocks and `slots` state slots larger than the memory this
/// machine has available.
fn check_memory(model: &Model, blocks: usize, slots: usize, opts: &GenerateOptions) -> Result<()> {
    let (n, bs) = (opts.max_new_tokens, opts.block_size);
    let bytes = (blocks as u128) * model.kv_bytes_per_block(bs) as u128
        + (slots as u128) * model.state_bytes_per_slot() as u128;
    if let Some(available) = available_memory() {
        if bytes > available {
            bail!(
                "the KV cache for these prompts with --max-new-tokens {n} (--block-size {bs}) takes {}, more than \
                 the {} this machine has available; lower --max-new-tokens or give fewer prompts",
                human_bytes(bytes),
                human_bytes(available)
            );
        }
    }
    Ok(())
}

/// A running sequence per prompt, in order: an admitted one holds blocks for its whole prompt
/// and output, a refused one carries its error and nothing else.
fn admit(
    model: &Model,
    prompts: &[Vec<u32>],
    refused: &[Option<String>],
    opts: &GenerateOptions,
    pool: &mut BlockPool,
) -> Result<Vec<Running>> {
    prompts
        .iter()
        .zip(refused)
        .enumerate()
        .map(|(i, (p, refused))| -> Result<Running> {
            let mut blocks = BlockTable::new();
            let mut out = Generation::empty(opts.decode_logits);
            out.error = refused.clone();
            if model.needs_blocks() && refused.is_none() {
                blocks.grow_to(p.len() + opts.max_new_tokens, opts.block_size, pool, i as u64)?;
            }
            // Prompt i owns slot i; a new store holds the zero state.
            let slot = model.needs_slots().then_some(i as SlotId);
            let sampler = Sampler::new(opts.sampling, opts.first_request_id + i as u64);
            Ok(Running { prompt: p.clone(), fed: 0, blocks, slot, sampler, out })
        })
        .collect()
}

/// A bar of the steps the longest prompt takes (hidden unless `show_progress`).
fn progress_bar(prompts: &[Vec<u32>], opts: &GenerateOptions) -> ProgressBar {
    let n = opts.max_new_tokens;
    let total_steps =
        prompts.iter().map(|p| p.len().div_ceil(opts.chunk_tokens) + n.saturating_sub(1)).max().unwrap_or(0);
    let bar = if opts.show_progress { ProgressBar::new(total_steps as u64) } else { ProgressBar::hidden() };
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} steps {elapsed}").expect("valid template"));
    bar
}

/// One step of the continuous batch: each unfinished sequence feeds a prefill chunk or its last
/// token, and samples when its prompt is done. False when every sequence was done already.
fn step(model: &Model, cache: &mut ModelCache, seqs: &mut [Running], opts: &GenerateOptions) -> bool {
    let n = opts.max_new_tokens;
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
        return false;
    }
    let batch: Vec<SeqInput> = members.iter().zip(&fed_tokens).map(|(&i, toks)| seqs[i].input(toks)).collect();
    let out = model.forward(&batch, cache);
    for (b, &i) in members.iter().enumerate() {
        let s = &mut seqs[i];
        let fed = fed_tokens[b].len();
        if s.fed < s.prompt.len() {
            s.fed += fed;
            if s.fed == s.prompt.len() {
                let logits = out.last(b).expect("asked for logits");
                s.out.last_logits = logits.to_vec();
                if n > 0 {
                    s.sample(i, logits);
                } else if !logits.iter().all(|v| v.is_finite()) {
                    s.out.error = Some(format!("prompt {i}: the last prompt logits hold NaN or infinite values"));
                }
            }
        } else {
            let logits = out.last(b).expect("asked for logits");
            if let Some(kept) = &mut s.out.decode_logits {
                if kept.len() < opts.decode_logits {
                    kept.push(logits.to_vec());
                }
            }
            s.sample(i, logits);
        }
    }
    true
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
