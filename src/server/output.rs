//! One served request's output on its way to the client: its tokens put in order (a P/D
//! request's T0 comes from the prefill pool and the rest from the decode pool, on two paths),
//! turned into text piece by piece — a piece that ends inside a character, or could be the start
//! of a stop string, waits for the next token — and cut before a stop token or stop string.

use crate::text::TextModel;
use std::collections::BTreeMap;
use std::sync::Arc;

pub struct Output {
    text_model: Option<Arc<TextModel>>,
    stop_tokens: Vec<u32>,
    stop: Vec<String>,
    /// Output tokens received in order.
    ids: Vec<u32>,
    /// Tokens that came before those ahead of them, by offset.
    early: BTreeMap<usize, Vec<u32>>,
    sent_ids: usize,
    /// Bytes of text sent.
    sent_text: usize,
    /// A stop string was found: nothing after it is sent.
    pub stopped_by_string: bool,
}

impl Output {
    pub fn new(text_model: Option<Arc<TextModel>>, stop_tokens: Vec<u32>, stop: Vec<String>) -> Self {
        Output {
            text_model,
            stop_tokens,
            stop,
            ids: Vec::new(),
            early: BTreeMap::new(),
            sent_ids: 0,
            sent_text: 0,
            stopped_by_string: false,
        }
    }

    /// Output tokens `offset..` arrived.
    pub fn take(&mut self, offset: usize, tokens: Vec<u32>) {
        self.early.insert(offset, tokens);
        while let Some((&at, _)) = self.early.first_key_value() {
            if at > self.ids.len() {
                break;
            }
            let (at, tokens) = self.early.pop_first().expect("seen above");
            let skip = self.ids.len() - at;
            self.ids.extend(tokens.into_iter().skip(skip));
        }
    }

    /// Whether its last token is a stop token (the finish reason is then "stop").
    pub fn ended_on_stop_token(&self) -> bool {
        self.ids.last().is_some_and(|t| self.stop_tokens.contains(t))
    }

    /// The text of the tokens so far, cut before a stop token and a stop string.
    fn text(&mut self) -> String {
        let Some(model) = &self.text_model else { return String::new() };
        let visible = self.ids.iter().position(|t| self.stop_tokens.contains(t)).unwrap_or(self.ids.len());
        let mut text = model.decode(&self.ids[..visible]).unwrap_or_default();
        if let Some(cut) = self.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(cut);
            self.stopped_by_string = true;
        }
        text
    }

    /// What is new since the last piece: text (empty while it waits) and token ids.
    pub fn piece(&mut self) -> (String, Vec<u32>) {
        let ids = self.ids[self.sent_ids..].to_vec();
        self.sent_ids = self.ids.len();
        let text = self.text();
        let mut ready = text.len();
        if !self.stopped_by_string {
            if text.ends_with('\u{FFFD}') {
                ready = text.trim_end_matches('\u{FFFD}').len();
            }
            // Hold back what could be the start of a stop string.
            for s in &self.stop {
                for k in (1..s.len()).rev() {
                    if s.is_char_boundary(k) && text[..ready].ends_with(&s[..k]) {
                        ready -= k;
                        break;
                    }
                }
            }
        }
        (self.cut(&text, ready), ids)
    }

    /// The rest, given every output token of the request (its end).
    pub fn finish(&mut self, all: &[u32]) -> (String, Vec<u32>) {
        if all.len() > self.ids.len() {
            self.ids = all.to_vec();
        }
        let ids = self.ids[self.sent_ids.min(self.ids.len())..].to_vec();
        self.sent_ids = self.ids.len();
        let text = self.text();
        let len = text.len();
        (self.cut(&text, len), ids)
    }

    /// Every output token received so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn cut(&mut self, text: &str, ready: usize) -> String {
        if ready <= self.sent_text || !text.is_char_boundary(ready) || !text.is_char_boundary(self.sent_text) {
            return String::new();
        }
        let piece = text[self.sent_text..ready].to_string();
        self.sent_text = ready;
        piece
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_arriving_out_of_order_are_put_in_order() {
        let mut out = Output::new(None, vec![9], Vec::new());
        out.take(1, vec![5, 6]);
        assert!(out.ids().is_empty(), "T0 has not come");
        out.take(0, vec![4]);
        assert_eq!(out.ids(), [4, 5, 6]);
        out.take(2, vec![6, 9]);
        assert_eq!(out.ids(), [4, 5, 6, 9], "an overlap is taken once");
        assert!(out.ended_on_stop_token());
        assert_eq!(out.piece().1, [4, 5, 6, 9]);
        assert!(out.piece().1.is_empty());
    }
}
