//! Streaming detokenizers as mlx-lm 0.32.2 has them (`mlx_lm.tokenizer_utils`): the naive,
//! SentencePiece and byte-level BPE ones, picked from tokenizer.json's `decoder` section the way
//! mlx-lm picks them, so streamed output matches mlx-lm segment for segment.

use std::sync::OnceLock;

use serde_json::Value as Json;

use crate::engine::tokenizer::Tokenizer;

/// How mlx-lm detokenizes a stream for this tokenizer (chosen from the `decoder` section).
pub(crate) enum DetokKind {
    /// `NaiveStreamingDetokenizer`: re-decode the pending ids with the full tokenizer.
    Naive { clean_spaces: bool },
    /// `SPMStreamingDetokenizer`: token bytes with `▁` as space, byte-fallback tokens as bytes.
    Spm { trim_space: bool },
    /// `BPEStreamingDetokenizer`: GPT-2 byte-level token strings.
    Bpe,
}

impl DetokKind {
    /// Picks mlx-lm's streaming detokenizer from the raw `decoder` section of tokenizer.json.
    pub(crate) fn pick(tok: &Tokenizer, decoder: Option<&Json>) -> DetokKind {
        let spm_steps = serde_json::json!([
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]);
        let mut with_strip = spm_steps.clone();
        if let Json::Array(steps) = &mut with_strip {
            steps.push(serde_json::json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        let spm = serde_json::json!({"type": "Sequence", "decoders": with_strip});
        let spm_no_space = serde_json::json!({"type": "Sequence", "decoders": spm_steps});
        // mlx-lm builds a token map over the whole vocabulary up front; each token is looked up
        // when it is generated instead (the same strings, without ~50k allocations at start-up).
        match decoder {
            Some(d) if *d == spm || *d == spm_no_space => DetokKind::Spm {
                trim_space: *d == spm,
            },
            Some(d) if d.get("type").and_then(Json::as_str) == Some("ByteLevel") => DetokKind::Bpe,
            _ => {
                // mlx-lm probes whether decode drops the space before punctuation.
                let clean_spaces = tok
                    .encode("a ,b", false)
                    .and_then(|ids| tok.decode(&ids))
                    .map(|t| !t.contains(" ,"))
                    .unwrap_or(false);
                DetokKind::Naive { clean_spaces }
            }
        }
    }

    /// Name of the mlx-lm detokenizer class this kind streams like (for tests and logs).
    pub(crate) fn class_name(&self) -> &'static str {
        match self {
            DetokKind::Naive { .. } => "NaiveStreamingDetokenizer",
            DetokKind::Spm { .. } => "SPMStreamingDetokenizer",
            DetokKind::Bpe => "BPEStreamingDetokenizer",
        }
    }
}

/// GPT-2's byte-to-unicode table inverted: the byte a byte-level character stands for.
fn byte_decoder(c: char) -> Option<u8> {
    static TABLE: OnceLock<Vec<Option<u8>>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = vec![None; 512];
        let mut n = 0u32;
        for b in 0u32..256 {
            let printable = (0x21..=0x7e).contains(&b)
                || (0xa1..=0xac).contains(&b)
                || (0xae..=0xff).contains(&b);
            let ch = if printable {
                b
            } else {
                n += 1;
                255 + n
            };
            t[ch as usize] = Some(b as u8);
        }
        t
    });
    table.get(c as usize).copied().flatten()
}

/// SPM detokenizer token bytes: `<0xNN>` is that byte, anything else its UTF-8.
fn spm_token_bytes(t: &str) -> Vec<u8> {
    if t.starts_with("<0x") {
        let hex: String = t.chars().skip(3).take(2).collect();
        if let Ok(b) = u8::from_str_radix(&hex, 16) {
            return vec![b];
        }
    }
    t.as_bytes().to_vec()
}

/// Replaces every `▁` in a byte buffer by a space.
fn replace_sep(bytes: &[u8]) -> Vec<u8> {
    const SEP: &[u8] = "\u{2581}".as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i..].starts_with(SEP) {
            out.push(b' ');
            i += SEP.len();
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    out
}

/// Per-detokenizer pending state.
enum DetokState {
    Naive {
        current_tokens: Vec<u32>,
        current_text: String,
    },
    Spm {
        unflushed: Vec<u8>,
    },
    Bpe {
        unflushed: String,
    },
}

/// Turns generated ids into printable text one token at a time, exactly as mlx-lm's
/// detokenizer does, so streamed output matches mlx-lm segment for segment. Incomplete UTF-8
/// is held back until the character completes (or `finalize`).
pub struct StreamingDetokenizer<'a> {
    tok: &'a Tokenizer,
    tokens: Vec<u32>,
    /// Characters of `text + pending` already handed out by `last_segment` (Python offset).
    offset: usize,
    /// Text that will not change any more (append-only).
    text: String,
    text_chars: usize,
    state: DetokState,
}

impl<'a> StreamingDetokenizer<'a> {
    /// A fresh detokenizer for `tok`, of the kind mlx-lm would pick for it.
    pub fn new(tok: &'a Tokenizer) -> Self {
        let state = match tok.detok() {
            DetokKind::Naive { .. } => DetokState::Naive {
                current_tokens: Vec::new(),
                current_text: String::new(),
            },
            DetokKind::Spm { .. } => DetokState::Spm {
                unflushed: Vec::new(),
            },
            DetokKind::Bpe => DetokState::Bpe {
                unflushed: String::new(),
            },
        };
        StreamingDetokenizer {
            tok,
            tokens: Vec::new(),
            offset: 0,
            text: String::new(),
            text_chars: 0,
            state,
        }
    }

    /// Feeds one generated id.
    pub fn add_token(&mut self, id: u32) {
        self.tokens.push(id);
        match &mut self.state {
            DetokState::Naive { current_tokens, .. } => current_tokens.push(id),
            DetokState::Spm { unflushed } => {
                if let Some(t) = self.tok.id_to_token(id) {
                    unflushed.extend_from_slice(&spm_token_bytes(&t));
                }
                self.spm_flush(false);
            }
            DetokState::Bpe { unflushed } => {
                // mlx-lm's map has `None` (decoded as "") for unassigned ids and raises for ids
                // past the vocabulary; "!" stands in for the latter.
                let token = self.tok.id_to_token(id);
                let v = match &token {
                    Some(t) => t.as_str(),
                    None if (id as usize) < self.tok.vocab_len() => "",
                    None => "!",
                };
                unflushed.push_str(v);
                let text = bpe_decode_bytes(unflushed);
                let mut vc = v.chars();
                // A lone space waits for the next token (mlx-lm may need to trim it).
                let single_space = match (vc.next(), vc.next()) {
                    (Some(c), None) => byte_decoder(c) == Some(32),
                    _ => false,
                };
                if !text.ends_with('\u{FFFD}') && !single_space {
                    unflushed.clear();
                    let trimmed = self.maybe_trim_space(text);
                    self.push_text(&trimmed);
                }
            }
        }
    }

    /// New printable text since the previous call (mlx-lm's `last_segment`). Never ends in a
    /// partial character; text the tokenizer cannot decode at all comes out empty.
    pub fn last_segment(&mut self) -> String {
        self.refresh();
        let tail = self.tail();
        let tail_chars = tail.chars().count();
        let total = self.text_chars + tail_chars;
        let segment = if total > self.offset {
            let n = total - self.offset;
            if n <= tail_chars {
                tail.chars().skip(tail_chars - n).collect()
            } else {
                let k = n - tail_chars;
                let start = self
                    .text
                    .char_indices()
                    .rev()
                    .nth(k - 1)
                    .map_or(0, |(i, _)| i);
                format!("{}{}", &self.text[start..], tail)
            }
        } else {
            String::new()
        };
        self.offset = total;
        segment
    }

    /// Flushes text held back for more tokens; call after the last token.
    pub fn finalize(&mut self) {
        match &mut self.state {
            DetokState::Naive {
                current_tokens,
                current_text,
            } => {
                let ids = std::mem::take(current_tokens);
                current_text.clear();
                let text = self.tok.decode(&ids).unwrap_or_default();
                self.push_text(&text);
            }
            DetokState::Spm { .. } => {
                self.spm_flush(true);
                if let DetokState::Spm { unflushed } = &mut self.state {
                    unflushed.clear();
                }
            }
            DetokState::Bpe { unflushed } => {
                let mut bytes = Vec::with_capacity(unflushed.len());
                for c in unflushed.chars() {
                    match byte_decoder(c) {
                        Some(b) => bytes.push(b),
                        None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                unflushed.clear();
                let text = String::from_utf8_lossy(&bytes).into_owned();
                let trimmed = self.maybe_trim_space(text);
                self.push_text(&trimmed);
            }
        }
    }

    /// All text so far, including pending text mlx-lm would already show.
    pub fn text(&mut self) -> String {
        self.refresh();
        format!("{}{}", self.text, self.tail())
    }

    /// Every id added so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Drops all state so the detokenizer can serve a new request.
    pub fn reset(&mut self) {
        *self = self.tok.detokenizer();
    }

    fn tail(&self) -> &str {
        match &self.state {
            DetokState::Naive { current_text, .. } => current_text,
            _ => "",
        }
    }

    fn push_text(&mut self, s: &str) {
        self.text.push_str(s);
        self.text_chars += s.chars().count();
    }

    /// `_maybe_trim_space` of the BPE detokenizer: drop a leading space at the very start.
    fn maybe_trim_space(&self, text: String) -> String {
        if self.text.is_empty() {
            if let Some(rest) = text.strip_prefix(' ') {
                return rest.to_owned();
            }
        }
        text
    }

    /// The Naive detokenizer's `text` property: re-decode pending ids, hide a trailing
    /// replacement character (incomplete UTF-8), commit at newlines.
    fn refresh(&mut self) {
        let clean_spaces = matches!(self.tok.detok(), DetokKind::Naive { clean_spaces: true });
        let DetokState::Naive {
            current_tokens,
            current_text,
        } = &mut self.state
        else {
            return;
        };
        if !current_tokens.is_empty() {
            *current_text = self.tok.decode(current_tokens).unwrap_or_default();
            if current_text.ends_with('\u{FFFD}') {
                let keep = current_text.trim_end_matches('\u{FFFD}').len();
                current_text.truncate(keep);
            } else if clean_spaces && current_text.ends_with(' ') {
                current_text.pop();
            }
        }
        if current_text.ends_with('\n') {
            let committed = std::mem::take(current_text);
            current_tokens.clear();
            self.text.push_str(&committed);
            self.text_chars += committed.chars().count();
        }
    }

    /// `_try_flush` of the SPM detokenizer.
    fn spm_flush(&mut self, force: bool) {
        let trim_space = matches!(
            self.tok.detok(),
            DetokKind::Spm {
                trim_space: true,
                ..
            }
        );
        let DetokState::Spm { unflushed } = &mut self.state else {
            return;
        };
        let text = String::from_utf8_lossy(&replace_sep(unflushed)).into_owned();
        if !force && text.ends_with('\u{FFFD}') {
            return;
        }
        unflushed.clear();
        let text = match text.strip_prefix(' ') {
            Some(rest) if self.text.is_empty() && trim_space => rest.to_owned(),
            _ => text,
        };
        self.push_text(&text);
    }
}

/// `_decode_bytes` of the BPE detokenizer, including its quirk that byte 0 (falsy in
/// Python) is kept as the character's UTF-8.
fn bpe_decode_bytes(s: &str) -> String {
    let mut bytes = Vec::with_capacity(s.len());
    for c in s.chars() {
        match byte_decoder(c) {
            Some(b) if b != 0 => bytes.push(b),
            _ => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}
