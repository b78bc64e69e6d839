//! Splits streamed text into the reply's own text and the text of tool calls, as mlx-lm's
//! `TextStateMachine` does for the tool markers: the markers are cut out, and text that might
//! be the start of a marker is held back until the next piece decides it.

use super::ToolParser;

/// A piece of the reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Text outside tool calls.
    Text(String),
    /// The whole text between a start marker and its end marker (markers excluded).
    ToolCall(String),
}

/// The splitter's state over one reply.
#[derive(Debug, Clone)]
pub struct ToolSplitter {
    start: &'static str,
    end: &'static str,
    in_tool: bool,
    /// Text of the current tool call so far.
    call: String,
    /// Text that may be the beginning of the marker being looked for.
    held: String,
}

impl ToolSplitter {
    /// A splitter for `parser`'s markers, outside any call.
    pub fn new(parser: ToolParser) -> Self {
        Self {
            start: parser.start(),
            end: parser.end(),
            in_tool: false,
            call: String::new(),
            held: String::new(),
        }
    }

    /// Whether the text so far ends inside a tool call.
    pub fn in_tool(&self) -> bool {
        self.in_tool
    }

    /// Consumes the next piece of text; returns the reply text it settles and the calls it
    /// completes, in order.
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        let mut out = Vec::new();
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(text);
        let mut rest = buf.as_str();
        loop {
            let marker = if self.in_tool { self.end } else { self.start };
            if marker.is_empty() {
                // A format without an end marker: the call runs to the end of the reply.
                self.call.push_str(rest);
                break;
            }
            match rest.find(marker) {
                Some(at) => {
                    self.emit(&rest[..at], &mut out);
                    if self.in_tool {
                        out.push(Segment::ToolCall(std::mem::take(&mut self.call)));
                    }
                    self.in_tool = !self.in_tool;
                    rest = &rest[at + marker.len()..];
                }
                None => {
                    let keep = partial_marker_len(rest, marker);
                    self.emit(&rest[..rest.len() - keep], &mut out);
                    self.held = rest[rest.len() - keep..].to_owned();
                    break;
                }
            }
        }
        out
    }

    /// Ends the reply. `flush` (a reply cut by its token budget) keeps held-back text; a reply
    /// that stopped drops it, as mlx-lm does. An unfinished call is returned as a call.
    pub fn finish(&mut self, flush: bool) -> Vec<Segment> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        if flush {
            self.emit(&held, &mut out);
        }
        if self.in_tool && !self.call.is_empty() {
            out.push(Segment::ToolCall(std::mem::take(&mut self.call)));
        }
        out
    }

    fn emit(&mut self, text: &str, out: &mut Vec<Segment>) {
        if self.in_tool {
            self.call.push_str(text);
        } else if !text.is_empty() {
            match out.last_mut() {
                Some(Segment::Text(t)) => t.push_str(text),
                _ => out.push(Segment::Text(text.to_owned())),
            }
        }
    }
}

/// The length of the longest end of `text` that is a proper beginning of `marker`.
fn partial_marker_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && marker.is_char_boundary(n)
                && text.ends_with(&marker[..n])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pieces: &[&str], flush: bool) -> Vec<Segment> {
        let mut s = ToolSplitter::new(ToolParser::JsonTools);
        let mut out: Vec<Segment> = pieces.iter().flat_map(|p| s.push(p)).collect();
        out.extend(s.finish(flush));
        out
    }

    #[test]
    fn markers_split_across_pieces_are_found_and_cut() {
        let got = split(
            &["Sure.<tool", "_call>{\"a\"", ": 1}</tool_", "call>\ndone"],
            false,
        );
        assert_eq!(
            got,
            vec![
                Segment::Text("Sure.".into()),
                Segment::ToolCall("{\"a\": 1}".into()),
                Segment::Text("\ndone".into()),
            ]
        );
    }

    #[test]
    fn held_text_is_dropped_on_stop_and_kept_when_cut_by_length() {
        assert_eq!(split(&["a <tool"], false), vec![Segment::Text("a ".into())]);
        assert_eq!(
            split(&["a <tool"], true),
            vec![Segment::Text("a ".into()), Segment::Text("<tool".into())]
        );
        assert_eq!(
            split(&["<tool_call>{\"name\""], false),
            vec![Segment::ToolCall("{\"name\"".into())]
        );
    }

    #[test]
    fn a_format_without_an_end_marker_runs_to_the_end() {
        let mut s = ToolSplitter::new(ToolParser::Mistral);
        let mut out = s.push("hi [TOOL_CALLS]f[ARGS]{}");
        out.extend(s.finish(false));
        assert_eq!(
            out,
            vec![
                Segment::Text("hi ".into()),
                Segment::ToolCall("f[ARGS]{}".into())
            ]
        );
    }
}
