//! `kvflow generate`: greedy generation for a JSONL file of prompts, as one continuous batch on
//! one CPU executor (src/generate.rs), written as JSONL.

use anyhow::{Context, Result};
use kvflow::flags;
use kvflow::generate::{generate, read_prompts, write_jsonl, GenerateOptions};
use std::io::Write;
use std::path::PathBuf;

/// What `kvflow generate` takes.
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// Hugging Face checkpoint folder, a llama GGUF file (`.gguf`), or a TOML model spec (seeded random weights).
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL, one {"prompt": [token ids]} per line.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Greedy tokens per prompt (end-of-sequence does not stop generation; prompt plus
    /// output must fit the model's context).
    #[arg(long, value_parser = flags::count_or_zero)]
    pub max_new_tokens: usize,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 64, value_parser = flags::count)]
    pub chunk_tokens: usize,
    /// Also print the first K decode logits vectors (the logits that chose tokens[1..=K]).
    #[arg(long, default_value_t = 0, value_parser = flags::count_or_zero)]
    pub decode_logits: usize,
    /// Paged KV block size in tokens.
    #[arg(long, default_value_t = 16, value_parser = flags::count)]
    pub block_size: usize,
    /// Write the JSONL here instead of standard output.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// `kvflow generate`: 0, or 2 when a prompt has no output (its line carries "error").
pub fn run(args: GenerateArgs) -> Result<i32> {
    // The output file first: an unwritable --out is found before any work.
    let mut sink: Box<dyn Write> = match &args.out {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("--out: cannot create {}", path.display()))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    let model = kvflow_kernels::models::load(&args.model)
        .with_context(|| format!("cannot load model {}", args.model.display()))?;
    let prompts = read_prompts(&args.prompts, &model)?;
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        chunk_tokens: args.chunk_tokens,
        decode_logits: args.decode_logits,
        block_size: args.block_size,
        show_progress: true,
        ..Default::default()
    };
    let results = generate(&model, &prompts, &opts)?;
    write_jsonl(&mut sink, &results)?;
    let refused: Vec<&str> = results.iter().filter_map(|r| r.error.as_deref()).collect();
    if refused.is_empty() {
        return Ok(0);
    }
    for why in &refused {
        eprintln!("error: {why}");
    }
    eprintln!("{} of {} prompts have no output (their lines carry \"error\")", refused.len(), results.len());
    Ok(2)
}
