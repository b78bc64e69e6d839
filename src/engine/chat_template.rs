//! Chat-template rendering as transformers 5 does it for mlx-lm 0.32.2: which template a model
//! directory selects (`chat_template.jinja` beats the config entry), and a minijinja environment
//! set up like transformers' Jinja2 sandbox, with the Python-flavoured filters, methods and value
//! printing templates written for Jinja2 rely on, so prompts render to the same bytes. Those
//! Python-flavoured pieces live in `pycompat`; this file loads, resolves and renders.

mod pycompat;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::{Enumerator, Object, ObjectRepr, Value};
use minijinja::{AutoEscape, Environment};
use serde_json::{Map, Value as Json};

use crate::engine::error::{EngineError, Result};
use pycompat::{
    py_formatter, py_method, raise_exception, strftime_now, tojson_filter, trim_filter,
    TemplateRaised,
};

/// Name the chat template is registered under in the minijinja environment.
const TEMPLATE_NAME: &str = "chat_template";

/// One chat turn; templates see it as `{'role': ..., 'content': ..., **fields}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ... exactly as the template expects it.
    pub role: String,
    /// The text of the turn.
    pub content: String,
    /// The message's other keys in the client's order (`tool_calls`, `tool_call_id`, `name`,
    /// ...), given to the template as they are.
    pub fields: Map<String, Json>,
}

impl ChatMessage {
    /// Shorthand so callers can build conversations without struct literals.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            fields: Map::new(),
        }
    }
}

/// What the model directory says about its chat template.
enum Template {
    /// No template at all: prompts are encoded as plain text with special tokens.
    Absent,
    /// A template compiled into the environment under [`TEMPLATE_NAME`].
    Ready { source: PathBuf },
    /// A template that did not compile; like transformers, this only fails when used.
    Broken { source: PathBuf, reason: String },
    /// Several named templates but none called `default` (transformers refuses these).
    NoDefault { source: PathBuf, names: Vec<String> },
    /// mlx-lm's Python-side renderer (`chat_template_type`), which mlxb does not have.
    Custom(String),
}
/// A model's chat template compiled into its own environment, so the tokenizer can render
/// prompts without knowing about Jinja.
pub struct ChatTemplate {
    env: Environment<'static>,
    template: Template,
    /// The source of a single template (see [`ChatTemplate::text`]).
    text: Option<String>,
}

impl ChatTemplate {
    /// Finds and compiles the template of a model directory the way transformers does; a
    /// template that does not compile only fails when it is rendered.
    pub fn load(
        model_dir: &Path,
        cfg_path: &Path,
        init: &Map<String, Json>,
        chat_template_type: Option<String>,
    ) -> Result<ChatTemplate> {
        let mut env = chat_environment();
        let (template, text) =
            resolve_template(model_dir, cfg_path, init, chat_template_type, &mut env)?;
        Ok(ChatTemplate {
            env,
            template,
            text,
        })
    }

    /// Whether there is a template at all (mlx-lm's `tokenizer.has_chat_template`).
    pub fn is_present(&self) -> bool {
        !matches!(self.template, Template::Absent)
    }

    /// The template's text when the model has exactly one (transformers' `chat_template` as a
    /// string), which mlx-lm reads to choose a tool-call parser.
    pub fn text(&self) -> Option<&str> {
        self.text.as_deref()
    }

    /// Renders a conversation like transformers' `apply_chat_template(messages, tools=tools,
    /// tokenize=False, ...)`; `vars` are the named special tokens templates may use.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Json]>,
        vars: &BTreeMap<String, String>,
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String> {
        let source = match &self.template {
            Template::Ready { source } => source,
            Template::Absent => {
                return Err(EngineError::ChatTemplate {
                    path: None,
                    reason: "this model has no chat template".into(),
                })
            }
            Template::Broken { source, reason } => {
                return Err(template_error(
                    source,
                    &format!("has a chat template that does not compile ({reason}); fix it"),
                ))
            }
            Template::NoDefault { source, names } => {
                return Err(template_error(
                    source,
                    &format!(
                        "has several chat templates ({}) and none named 'default'; add one",
                        names.join(", ")
                    ),
                ))
            }
            Template::Custom(kind) => {
                return Err(EngineError::ChatTemplate {
                    path: None,
                    reason: format!(
                        "this model uses mlx-lm's Python chat renderer '{kind}', which mlxb does \
                         not support"
                    ),
                })
            }
        };
        if messages.is_empty() {
            return Err(EngineError::Input(
                "cannot apply the chat template to an empty conversation".into(),
            ));
        }
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| Value::from_object(MessageObject(m.clone())))
            .collect();
        let mut ctx: BTreeMap<String, Value> = vars
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.insert("messages".into(), Value::from(msgs));
        ctx.insert(
            "tools".into(),
            tools.map_or(Value::from(()), Value::from_serialize),
        );
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        ctx.insert("enable_thinking".into(), Value::from(enable_thinking));
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| {
            EngineError::file(source, format!("has an unusable chat template ({e})"))
        })?;
        tmpl.render(ctx).map_err(|e| render_error(source, &e))
    }
}

/// Chooses the template like transformers: `chat_template.jinja` and
/// `additional_chat_templates/*.jinja` replace the config's `chat_template` (string or list).
fn resolve_template(
    model_dir: &Path,
    cfg_path: &Path,
    init: &Map<String, Json>,
    chat_template_type: Option<String>,
    env: &mut Environment<'static>,
) -> Result<(Template, Option<String>)> {
    if let Some(kind) = chat_template_type {
        return Ok((Template::Custom(kind), None));
    }
    let mut files: BTreeMap<String, (String, PathBuf)> = BTreeMap::new();
    let jinja = model_dir.join("chat_template.jinja");
    if let Some(s) = read_text(&jinja)? {
        files.insert("default".into(), (s, jinja));
    }
    let extra_dir = model_dir.join("additional_chat_templates");
    if let Ok(entries) = std::fs::read_dir(&extra_dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if let Some(stem) = name.strip_suffix(".jinja") {
                let stem = stem.to_owned();
                if let Some(s) = read_text(&path)? {
                    files.insert(stem, (s, path));
                }
            }
        }
    }
    let mut named: BTreeMap<String, (String, PathBuf)> = BTreeMap::new();
    let single = if files.len() == 1 && files.contains_key("default") {
        files.remove("default")
    } else if !files.is_empty() {
        named = files;
        None
    } else {
        match init.get("chat_template") {
            Some(Json::String(s)) => Some((s.clone(), cfg_path.to_path_buf())),
            Some(Json::Array(list)) => {
                for item in list {
                    let name = item.get("name").and_then(Json::as_str);
                    let tmpl = item.get("template").and_then(Json::as_str);
                    if let (Some(n), Some(t)) = (name, tmpl) {
                        named.insert(n.to_owned(), (t.to_owned(), cfg_path.to_path_buf()));
                    }
                }
                None
            }
            _ => None,
        }
    };
    let text = single.as_ref().map(|(s, _)| s.clone());
    let (src, source) = match single {
        Some(s) => s,
        None if named.is_empty() => return Ok((Template::Absent, None)),
        None => match named.remove("default") {
            Some(s) => s,
            None => {
                let source = named
                    .values()
                    .next()
                    .map(|(_, p)| p.clone())
                    .unwrap_or_else(|| cfg_path.to_path_buf());
                return Ok((
                    Template::NoDefault {
                        source,
                        names: named.into_keys().collect(),
                    },
                    None,
                ));
            }
        },
    };
    let template = match env.add_template_owned(TEMPLATE_NAME, src) {
        Ok(()) => Template::Ready { source },
        Err(e) => Template::Broken {
            source,
            reason: e.to_string(),
        },
    };
    Ok((template, text))
}

/// Reads an optional UTF-8 text file.
fn read_text(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(EngineError::file(
            path,
            format!("could not be read as UTF-8 text ({e}); re-download it"),
        )),
    }
}

/// A message as the template sees it: a dict whose keys iterate in Python's insertion order
/// (`role`, `content`, then its other fields), which matters for `tojson`, `items()` and
/// printing.
#[derive(Debug)]
struct MessageObject(ChatMessage);

impl Object for MessageObject {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(Value::from(self.0.role.as_str())),
            "content" => Some(Value::from(self.0.content.as_str())),
            other => self.0.fields.get(other).map(Value::from_serialize),
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        if self.0.fields.is_empty() {
            return Enumerator::Str(&["role", "content"]);
        }
        let mut keys = vec![Value::from("role"), Value::from("content")];
        keys.extend(self.0.fields.keys().map(|k| Value::from(k.as_str())));
        Enumerator::Values(keys)
    }
}

/// Python's `json.dumps(value, ensure_ascii=False)` (the separators `, ` and `: `, Python's
/// float spelling), as mlx-lm's server writes a tool call's arguments.
pub fn py_json_dumps(value: &Json) -> String {
    tojson_filter(
        Value::from_serialize(value),
        None,
        None,
        minijinja::value::Kwargs::from_iter(std::iter::empty::<(&str, Value)>()),
    )
    .unwrap_or_else(|_| value.to_string())
}

/// A template's `raise_exception` means the conversation is wrong (the user's input);
/// anything else is a template problem.
fn render_error(source: &Path, e: &minijinja::Error) -> EngineError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(raised) = err.downcast_ref::<TemplateRaised>() {
            return EngineError::Input(format!(
                "the model's chat template rejected this conversation: {}",
                raised.0
            ));
        }
        cur = err.source();
    }
    template_error(
        source,
        &format!("has a chat template that failed to render ({e}); fix it"),
    )
}

/// A [`EngineError::ChatTemplate`] about the template file `source`.
fn template_error(source: &Path, reason: &str) -> EngineError {
    EngineError::ChatTemplate {
        path: Some(source.to_path_buf()),
        reason: reason.to_owned(),
    }
}

/// The environment transformers renders with: trim_blocks, lstrip_blocks, no trailing
/// newline, its `tojson`, `raise_exception` and `strftime_now`, plus Python-flavoured methods
/// and value printing so templates written for Jinja2 render the same bytes.
fn chat_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(py_method);
    env.set_formatter(py_formatter);
    env.add_filter("tojson", tojson_filter);
    env.add_filter("trim", trim_filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}
