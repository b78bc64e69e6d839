//! Tokenizer, chat template and streaming detokenizer, matching what mlx-lm 0.32.2 does on top
//! of transformers 5 for a local model directory.
//!
//! The tokenizer is `tokenizer.json` run by the `tokenizers` crate, plus the parts transformers
//! layers on top: special tokens named in `tokenizer_config.json` (added when missing), chat
//! template selection (`chat_template.jinja` beats the config entry), `clean_up_tokenization_spaces`
//! on decode, and the EOS set mlx-lm builds from `config.json`/`generation_config.json`. Chat
//! templates render with minijinja set up like transformers' Jinja2 sandbox. The streaming
//! detokenizer reproduces the one of mlx-lm's three detokenizers that it would pick.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use minijinja::value::{from_args, Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, Output, State};
use serde_json::{Map, Value as Json};
use tokenizers::models::ModelWrapper;
use tokenizers::AddedToken;

use crate::engine::error::{EngineError, Result};

/// The named special-token attributes transformers always knows, in its order.
const SPECIAL_TOKEN_ATTRIBUTES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Name the chat template is registered under in the minijinja environment.
const TEMPLATE_NAME: &str = "chat_template";

/// One chat turn; templates see it as `{'role': ..., 'content': ...}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ... exactly as the template expects it.
    pub role: String,
    /// The text of the turn.
    pub content: String,
}

impl ChatMessage {
    /// Shorthand so callers can build conversations without struct literals.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
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

/// How mlx-lm detokenizes a stream for this tokenizer (chosen from the `decoder` section).
enum DetokKind {
    /// `NaiveStreamingDetokenizer`: re-decode the pending ids with the full tokenizer.
    Naive { clean_spaces: bool },
    /// `SPMStreamingDetokenizer`: token bytes with `▁` as space, byte-fallback tokens as bytes.
    Spm { trim_space: bool, map: Vec<Vec<u8>> },
    /// `BPEStreamingDetokenizer`: GPT-2 byte-level token strings.
    Bpe { map: Vec<Option<String>> },
}

/// A model's tokenizer with the transformers/mlx-lm behaviour around it; load once per model.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    env: Environment<'static>,
    template: Template,
    template_vars: BTreeMap<String, String>,
    eos_token_ids: BTreeSet<u32>,
    eos_token_id: Option<u32>,
    has_thinking: bool,
    clean_up_spaces: bool,
    detok: DetokKind,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_len", &self.vocab_len())
            .field("eos_token_ids", &self.eos_token_ids)
            .field("has_chat_template", &self.has_chat_template())
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads the tokenizer of a model directory the way `mlx_lm.utils.load` does.
    pub fn load(model_dir: &Path) -> Result<Tokenizer> {
        let tok_path = model_dir.join("tokenizer.json");
        let bytes = match std::fs::read(&tok_path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(EngineError::file(
                    &tok_path,
                    "is missing; mlxb needs the fast-tokenizer file, so download the full model \
                     repository (including tokenizer.json)",
                ))
            }
            Err(e) => {
                return Err(EngineError::file(
                    &tok_path,
                    format!("could not be read ({e}); check the file's permissions"),
                ))
            }
        };
        let tok_json: Json = serde_json::from_slice(&bytes).map_err(|e| {
            EngineError::file(
                &tok_path,
                format!("is not valid JSON ({e}); re-download the model's tokenizer files"),
            )
        })?;
        let mut inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            EngineError::file(
                &tok_path,
                format!(
                    "is not a tokenizer the tokenizers library can load ({e}); re-download it or \
                     re-save it with a current transformers"
                ),
            )
        })?;
        // transformers encodes with truncation and padding switched off whatever the file says.
        inner.with_truncation(None).map_err(|e| {
            EngineError::file(&tok_path, format!("has unusable truncation settings ({e})"))
        })?;
        inner.with_padding(None);

        let cfg_path = model_dir.join("tokenizer_config.json");
        let mut init = match read_json(&cfg_path)? {
            Some(Json::Object(m)) => m,
            Some(_) => {
                return Err(EngineError::file(
                    &cfg_path,
                    "is not a JSON object; re-download the model's tokenizer files",
                ))
            }
            None => Map::new(),
        };
        let chat_template_type = init
            .get("chat_template_type")
            .and_then(Json::as_str)
            .map(str::to_owned);

        // Legacy layout: special_tokens_map.json overrides the config when the config does not
        // carry added_tokens_decoder (transformers' `_from_pretrained`).
        if !init.contains_key("added_tokens_decoder") {
            let map_path = model_dir.join("special_tokens_map.json");
            if let Some(Json::Object(map)) = read_json(&map_path)? {
                for (key, value) in map {
                    if key == "extra_special_tokens" {
                        if let Json::Array(list) = value {
                            let mut existing = match init.get(&key) {
                                Some(Json::Array(a)) => a.clone(),
                                _ => Vec::new(),
                            };
                            for tok in list {
                                if !existing.contains(&tok) {
                                    existing.push(tok);
                                }
                            }
                            init.insert(key, Json::Array(existing));
                        } else {
                            init.insert(key, value);
                        }
                    } else if let Json::Object(mut obj) = value {
                        // transformers turns these into AddedToken(..., special=True).
                        obj.insert("special".into(), Json::Bool(true));
                        obj.insert("__type".into(), Json::from("AddedToken"));
                        init.insert(key, Json::Object(obj));
                    } else {
                        init.insert(key, value);
                    }
                }
            }
        }
        if init.contains_key("additional_special_tokens")
            && !init.contains_key("extra_special_tokens")
        {
            if let Some(v) = init.remove("additional_special_tokens") {
                init.insert("extra_special_tokens".into(), v);
            }
        }

        // Named special tokens: the standard seven, then `*_token` keys, then a dict of
        // `extra_special_tokens` (transformers' model-specific special tokens).
        let mut named: Vec<(String, AddedToken)> = Vec::new();
        for attr in SPECIAL_TOKEN_ATTRIBUTES {
            if let Some(tok) = init.get(attr).and_then(|v| added_token(v, true)) {
                named.push((attr.to_owned(), tok));
            }
        }
        for (key, value) in &init {
            let is_token = value.is_string()
                || value.get("__type").and_then(Json::as_str) == Some("AddedToken");
            if key.ends_with("_token")
                && !SPECIAL_TOKEN_ATTRIBUTES.contains(&key.as_str())
                && is_token
            {
                if let Some(tok) = added_token(value, true) {
                    named.push((key.clone(), tok));
                }
            }
        }
        let mut extras: Vec<AddedToken> = Vec::new();
        match init.get("extra_special_tokens") {
            Some(Json::Object(map)) => {
                for (key, value) in map {
                    if let Some(tok) = added_token(value, true) {
                        named.retain(|(k, _)| k != key);
                        named.push((key.clone(), tok));
                    }
                }
            }
            Some(Json::Array(list)) => {
                extras.extend(list.iter().filter_map(|v| added_token(v, true)))
            }
            _ => {}
        }

        // Tokens transformers adds to the backend at init: config-declared added tokens that the
        // backend does not have as such, then special tokens it does not know at all.
        let existing: Vec<AddedToken> = inner
            .get_added_tokens_decoder()
            .into_values()
            .collect::<Vec<_>>();
        let mut to_add: Vec<AddedToken> = Vec::new();
        if let Some(Json::Object(decoder)) = init.get("added_tokens_decoder") {
            let mut entries: Vec<(i64, AddedToken)> = decoder
                .iter()
                .filter_map(|(id, v)| Some((id.parse::<i64>().ok()?, added_token(v, false)?)))
                .collect();
            entries.sort_by_key(|(id, _)| *id);
            for (_, tok) in entries {
                if !existing.contains(&tok) {
                    to_add.push(tok);
                }
            }
        }
        let mut known: BTreeSet<String> = existing.iter().map(|t| t.content.clone()).collect();
        known.extend(to_add.iter().map(|t| t.content.clone()));
        for tok in named.iter().map(|(_, t)| t).chain(extras.iter()) {
            if !known.contains(&tok.content) {
                known.insert(tok.content.clone());
                to_add.push(tok.clone());
            }
        }
        if !to_add.is_empty() {
            inner.add_tokens(&to_add);
        }

        let template_vars: BTreeMap<String, String> = named
            .iter()
            .map(|(k, t)| (k.clone(), t.content.clone()))
            .collect();
        let eos_token_id = template_vars
            .get("eos_token")
            .and_then(|t| inner.token_to_id(t));

        let is_bpe = matches!(inner.get_model(), ModelWrapper::BPE(_));
        let clean_flag = init
            .get("clean_up_tokenization_spaces")
            .is_some_and(json_truthy);
        let force_bpe = init
            .get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
            .is_some_and(json_truthy);
        let clean_up_spaces = clean_flag && (!is_bpe || force_bpe);

        let mut env = chat_environment();
        let template = resolve_template(model_dir, &cfg_path, &init, chat_template_type, &mut env)?;

        let has_thinking = [
            ["<think>", "</think>"],
            ["<longcat_think>", "</longcat_think>"],
            ["<|think:start|>", "<|think:end|>"],
            ["<|channel>", "<channel|>"],
        ]
        .iter()
        .any(|pair| pair.iter().all(|t| inner.token_to_id(t).is_some()))
            || ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
                .iter()
                .all(|t| inner.token_to_id(t).is_some());

        let mut eos_token_ids = model_eos_ids(model_dir)?;
        eos_token_ids.extend(eos_token_id);

        let mut tokenizer = Tokenizer {
            inner,
            env,
            template,
            template_vars,
            eos_token_ids,
            eos_token_id,
            has_thinking,
            clean_up_spaces,
            detok: DetokKind::Naive {
                clean_spaces: false,
            },
        };
        tokenizer.detok = tokenizer.detok_kind(tok_json.get("decoder"));
        Ok(tokenizer)
    }

    /// Picks mlx-lm's streaming detokenizer from the raw `decoder` section of tokenizer.json.
    fn detok_kind(&self, decoder: Option<&Json>) -> DetokKind {
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
        let n = self.vocab_len() as u32;
        match decoder {
            Some(d) if *d == spm || *d == spm_no_space => {
                let map = (0..n)
                    .map(|id| match self.inner.id_to_token(id) {
                        Some(t) => spm_token_bytes(&t),
                        None => Vec::new(),
                    })
                    .collect();
                DetokKind::Spm {
                    trim_space: *d == spm,
                    map,
                }
            }
            Some(d) if d.get("type").and_then(Json::as_str) == Some("ByteLevel") => {
                DetokKind::Bpe {
                    map: (0..n).map(|id| self.inner.id_to_token(id)).collect(),
                }
            }
            _ => {
                // mlx-lm probes whether decode drops the space before punctuation.
                let clean_spaces = self
                    .encode("a ,b", false)
                    .and_then(|ids| self.decode(&ids))
                    .map(|t| !t.contains(" ,"))
                    .unwrap_or(false);
                DetokKind::Naive { clean_spaces }
            }
        }
    }

    /// Token ids for `text`, as transformers' `tokenizer.encode(text, add_special_tokens=...)`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| EngineError::Input(format!("the text could not be tokenized: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text for `ids` (special tokens kept), as transformers' `tokenizer.decode(ids)`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let text = self
            .inner
            .decode(ids, false)
            .map_err(|e| EngineError::Input(format!("the token ids could not be decoded: {e}")))?;
        Ok(if self.clean_up_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// Whether mlx-lm would format prompts with a chat template (`tokenizer.has_chat_template`).
    pub fn has_chat_template(&self) -> bool {
        !matches!(self.template, Template::Absent)
    }

    /// Whether the vocabulary has thinking tokens; mlx-lm passes this to templates as
    /// `enable_thinking`.
    pub fn has_thinking(&self) -> bool {
        self.has_thinking
    }

    /// Ids that end generation: mlx-lm's `tokenizer.eos_token_ids`.
    pub fn eos_token_ids(&self) -> &BTreeSet<u32> {
        &self.eos_token_ids
    }

    /// The tokenizer's own `eos_token` id, if it has one.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// Adds a stop token like mlx-lm's `--extra-eos-token`: an integer id or a token string.
    pub fn add_eos_token(&mut self, token: &str) -> Result<()> {
        // transformers maps an unknown token to the unk token's id, if there is one.
        let id = match token.trim().parse::<u32>() {
            Ok(id) => Some(id),
            Err(_) => self.inner.token_to_id(token).or_else(|| {
                self.template_vars
                    .get("unk_token")
                    .and_then(|unk| self.inner.token_to_id(unk))
            }),
        };
        match id {
            Some(id) => {
                self.eos_token_ids.insert(id);
                Ok(())
            }
            None => Err(EngineError::Input(format!(
                "'{token}' is not a token for this tokenizer; pass a token id or an exact token"
            ))),
        }
    }

    /// Vocabulary size including added tokens (`len(tokenizer)` in transformers).
    pub fn vocab_len(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The token string for an id, for diagnostics and tests.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Renders a conversation like mlx-lm's `tokenizer.apply_chat_template(messages,
    /// tokenize=False, add_generation_prompt=...)`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let source = match &self.template {
            Template::Ready { source } => source,
            Template::Absent => {
                return Err(EngineError::Input(
                    "this model has no chat template; use --ignore-chat-template".into(),
                ))
            }
            Template::Broken { source, reason } => {
                return Err(EngineError::file(
                    source,
                    format!(
                        "has a chat template that does not compile ({reason}); fix it or use \
                         --ignore-chat-template"
                    ),
                ))
            }
            Template::NoDefault { source, names } => {
                return Err(EngineError::file(
                    source,
                    format!(
                        "has several chat templates ({}) and none named 'default'; add one or use \
                         --ignore-chat-template",
                        names.join(", ")
                    ),
                ))
            }
            Template::Custom(kind) => {
                return Err(EngineError::Input(format!(
                    "this model uses mlx-lm's Python chat renderer '{kind}', which mlxb does not \
                     support; use --ignore-chat-template"
                )))
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
        let mut ctx: BTreeMap<String, Value> = self
            .template_vars
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.insert("messages".into(), Value::from(msgs));
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        ctx.insert("enable_thinking".into(), Value::from(self.has_thinking));
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| {
            EngineError::file(source, format!("has an unusable chat template ({e})"))
        })?;
        tmpl.render(ctx).map_err(|e| render_error(source, &e))
    }

    /// Prompt ids exactly as `mlx_lm generate --prompt P [--system-prompt S]
    /// [--ignore-chat-template]` computes them, for the prompt text after the CLI's own
    /// handling (`\n`/`\t` escapes expanded, `-` replaced by stdin; see `cmd::common`).
    /// `use_chat_template` is `!--ignore-chat-template`; without a template it has no effect.
    /// With a template the rendered chat is encoded without adding special tokens (the
    /// template writes them), otherwise the text is encoded with them.
    pub fn prompt_ids(
        &self,
        prompt: &str,
        system_prompt: Option<&str>,
        use_chat_template: bool,
    ) -> Result<Vec<u32>> {
        if use_chat_template && self.has_chat_template() {
            let mut messages = Vec::with_capacity(2);
            if let Some(system) = system_prompt {
                messages.push(ChatMessage::new("system", system));
            }
            messages.push(ChatMessage::new("user", prompt));
            let rendered = self.apply_chat_template(&messages, true)?;
            self.encode(&rendered, false)
        } else {
            self.encode(prompt, true)
        }
    }

    /// A fresh streaming detokenizer of the kind mlx-lm would use for this tokenizer.
    pub fn detokenizer(&self) -> StreamingDetokenizer<'_> {
        StreamingDetokenizer::new(self)
    }

    /// Name of the mlx-lm detokenizer class this tokenizer streams like (for tests and logs).
    pub fn detokenizer_kind(&self) -> &'static str {
        match self.detok {
            DetokKind::Naive { .. } => "NaiveStreamingDetokenizer",
            DetokKind::Spm { .. } => "SPMStreamingDetokenizer",
            DetokKind::Bpe { .. } => "BPEStreamingDetokenizer",
        }
    }
}

/// Reads an optional JSON file: absent is `None`, unreadable or corrupt is a file error.
fn read_json(path: &Path) -> Result<Option<Json>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(EngineError::file(
                path,
                format!("could not be read ({e}); check the file's permissions"),
            ))
        }
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        EngineError::file(
            path,
            format!("is not valid JSON ({e}); re-download the model's files"),
        )
    })
}

/// Python truthiness of a JSON value.
fn json_truthy(v: &Json) -> bool {
    match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}

/// A token from a config value: a string, or an `AddedToken` dict with its flags.
fn added_token(v: &Json, named_special: bool) -> Option<AddedToken> {
    match v {
        Json::String(s) => Some(AddedToken::from(s.clone(), true)),
        Json::Object(o) => {
            let content = o.get("content")?.as_str()?;
            let flag = |k: &str| o.get(k).and_then(Json::as_bool);
            let special = flag("special").unwrap_or(false);
            let normalized = flag("normalized").unwrap_or(!special);
            Some(
                AddedToken::from(content, special || named_special)
                    .single_word(flag("single_word").unwrap_or(false))
                    .lstrip(flag("lstrip").unwrap_or(false))
                    .rstrip(flag("rstrip").unwrap_or(false))
                    .normalized(normalized),
            )
        }
        _ => None,
    }
}

/// EOS ids mlx-lm takes from the model config: `generation_config.json` wins when its
/// `eos_token_id` is truthy (a corrupt file is ignored), else `config.json`.
fn model_eos_ids(model_dir: &Path) -> Result<BTreeSet<u32>> {
    let mut eos = read_json(&model_dir.join("config.json"))?
        .and_then(|c| c.get("eos_token_id").cloned())
        .unwrap_or(Json::Null);
    let gen_path = model_dir.join("generation_config.json");
    if let Ok(bytes) = std::fs::read(&gen_path) {
        if let Ok(gen) = serde_json::from_slice::<Json>(&bytes) {
            if let Some(v) = gen.get("eos_token_id").filter(|v| json_truthy(v)) {
                eos = v.clone();
            }
        }
    }
    let to_id = |v: &Json| v.as_u64().and_then(|n| u32::try_from(n).ok());
    Ok(match &eos {
        Json::Array(list) => list.iter().filter_map(to_id).collect(),
        v => to_id(v).into_iter().collect(),
    })
}

/// transformers' `clean_up_tokenization` (only applied to non-BPE models).
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

/// Chooses the template like transformers: `chat_template.jinja` and
/// `additional_chat_templates/*.jinja` replace the config's `chat_template` (string or list).
fn resolve_template(
    model_dir: &Path,
    cfg_path: &Path,
    init: &Map<String, Json>,
    chat_template_type: Option<String>,
    env: &mut Environment<'static>,
) -> Result<Template> {
    if let Some(kind) = chat_template_type {
        return Ok(Template::Custom(kind));
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
    let (src, source) = match single {
        Some(s) => s,
        None if named.is_empty() => return Ok(Template::Absent),
        None => match named.remove("default") {
            Some(s) => s,
            None => {
                let source = named
                    .values()
                    .next()
                    .map(|(_, p)| p.clone())
                    .unwrap_or_else(|| cfg_path.to_path_buf());
                return Ok(Template::NoDefault {
                    source,
                    names: named.into_keys().collect(),
                });
            }
        },
    };
    Ok(match env.add_template_owned(TEMPLATE_NAME, src) {
        Ok(()) => Template::Ready { source },
        Err(e) => Template::Broken {
            source,
            reason: e.to_string(),
        },
    })
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

// ---------------------------------------------------------------------------------------------
// Chat templates: minijinja configured like transformers' ImmutableSandboxedEnvironment.

/// A message as the template sees it: a dict whose keys iterate in Python's insertion order
/// (`role`, `content`), which matters for `tojson`, `items()` and printing.
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
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(&["role", "content"])
    }
}

/// Marks an error raised by the template's own `raise_exception(...)`.
#[derive(Debug)]
struct TemplateRaised(String);

impl std::fmt::Display for TemplateRaised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateRaised {}

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
    EngineError::file(
        source,
        format!(
            "has a chat template that failed to render ({e}); fix it or use --ignore-chat-template"
        ),
    )
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

fn raise_exception(message: Value) -> std::result::Result<Value, minijinja::Error> {
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
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
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
fn trim_filter(value: Value, chars: Option<String>) -> String {
    let s = value
        .as_str()
        .map_or_else(|| value.to_string(), str::to_owned);
    py_strip(&s, chars.as_deref(), true, true)
}

/// Python string methods: strip variants with Python's whitespace, the rest from pycompat.
fn py_method(
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
fn py_formatter(
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
            out.push('[');
            if let Ok(iter) = v.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &item);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = v.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &key);
                    out.push_str(": ");
                    py_repr(out, &v.get_item(&key).unwrap_or_default());
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
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
fn tojson_filter(
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

// ---------------------------------------------------------------------------------------------
// Streaming detokenizers (mlx_lm.tokenizer_utils).

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
        let state = match &tok.detok {
            DetokKind::Naive { .. } => DetokState::Naive {
                current_tokens: Vec::new(),
                current_text: String::new(),
            },
            DetokKind::Spm { .. } => DetokState::Spm {
                unflushed: Vec::new(),
            },
            DetokKind::Bpe { .. } => DetokState::Bpe {
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
                if let DetokKind::Spm { map, .. } = &self.tok.detok {
                    if let Some(bytes) = map.get(id as usize) {
                        unflushed.extend_from_slice(bytes);
                    }
                }
                self.spm_flush(false);
            }
            DetokState::Bpe { unflushed } => {
                let v: &str = match &self.tok.detok {
                    DetokKind::Bpe { map } => match map.get(id as usize) {
                        Some(t) => t.as_deref().unwrap_or(""),
                        None => "!",
                    },
                    _ => "",
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
        let clean_spaces = matches!(self.tok.detok, DetokKind::Naive { clean_spaces: true });
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
            self.tok.detok,
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
