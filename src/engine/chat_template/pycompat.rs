//! The Python-compatibility layer of the chat-template environment: transformers'
//! `raise_exception`, `strftime_now` and `tojson`, Jinja2's `trim`, Python's string methods and
//! Python's value printing (`str()`/`repr()` of lists, dicts, strings and floats), so templates
//! written for Jinja2 render the same bytes in minijinja.

use std::ffi::CString;
use std::fmt::Write as _;

use minijinja::value::{from_args, Kwargs, Value, ValueKind};
use minijinja::{ErrorKind, Output, State};

/// Marks an error raised by the template's own `raise_exception(...)`.
#[derive(Debug)]
pub(super) struct TemplateRaised(pub(super) String);

impl std::fmt::Display for TemplateRaised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateRaised {}

/// transformers' `raise_exception(message)`: fails the render with `message`, marked as
/// [`TemplateRaised`] so the caller can tell it from a template bug.
pub(super) fn raise_exception(message: Value) -> std::result::Result<Value, minijinja::Error> {
    let msg = message
        .as_str()
        .map_or_else(|| message.to_string(), str::to_owned);
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, msg.clone())
            .with_source(TemplateRaised(msg)),
    )
}

/// `datetime.now().strftime(format)`: local time through libc, with Python's own handling of
/// `%f` and of `%z`/`%Z` (empty for a naive datetime).
pub(super) fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut fmt = String::with_capacity(format.len());
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            fmt.push(c);
            continue;
        }
        match chars.peek().copied() {
            Some('f') => {
                chars.next();
                let _ = write!(fmt, "{:06}", now.subsec_micros());
            }
            Some('z') | Some('Z') => {
                chars.next();
            }
            Some(':') => {
                chars.next();
                if chars.peek() == Some(&'z') {
                    chars.next();
                } else {
                    fmt.push_str("%:");
                }
            }
            Some(other) => {
                chars.next();
                fmt.push('%');
                fmt.push(other);
            }
            None => fmt.push('%'),
        }
    }
    let secs = now.as_secs() as libc::time_t;
    // SAFETY: `tm` is plain old data filled by localtime_r; both pointers are valid.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    if unsafe { libc::localtime_r(&secs, &mut tm) }.is_null() {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            "strftime_now: the local time is unavailable",
        ));
    }
    let cfmt = CString::new(fmt.clone()).map_err(|_| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            "strftime_now: format contains NUL",
        )
    })?;
    // Python's time.strftime loop: grow the buffer until the result fits.
    let mut size = 1024usize;
    loop {
        let mut buf = vec![0u8; size];
        // SAFETY: buf has `size` writable bytes, cfmt is NUL-terminated, tm is initialised.
        let n = unsafe {
            libc::strftime(
                buf.as_mut_ptr() as *mut libc::c_char,
                size,
                cfmt.as_ptr(),
                &tm,
            )
        };
        if n > 0 || size >= 256 * fmt.len().max(1) {
            buf.truncate(n);
            return Ok(String::from_utf8_lossy(&buf).into_owned());
        }
        size *= 2;
    }
}

/// Python's `str.isspace` (Rust's whitespace plus the four ASCII information separators).
fn py_is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip/lstrip/rstrip(chars)`.
fn py_strip(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let pred = |c: char| match chars {
        Some(set) => set.contains(c),
        None => py_is_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(pred);
    }
    if right {
        out = out.trim_end_matches(pred);
    }
    out.to_owned()
}

/// Python's `str.split()` without a separator: runs of Python whitespace separate words,
/// and after `maxsplit` splits the rest is kept (leading whitespace removed).
fn py_split_whitespace(s: &str, maxsplit: i64) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s.trim_start_matches(py_is_space);
    while !rest.is_empty() {
        if maxsplit >= 0 && out.len() as i64 >= maxsplit {
            out.push(rest.to_owned());
            break;
        }
        let end = rest.find(py_is_space).unwrap_or(rest.len());
        out.push(rest[..end].to_owned());
        rest = rest[end..].trim_start_matches(py_is_space);
    }
    out
}

/// Jinja2's `trim` filter is `str(value).strip(chars)`.
pub(super) fn trim_filter(value: Value, chars: Option<String>) -> String {
    let s = value
        .as_str()
        .map_or_else(|| value.to_string(), str::to_owned);
    py_strip(&s, chars.as_deref(), true, true)
}

/// Python string methods: strip variants with Python's whitespace, the rest from pycompat.
pub(super) fn py_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, minijinja::Error> {
    if let Some(s) = value.as_str() {
        if method == "split" {
            let (sep, maxsplit): (Option<Value>, Option<i64>) = from_args(args)?;
            if sep.as_ref().is_none_or(|v| v.is_none() || v.is_undefined()) {
                return Ok(Value::from(py_split_whitespace(s, maxsplit.unwrap_or(-1))));
            }
        }
        let sides = match method {
            "strip" => Some((true, true)),
            "lstrip" => Some((true, false)),
            "rstrip" => Some((false, true)),
            _ => None,
        };
        if let Some((left, right)) = sides {
            let (chars,): (Option<Value>,) = from_args(args)?;
            let chars = chars.filter(|c| !c.is_none() && !c.is_undefined());
            let set = match &chars {
                Some(c) => Some(c.as_str().ok_or_else(|| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        format!("{method} arg must be None or str"),
                    )
                })?),
                None => None,
            };
            return Ok(Value::from(py_strip(s, set, left, right)));
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Prints values like Jinja2 does (`str()` of the Python value): lists and dicts as Python
/// reprs, floats as Python floats; everything else as minijinja would.
pub(super) fn py_formatter(
    out: &mut Output,
    state: &State,
    value: &Value,
) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            py_repr(&mut s, value);
            out.write_str(&s).map_err(minijinja::Error::from)
        }
        ValueKind::Number if !value.is_integer() => {
            let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
            out.write_str(&py_float_repr(f))
                .map_err(minijinja::Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python `repr` of a template value.
fn py_repr(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number if v.is_integer() => {
            let _ = write!(out, "{v}");
        }
        ValueKind::Number => {
            out.push_str(&py_float_repr(f64::try_from(v.clone()).unwrap_or(f64::NAN)));
        }
        ValueKind::String => py_str_repr(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            py_repr_joined(out, v, ('[', ']'), |out, item| py_repr(out, &item));
        }
        ValueKind::Map => py_repr_joined(out, v, ('{', '}'), |out, key| {
            py_repr(out, &key);
            out.push_str(": ");
            py_repr(out, &v.get_item(&key).unwrap_or_default());
        }),
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

/// The `[a, b]` / `{k: v}` part of Python `repr`: what `v` iterates over (items or keys),
/// each written by `each`, joined by `", "` between the brackets.
fn py_repr_joined(
    out: &mut String,
    v: &Value,
    (open, close): (char, char),
    mut each: impl FnMut(&mut String, Value),
) {
    out.push(open);
    if let Ok(iter) = v.try_iter() {
        for (i, item) in iter.enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            each(out, item);
        }
    }
    out.push(close);
}

/// Python `repr(str)`: single quotes unless the text has `'` and no `"`.
fn py_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python `repr(float)`: shortest round-trip digits, scientific outside 1e-4 <= |x| < 1e16.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let sign = if f.is_sign_negative() { "-" } else { "" };
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    let decpt = exp + 1;
    let body = if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            format!("0.{}{}", "0".repeat((-decpt) as usize), digits)
        } else if decpt >= n {
            format!("{}{}.0", digits, "0".repeat((decpt - n) as usize))
        } else {
            format!(
                "{}.{}",
                &digits[..decpt as usize],
                &digits[decpt as usize..]
            )
        }
    } else {
        let rest = if n > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let e = decpt - 1;
        format!(
            "{}{}e{}{:02}",
            &digits[..1],
            rest,
            if e < 0 { '-' } else { '+' },
            e.abs()
        )
    };
    format!("{sign}{body}")
}

/// Options of transformers' `tojson` (Python's `json.dumps` with `ensure_ascii=False`).
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// transformers overrides Jinja's `tojson` with `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`: no HTML escaping, Python's separators.
pub(super) fn tojson_filter(
    value: Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<String, minijinja::Error> {
    let pick =
        |pos: Option<Value>, name: &str| -> std::result::Result<Option<Value>, minijinja::Error> {
            match pos {
                Some(v) => Ok(Some(v)),
                None => kwargs.get::<Option<Value>>(name),
            }
        };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = pick(indent, "indent")?.filter(|v| !v.is_none() && !v.is_undefined());
    let separators = pick(None, "separators")?.filter(|v| !v.is_none() && !v.is_undefined());
    let sort_keys = pick(None, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
        Some(v) => Some(" ".repeat(v.as_i64().unwrap_or(0).max(0) as usize)),
    };
    let (mut item_sep, mut key_sep) = if indent.is_some() {
        (",".to_owned(), ": ".to_owned())
    } else {
        (", ".to_owned(), ": ".to_owned())
    };
    if let Some(seps) = separators {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        if let [a, b] = parts.as_slice() {
            item_sep = a.as_str().unwrap_or_default().to_owned();
            key_sep = b.as_str().unwrap_or_default().to_owned();
        } else {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson separators must be a pair of strings",
            ));
        }
    }
    let style = JsonStyle {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, &value, &style, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    v: &Value,
    style: &JsonStyle,
    level: usize,
) -> std::result::Result<(), minijinja::Error> {
    let not_serializable = |kind: ValueKind| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("Object of type {kind} is not JSON serializable"),
        )
    };
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => {
            let _ = write!(out, "{v}");
        }
        ValueKind::Number => {
            let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
            if f.is_nan() {
                out.push_str("NaN");
            } else if f.is_infinite() {
                out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
            } else {
                out.push_str(&py_float_repr(f));
            }
        }
        ValueKind::String => json_str(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, level + 1);
                write_json(out, item, style, level + 1)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in v.try_iter()? {
                let name = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
                    ValueKind::Number if key.is_integer() => key.to_string(),
                    ValueKind::Number => {
                        py_float_repr(f64::try_from(key.clone()).unwrap_or(f64::NAN))
                    }
                    kind => return Err(not_serializable(kind)),
                };
                let item = v.get_item(&key)?;
                entries.push((name, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, level + 1);
                json_str(out, k, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, item, style, level + 1)?;
            }
            newline(out, level);
            out.push('}');
        }
        kind => return Err(not_serializable(kind)),
    }
    Ok(())
}

/// A JSON string literal the way Python's `json` module writes it.
fn json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
