//! Drafters for speculative decoding (DESIGN §10): what a sequence's next tokens probably are.
//! `propose(t)` asks for up to `draft_tokens` after a sequence's last token once it is applied —
//! prompt lookup runs there, on the tokens the rank holds; the MTP drafter's drafts were made by
//! the executor after the step that sampled the last token, and are handed over here. The
//! scheduler books as many as the request's width allows, the target model checks every booked
//! token in one forward, and `verify(t)` keeps what it agrees with: greedy verification keeps
//! exactly the tokens plain decoding would give.

/// The drafter a pool runs: prompt lookup, or the checkpoint's MTP layer — which runs in the
/// executor, after the target's forward, on the hidden state of each token it fed, and hands the
/// drafts for the next step back with the sampled token (`Sampled::drafts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drafter {
    Ngram(NgramDrafter),
    Mtp,
}

impl Drafter {
    /// Up to `k` drafts after `tokens` into `out` (emptied first): prompt lookup over `tokens`, or
    /// the first `k` of `from_model`, what the MTP pass proposed when the last token was sampled.
    pub fn propose(&self, tokens: &[u32], from_model: &[u32], k: usize, out: &mut Vec<u32>) {
        match self {
            Drafter::Ngram(n) => n.propose(tokens, k, out),
            Drafter::Mtp => {
                out.clear();
                out.extend(from_model.iter().take(k));
            }
        }
    }

    /// Whether it runs in the executor (the MTP layer), which then needs to be told.
    pub fn runs_in_executor(&self) -> bool {
        matches!(self, Drafter::Mtp)
    }
}

/// Prompt lookup: find the most recent earlier occurrence of the sequence's last `n` tokens
/// (the longest `n` from `max_n` down to `min_n` that occurs) and propose the `k` tokens that
/// followed it. Needs no model: a request that repeats itself (code, retrieval, multi-turn
/// prompts) drafts well.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramDrafter {
    pub min_n: usize,
    pub max_n: usize,
}

impl NgramDrafter {
    /// Up to `k` proposed successors of `tokens`, written into `out` (emptied first).
    pub fn propose(&self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        out.clear();
        if k == 0 {
            return;
        }
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if n >= tokens.len() {
                continue;
            }
            let suffix = &tokens[tokens.len() - n..];
            // The most recent earlier match, its successors inside `tokens`.
            let found = (0..tokens.len() - n).rev().find(|&at| &tokens[at..at + n] == suffix);
            if let Some(at) = found {
                // What followed the match, running on into the proposal itself where the match
                // is recent (a loop of period p proposes the loop again, not p tokens only).
                let from = at + n;
                for j in from..from + k {
                    let next = if j < tokens.len() { tokens[j] } else { out[j - tokens.len()] };
                    out.push(next);
                }
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_recent_suffix_match_proposes_what_followed_it() {
        let d = NgramDrafter { min_n: 1, max_n: 3 };
        let mut out = Vec::new();
        // "7 8 9" occurred earlier, followed by 1 2 3; "9" alone also occurred later, followed by 5.
        d.propose(&[7, 8, 9, 1, 2, 3, 9, 5, 7, 8, 9], 4, &mut out);
        assert_eq!(out, vec![1, 2, 3, 9], "the 3-gram wins over the more recent 1-gram");
        d.propose(&[4, 9, 5, 6, 1, 9], 4, &mut out);
        assert_eq!(out, vec![5, 6, 1, 9], "only a 1-gram matches: what followed its last occurrence");
        d.propose(&[4, 9, 5, 6, 1, 9], 6, &mut out);
        assert_eq!(out, vec![5, 6, 1, 9, 5, 6], "then on into the proposal");
        d.propose(&[1, 2, 3, 4], 4, &mut out);
        assert!(out.is_empty(), "no repeat, no draft");
        d.propose(&[5, 5, 5, 5], 2, &mut out);
        assert_eq!(out, vec![5, 5], "a run proposes itself, k tokens");
        d.propose(&[8, 1, 2, 1, 2], 5, &mut out);
        assert_eq!(out, vec![1, 2, 1, 2, 1], "a loop goes on past the end of what is known");
        d.propose(&[3, 1, 2, 3], 0, &mut out);
        assert!(out.is_empty(), "width 0");
    }
}
