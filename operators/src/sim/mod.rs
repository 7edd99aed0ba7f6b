//! Simulation (issue 44): what a step costs without running it — the analytic roofline over a
//! model's shape and a machine (`roofline.rs`) and a table of measured steps with interpolation
//! between its points (`table.rs`) — and the virtual clock a simulated run keeps (`clock.rs`).
//! The `sim` executor (`crate::executor`) prices its steps with them; the run's stepper
//! (`src/runtime/simulated.rs` of the kvflow crate) moves the clock.

pub mod clock;
pub mod roofline;
pub mod table;

/// What a step computes, as far as its cost depends on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepShape {
    /// Prompt tokens computed, over how many rows.
    pub prefill_tokens: usize,
    pub prefill_rows: usize,
    /// Positions cached before each prompt token's chunk, summed over the prompt tokens (a
    /// chunk of `n` tokens from position `s` adds `n · s`).
    pub prefill_prefix_positions: usize,
    /// Rows decoding one token each, and the positions they read, summed over them.
    pub decode_rows: usize,
    pub decode_context_positions: usize,
    /// KV positions the step reads, summed over its rows (each row's context at its end).
    pub context_positions: usize,
    /// Positions attended, summed over the step's tokens (each token's own context).
    pub attended_positions: usize,
}

impl StepShape {
    /// The shape of a launched step: a row of one token at the prompt's end or beyond (no
    /// drafts) decodes, any other row computes prompt tokens.
    pub fn of(step: &crate::step::StepLaunch<'_>) -> Self {
        let mut shape = StepShape::default();
        for seq in step.seqs() {
            let (len, start) = (seq.len(), seq.start_pos);
            if len == 0 {
                continue;
            }
            let end = start + len;
            shape.context_positions += end;
            shape.attended_positions += (end * (end + 1) - start * (start + 1)) / 2;
            if len == 1 && start >= seq.prompt_len.saturating_sub(1) && seq.drafts.is_empty() {
                shape.decode_rows += 1;
                shape.decode_context_positions += end;
            } else {
                shape.prefill_tokens += len;
                shape.prefill_rows += 1;
                shape.prefill_prefix_positions += len * start;
            }
        }
        shape
    }

    /// `rows` decodes whose contexts sum to `context` positions.
    pub fn decode(rows: usize, context: usize) -> Self {
        StepShape {
            decode_rows: rows,
            decode_context_positions: context,
            context_positions: context,
            attended_positions: context,
            ..Default::default()
        }
    }

    /// One prompt chunk of `tokens` tokens ending at position `end`.
    pub fn prefill(tokens: usize, end: usize) -> Self {
        let start = end.saturating_sub(tokens);
        let attended = (end * (end + 1) - start * (start + 1)) / 2;
        StepShape {
            prefill_tokens: tokens,
            prefill_rows: usize::from(tokens > 0),
            prefill_prefix_positions: tokens * start,
            context_positions: end,
            attended_positions: attended,
            ..Default::default()
        }
    }

    /// Tokens the step computes.
    pub fn tokens(&self) -> usize {
        self.prefill_tokens + self.decode_rows
    }
}
