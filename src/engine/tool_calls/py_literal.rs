//! The two Python readers Qwen3-Coder's parser falls back on for object values:
//! `json.loads(text, strict=False)` (control characters allowed inside strings) and
//! `ast.literal_eval` for the literals a model writes (strings, numbers, `True`/`False`/`None`,
//! lists, tuples, dicts), as JSON values (tuples become arrays, as `json.dumps` writes them).

use super::{py_strip, ToolParseError};
use serde_json::{Map, Value};

/// `json.loads(text, strict=False)`.
pub(super) fn json_loads_lenient(text: &str) -> Result<Value, ToolParseError> {
    let mut escaped = String::with_capacity(text.len());
    let (mut in_string, mut backslash) = (false, false);
    for c in text.chars() {
        if in_string && (c as u32) < 0x20 {
            escaped.push_str(&format!("\\u{:04x}", c as u32));
            backslash = false;
            continue;
        }
        if in_string {
            if backslash {
                backslash = false;
            } else if c == '\\' {
                backslash = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        }
        escaped.push(c);
    }
    serde_json::from_str(&escaped).map_err(|e| ToolParseError::new(e.to_string()))
}

/// `ast.literal_eval(text)` for JSON-representable literals; anything else is an error.
pub(super) fn literal_eval(text: &str) -> Result<Value, ToolParseError> {
    let mut p = Parser {
        s: text.trim_start_matches([' ', '\t']).as_bytes(),
        i: 0,
    };
    let v = p.value()?;
    p.space();
    if p.i != p.s.len() {
        return Err(p.fail());
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn fail(&self) -> ToolParseError {
        ToolParseError::new("malformed node or string")
    }

    fn space(&mut self) {
        while self.i < self.s.len()
            && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r' | b'\x0c')
        {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.space();
        self.s.get(self.i).copied()
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Result<Value, ToolParseError> {
        match self.peek().ok_or_else(|| self.fail())? {
            b'[' => {
                self.i += 1;
                Ok(Value::Array(self.items(b']')?))
            }
            b'(' => {
                self.i += 1;
                // `(x)` is x; `(x,)` and `(x, y)` are tuples.
                let start = self.i;
                if self.eat(b')') {
                    return Ok(Value::Array(Vec::new()));
                }
                let first = self.value()?;
                if self.eat(b')') {
                    return Ok(first);
                }
                self.i = start;
                Ok(Value::Array(self.items(b')')?))
            }
            b'{' => {
                self.i += 1;
                self.dict()
            }
            b'\'' | b'"' => Ok(Value::String(self.string()?)),
            b'-' | b'+' => {
                let neg = self.s[self.i] == b'-';
                self.i += 1;
                match self.value()? {
                    Value::Number(n) if neg => negate(&n).ok_or_else(|| self.fail()),
                    v @ Value::Number(_) => Ok(v),
                    _ => Err(self.fail()),
                }
            }
            c if c.is_ascii_digit() || c == b'.' => self.number(),
            _ => self.name(),
        }
    }

    /// Comma-separated values up to `close` (a trailing comma allowed).
    fn items(&mut self, close: u8) -> Result<Vec<Value>, ToolParseError> {
        let mut out = Vec::new();
        loop {
            if self.eat(close) {
                return Ok(out);
            }
            out.push(self.value()?);
            if !self.eat(b',') {
                return if self.eat(close) {
                    Ok(out)
                } else {
                    Err(self.fail())
                };
            }
        }
    }

    fn dict(&mut self) -> Result<Value, ToolParseError> {
        let mut out = Map::new();
        loop {
            if self.eat(b'}') {
                return Ok(Value::Object(out));
            }
            let key = match self.value()? {
                Value::String(s) => s,
                Value::Null => "null".into(),
                Value::Bool(b) => b.to_string(),
                Value::Number(n) if n.is_f64() => {
                    return Err(ToolParseError::new("float dict keys are not supported"))
                }
                Value::Number(n) => n.to_string(),
                _ => return Err(self.fail()),
            };
            if !self.eat(b':') {
                return Err(self.fail());
            }
            let v = self.value()?;
            out.insert(key, v);
            if !self.eat(b',') {
                return if self.eat(b'}') {
                    Ok(Value::Object(out))
                } else {
                    Err(self.fail())
                };
            }
        }
    }

    fn name(&mut self) -> Result<Value, ToolParseError> {
        let start = self.i;
        while self.i < self.s.len()
            && (self.s[self.i].is_ascii_alphanumeric() || self.s[self.i] == b'_')
        {
            self.i += 1;
        }
        match &self.s[start..self.i] {
            b"True" => Ok(Value::Bool(true)),
            b"False" => Ok(Value::Bool(false)),
            b"None" => Ok(Value::Null),
            _ => Err(self.fail()),
        }
    }

    fn number(&mut self) -> Result<Value, ToolParseError> {
        let start = self.i;
        while self.i < self.s.len() {
            let c = self.s[self.i];
            let sign_after_e = (c == b'+' || c == b'-')
                && self.i > start
                && matches!(self.s[self.i - 1], b'e' | b'E');
            if c.is_ascii_alphanumeric() || c == b'.' || c == b'_' || sign_after_e {
                self.i += 1;
            } else {
                break;
            }
        }
        let raw = std::str::from_utf8(&self.s[start..self.i]).map_err(|_| self.fail())?;
        let text = raw.replace('_', "");
        let is_float =
            text.contains(['.', 'e', 'E']) && !text.starts_with("0x") && !text.starts_with("0X");
        if is_float {
            let f: f64 = text.parse().map_err(|_| self.fail())?;
            return serde_json::Number::from_f64(f)
                .map(Value::Number)
                .ok_or_else(|| self.fail());
        }
        let (digits, radix) = match text.get(..2) {
            Some("0x" | "0X") => (&text[2..], 16),
            Some("0o" | "0O") => (&text[2..], 8),
            Some("0b" | "0B") => (&text[2..], 2),
            _ if text.len() > 1 && text.starts_with('0') && text.bytes().any(|b| b != b'0') => {
                return Err(self.fail()); // Python 3 has no leading-zero integers
            }
            _ => (text.as_str(), 10),
        };
        let n = i64::from_str_radix(digits, radix).map_err(|_| self.fail())?;
        Ok(Value::from(n))
    }

    fn string(&mut self) -> Result<String, ToolParseError> {
        let quote = self.s[self.i];
        let triple = self.s[self.i..].starts_with(&[quote; 3]);
        self.i += if triple { 3 } else { 1 };
        let mut out: Vec<u8> = Vec::new();
        loop {
            let c = *self.s.get(self.i).ok_or_else(|| self.fail())?;
            if c == quote && (!triple || self.s[self.i..].starts_with(&[quote; 3])) {
                self.i += if triple { 3 } else { 1 };
                break;
            }
            if c == b'\n' && !triple {
                return Err(self.fail());
            }
            self.i += 1;
            if c != b'\\' {
                out.push(c);
                continue;
            }
            let e = *self.s.get(self.i).ok_or_else(|| self.fail())?;
            self.i += 1;
            let simple = match e {
                b'n' => Some(b'\n'),
                b't' => Some(b'\t'),
                b'r' => Some(b'\r'),
                b'\\' => Some(b'\\'),
                b'\'' => Some(b'\''),
                b'"' => Some(b'"'),
                b'0' => Some(0),
                b'a' => Some(7),
                b'b' => Some(8),
                b'f' => Some(12),
                b'v' => Some(11),
                b'\n' => None,
                _ => {
                    let width = match e {
                        b'x' => 2,
                        b'u' => 4,
                        b'U' => 8,
                        _ => {
                            // An unknown escape keeps its backslash.
                            out.extend([b'\\', e]);
                            continue;
                        }
                    };
                    let hex = self
                        .s
                        .get(self.i..self.i + width)
                        .ok_or_else(|| self.fail())?;
                    let code =
                        u32::from_str_radix(std::str::from_utf8(hex).map_err(|_| self.fail())?, 16)
                            .map_err(|_| self.fail())?;
                    let ch = char::from_u32(code).ok_or_else(|| self.fail())?;
                    self.i += width;
                    out.extend(ch.to_string().as_bytes());
                    continue;
                }
            };
            if let Some(b) = simple {
                out.push(b);
            }
        }
        String::from_utf8(out).map_err(|_| self.fail())
    }
}

fn negate(n: &serde_json::Number) -> Option<Value> {
    if let Some(i) = n.as_i64() {
        return Some(Value::from(-i));
    }
    serde_json::Number::from_f64(-n.as_f64()?).map(Value::Number)
}

/// Python's `float(text)`: surrounding whitespace, `_` between digits, `inf`/`nan`.
pub(super) fn py_float(text: &str) -> Result<f64, ToolParseError> {
    let bad = || ToolParseError::new(format!("could not convert string to float: {text:?}"));
    let s = py_strip(text);
    let b = s.as_bytes();
    let digit_around = |i: usize| {
        i > 0 && i + 1 < b.len() && b[i - 1].is_ascii_digit() && b[i + 1].is_ascii_digit()
    };
    if (0..b.len()).any(|i| b[i] == b'_' && !digit_around(i)) {
        return Err(bad());
    }
    let s = s.replace('_', "");
    let lower = s.to_ascii_lowercase();
    let unsigned = lower.trim_start_matches(['+', '-']);
    if unsigned.starts_with("in") && unsigned != "inf" && unsigned != "infinity" {
        return Err(bad());
    }
    s.parse::<f64>().map_err(|_| bad())
}

/// Python's `int(float)`: truncation; infinities and NaN cannot be converted.
pub(super) fn py_int(f: f64) -> Result<i64, ToolParseError> {
    if !f.is_finite() || f.abs() >= 9.2e18 {
        return Err(ToolParseError::new(format!(
            "cannot convert float {f} to integer"
        )));
    }
    Ok(f.trunc() as i64)
}

/// Python's `int(text)`: surrounding whitespace, a sign, digits with single `_` between them
/// (no decimal point); beyond 64 bits it is refused here.
pub(super) fn py_int_text(text: &str) -> Result<i64, ToolParseError> {
    let bad = || ToolParseError::new(format!("invalid literal for int(): {text:?}"));
    let s = py_strip(text);
    let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
    let b = digits.as_bytes();
    let ok = !b.is_empty()
        && b[0].is_ascii_digit()
        && b[b.len() - 1].is_ascii_digit()
        && b.iter().all(|c| c.is_ascii_digit() || *c == b'_')
        && !digits.contains("__");
    if !ok {
        return Err(bad());
    }
    s.replace('_', "").parse::<i64>().map_err(|_| bad())
}
