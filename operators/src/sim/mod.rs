//! Simulation (issue 44): what a step costs without running it — the analytic roofline over a
//! model's shape and a machine (`roofline.rs`) and a table of measured steps with interpolation
//! between its points (`table.rs`) — and the virtual clock a simulated run keeps (`clock.rs`).
//! The `sim` executor (`crate::executor`) prices its steps with them; the run's stepper
//! (`src/runtime/simulated.rs` of the kvflow crate) moves the clock.

pub mod clock;
pub mod roofline;
pub mod table;

/// What a step computes, as far as its cost depends on it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    /// Prompt tokens computed, over how many rows.
    pub prefill_tokens: usize,
    pub prefill_rows: usize,
    /// Rows decoding one token each.
    pub decode_rows: usize,
    /// KV positions the step reads, summed over its rows (each row's context at its end).
    pub context_positions: usize,
    /// Positions attended, summed over the step's tokens (each token's own context).
    pub attended_positions: usize,
}

impl StepShape {
    /// `rows` decodes whose contexts sum to `context` positions.
    pub fn decode(rows: usize, context: usize) -> Self {
        StepShape { decode_rows: rows, context_positions: context, attended_positions: context, ..Default::default() }
    }

    /// One prompt chunk of `tokens` tokens ending at position `end`.
    pub fn prefill(tokens: usize, end: usize) -> Self {
        let start = end.saturating_sub(tokens);
        let attended = (end * (end + 1) - start * (start + 1)) / 2;
        StepShape {
            prefill_tokens: tokens,
            prefill_rows: usize::from(tokens > 0),
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
