//! Stop strings on streamed text: text is released as soon as it can no longer be the start
//! of a stop string; at the first complete stop string, the text before it is released and
//! generation ends (the stop string itself is never sent).

/// Watches streamed text for a request's stop strings.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    /// The stop string that ended the generation.
    matched: Option<String>,
}

impl StopMatcher {
    /// A matcher for `stops` (none: every piece of text is released at once).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            pending: String::new(),
            matched: None,
        }
    }

    /// Whether a stop string has been seen.
    pub fn stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that ended the generation, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Adds `text` and returns what can be released now (nothing once stopped).
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped() {
            return String::new();
        }
        self.pending.push_str(text);
        if let Some((at, stop)) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at)
        {
            self.matched = Some(stop.clone());
            self.pending.truncate(at);
            return std::mem::take(&mut self.pending);
        }
        let hold = self
            .stops
            .iter()
            .map(|s| open_prefix(&self.pending, s))
            .max()
            .unwrap_or(0);
        let rest = self.pending.split_off(self.pending.len() - hold);
        std::mem::replace(&mut self.pending, rest)
    }

    /// Releases the text held back at the end of the generation.
    pub fn finish(&mut self) -> String {
        if self.stopped() {
            return String::new();
        }
        std::mem::take(&mut self.pending)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn open_prefix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .filter(|&k| stop.is_char_boundary(k))
        .find(|&k| text.ends_with(&stop[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            out.push_str(&m.push(p));
        }
        out.push_str(&m.finish());
        (out, m.stopped())
    }

    #[test]
    fn cuts_at_the_first_stop_string_across_pieces() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "Dxyz"]),
            ("abc ".into(), true)
        );
        assert_eq!(run(&["b", "a"], &["xxab"]), ("xx".into(), true));
        assert_eq!(run(&["zz"], &["abc", "z", "y"]), ("abczy".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn holds_back_only_a_possible_start() {
        let mut m = StopMatcher::new(vec!["<end>".into()]);
        assert_eq!(m.push("hello <e"), "hello ");
        assert_eq!(m.push("x"), "<ex");
        assert_eq!(m.push("é<"), "é");
        assert_eq!(m.finish(), "<");
    }
}
