//! A request's own small types, named by its sequence on a rank (`policy::sequence`), by the
//! records between operators (`messages`) and by the transfer engine (`transfer`): how its tokens
//! go out ([`Delivery`]), when they became known ([`TokenTimes`]), where a remote prefill's
//! handoff goes back to ([`BackTo`]) and which transfer moves it ([`TransferId`]). It imports
//! nothing of the crate, so the scheduling policy can hold them without reaching the transfer
//! engine or the wire messages (the layering `tools/structure.py` checks).

use serde::{Deserialize, Serialize};

/// What a served request asks beyond its tokens: the tokens that end it before
/// `max_output_tokens` (its model's end-of-sequence ids; trace replay keeps none, as
/// `ignore_eos`), and whether its tokens stream out as its steps complete (`messages::Event::Tokens`)
/// rather than only with its end.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    pub stop_tokens: Vec<u32>,
    pub stream: bool,
}

impl Delivery {
    /// The most stop tokens a request may name (the handoff wire carries them).
    pub const MAX_STOP_TOKENS: usize = 64;

    /// Whether `token` ends the request.
    pub fn stops_at(&self, token: u32) -> bool {
        self.stop_tokens.contains(&token)
    }
}

/// Where a remote prefill's handoff goes back to: the decode pool (its index among the prefill
/// pool's links) and the rank that asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackTo {
    pub link: u16,
    pub rank: u32,
    /// Leading prompt tokens that rank already holds (whole blocks of its own): not sent
    /// (decode-side prefix reuse; a producer of smaller blocks skips the ones they cover).
    pub skip_tokens: u32,
}

/// When a request's output tokens became known (`wall_ms`): the first and the last (TTFT, TPOT
/// and end-to-end latency follow from them and the token count).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenTimes {
    pub first: Option<f64>,
    /// The second token: the first one decoded from T0 (the end of the TTFT split).
    #[serde(default)]
    pub second: Option<f64>,
    pub last: Option<f64>,
}

impl TokenTimes {
    /// A token became known at `now`.
    pub fn record(&mut self, now: f64) {
        if self.first.is_some() && self.second.is_none() {
            self.second = Some(now);
        }
        self.first.get_or_insert(now);
        self.last = Some(now);
    }
}

/// Names one transfer: a nonce unique per producer, and the generation of the request it moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransferId {
    pub nonce: u64,
    pub generation: u32,
}
