//! The tokenizer, matching what mlx-lm 0.32.2 does on top of transformers 5 for a local model
//! directory: `tokenizer.json` run by the `tokenizers` crate, plus the parts transformers layers
//! on top: special tokens named in `tokenizer_config.json` (added when missing),
//! `clean_up_tokenization_spaces` on decode, and the EOS set mlx-lm builds from
//! `config.json`/`generation_config.json`. Chat templates render in [`super::chat_template`];
//! streamed output is detokenized in [`super::detokenizer`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::OnceLock;

use serde_json::{Map, Value as Json};
use tokenizers::models::ModelWrapper;
use tokenizers::AddedToken;

use crate::engine::chat_template::ChatTemplate;
use crate::engine::detokenizer::DetokKind;
use crate::engine::error::{EngineError, Result};
use crate::engine::tool_calls::{self, ToolParser};

/// Re-exported so callers keep building conversations from the tokenizer module.
pub use crate::engine::chat_template::ChatMessage;
/// Re-exported so callers keep streaming output from the tokenizer module.
pub use crate::engine::detokenizer::StreamingDetokenizer;

/// What prefixes a panic inside the tokenizers crate while encoding or decoding.
const TOKENIZER_PANICKED: &str = "the tokenizer failed";

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

/// A model's tokenizer with the transformers/mlx-lm behaviour around it; load once per model.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    template: ChatTemplate,
    template_vars: BTreeMap<String, String>,
    eos_token_ids: BTreeSet<u32>,
    eos_token_id: Option<u32>,
    has_thinking: bool,
    /// mlx-lm's name of the tool-call format (see [`Tokenizer::tool_format`]).
    tool_format: Option<String>,
    clean_up_spaces: bool,
    detok: DetokKind,
    /// `len(tokenizer)`, computed on first use (the tokenizers crate builds the whole
    /// vocabulary map to count it).
    vocab_len: OnceLock<usize>,
}

/// What mlxb reads from tokenizer.json itself (the tokenizers crate reads the rest); parsing
/// just this still checks the whole file's JSON syntax, without building the vocabulary.
#[derive(serde::Deserialize)]
struct TokenizerFile {
    #[serde(default)]
    decoder: Option<Json>,
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
        let (tok_file, mut inner) = read_tokenizer_json(&tok_path)?;

        let cfg_path = model_dir.join("tokenizer_config.json");
        let mut init = read_tokenizer_config(&cfg_path)?;
        let chat_template_type = init
            .get("chat_template_type")
            .and_then(Json::as_str)
            .map(str::to_owned);
        merge_legacy_special_tokens(model_dir, &mut init)?;

        let (named, extras) = named_special_tokens(&init);
        add_missing_tokens(&mut inner, &init, &named, &extras);

        let template_vars: BTreeMap<String, String> = named
            .iter()
            .map(|(k, t)| (k.clone(), t.content.clone()))
            .collect();
        let eos_token_id = template_vars
            .get("eos_token")
            .and_then(|t| inner.token_to_id(t));
        let clean_up_spaces = cleans_up_spaces(&init, &inner);

        let template = ChatTemplate::load(model_dir, &cfg_path, &init, chat_template_type)?;
        let has_thinking = has_thinking_tokens(&inner);
        let tool_format = match init.get("tool_parser_type").and_then(Json::as_str) {
            Some(name) => Some(name.to_owned()),
            None => {
                tool_calls::infer_parser_name(template.text(), |t| inner.token_to_id(t).is_some())
                    .map(str::to_owned)
            }
        };

        let mut eos_token_ids = model_eos_ids(model_dir)?;
        eos_token_ids.extend(eos_token_id);

        let mut tokenizer = Tokenizer {
            inner,
            template,
            template_vars,
            eos_token_ids,
            eos_token_id,
            has_thinking,
            tool_format,
            clean_up_spaces,
            detok: DetokKind::Naive {
                clean_spaces: false,
            },
            vocab_len: OnceLock::new(),
        };
        tokenizer.detok = DetokKind::pick(&tokenizer, tok_file.decoder.as_ref());
        Ok(tokenizer)
    }

    /// Token ids for `text`, as transformers' `tokenizer.encode(text, add_special_tokens=...)`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = super::contain::contain_fallible(TOKENIZER_PANICKED, || {
            self.inner.encode(text, add_special_tokens)
        })
        .map_err(|e| EngineError::Input(format!("the text could not be tokenized: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text for `ids` (special tokens kept), as transformers' `tokenizer.decode(ids)`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let text =
            super::contain::contain_fallible(TOKENIZER_PANICKED, || self.inner.decode(ids, false))
                .map_err(|e| {
                    EngineError::Input(format!("the token ids could not be decoded: {e}"))
                })?;
        Ok(if self.clean_up_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// Whether mlx-lm would format prompts with a chat template (`tokenizer.has_chat_template`).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_present()
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
        *self
            .vocab_len
            .get_or_init(|| self.inner.get_vocab_size(true))
    }

    /// The tool-call format of this model as mlx-lm names it (`tool_parser_type` in
    /// `tokenizer_config.json`, else inferred from the chat template and vocabulary).
    pub fn tool_format(&self) -> Option<&str> {
        self.tool_format.as_deref()
    }

    /// The parser for this model's tool calls, when mlxb has one for its format.
    pub fn tool_parser(&self) -> Option<ToolParser> {
        self.tool_format().and_then(ToolParser::from_name)
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
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Tokenizer::apply_chat_template`] with the request's `tools` (OpenAI's list of
    /// `{"type": "function", "function": {...}}`) given to the template.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.template.render(
            messages,
            tools,
            &self.template_vars,
            add_generation_prompt,
            self.has_thinking,
        )
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
        self.detok.class_name()
    }

    /// How this tokenizer streams, for the detokenizer module.
    pub(crate) fn detok(&self) -> &DetokKind {
        &self.detok
    }
}

/// Reads and parses `tokenizer.json` (the part mlxb reads itself and the tokenizers crate's
/// backend), then readies the backend with [`ready_backend`].
fn read_tokenizer_json(tok_path: &Path) -> Result<(TokenizerFile, tokenizers::Tokenizer)> {
    let bytes = match std::fs::read(tok_path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(EngineError::file(
                tok_path,
                "is missing; mlxb needs the fast-tokenizer file, so download the full model \
                 repository (including tokenizer.json)",
            ))
        }
        Err(e) => {
            return Err(EngineError::file(
                tok_path,
                format!("could not be read ({e}); check the file's permissions"),
            ))
        }
    };
    // Both parses of the file are the longest step of start-up once weights load fast,
    // so they run side by side; a JSON error is reported first (it names the real fault).
    // The tokenizers crate panics on some malformed files instead of returning an error;
    // `contain` turns that into one (reported after a JSON error, if any).
    let (tok_json, inner) = std::thread::scope(|s| {
        let json = s.spawn(|| serde_json::from_slice::<TokenizerFile>(&bytes));
        let inner = super::contain::contain_fallible("its parser failed", || {
            tokenizers::Tokenizer::from_bytes(&bytes)
        });
        (json.join(), inner)
    });
    let tok_file: TokenizerFile = tok_json
        .map_err(|_| EngineError::Runtime("the tokenizer.json parser thread panicked".into()))?
        .map_err(|e| {
            EngineError::file(
                tok_path,
                format!("is not valid JSON ({e}); re-download the model's tokenizer files"),
            )
        })?;
    let mut inner = inner.map_err(|e| {
        EngineError::file(
            tok_path,
            format!(
                "is not a tokenizer the tokenizers library can load ({e}); re-download it or \
                 re-save it with a current transformers"
            ),
        )
    })?;
    ready_backend(tok_path, &mut inner)?;
    Ok((tok_file, inner))
}

/// Switches truncation and padding off and refuses a backend that cannot encode.
fn ready_backend(tok_path: &Path, inner: &mut tokenizers::Tokenizer) -> Result<()> {
    // transformers encodes with truncation and padding switched off whatever the file says.
    inner.with_truncation(None).map_err(|e| {
        EngineError::file(tok_path, format!("has unusable truncation settings ({e})"))
    })?;
    inner.with_padding(None);
    // Some files make the tokenizers crate panic only when it encodes (found by fuzzing: a
    // TemplateProcessing special token whose map key differs from its `id`); one encode
    // with special tokens here refuses such a file at load, naming it.
    if let Err(panic) = super::contain::contain(|| inner.encode("a", true)) {
        return Err(EngineError::file(
            tok_path,
            format!(
                "is not a tokenizer the tokenizers library can run (it failed encoding a \
                 test text: {panic}); re-download it or re-save it with a current \
                 transformers"
            ),
        ));
    }
    Ok(())
}

/// `tokenizer_config.json` as a JSON object; an absent file is an empty one.
fn read_tokenizer_config(cfg_path: &Path) -> Result<Map<String, Json>> {
    match read_json(cfg_path)? {
        Some(Json::Object(m)) => Ok(m),
        Some(_) => Err(EngineError::file(
            cfg_path,
            "is not a JSON object; re-download the model's tokenizer files",
        )),
        None => Ok(Map::new()),
    }
}

/// Legacy layout: special_tokens_map.json overrides the config when the config does not
/// carry added_tokens_decoder (transformers' `_from_pretrained`); then
/// `additional_special_tokens` becomes `extra_special_tokens`.
fn merge_legacy_special_tokens(model_dir: &Path, init: &mut Map<String, Json>) -> Result<()> {
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
    if init.contains_key("additional_special_tokens") && !init.contains_key("extra_special_tokens")
    {
        if let Some(v) = init.remove("additional_special_tokens") {
            init.insert("extra_special_tokens".into(), v);
        }
    }
    Ok(())
}

/// Named special tokens and unnamed extras: the standard seven, then `*_token` keys, then a
/// dict of `extra_special_tokens` (transformers' model-specific special tokens), or a list of
/// them as unnamed extras.
fn named_special_tokens(init: &Map<String, Json>) -> (Vec<(String, AddedToken)>, Vec<AddedToken>) {
    let mut named: Vec<(String, AddedToken)> = Vec::new();
    for attr in SPECIAL_TOKEN_ATTRIBUTES {
        if let Some(tok) = init.get(attr).and_then(|v| added_token(v, true)) {
            named.push((attr.to_owned(), tok));
        }
    }
    for (key, value) in init {
        let is_token =
            value.is_string() || value.get("__type").and_then(Json::as_str) == Some("AddedToken");
        if key.ends_with("_token") && !SPECIAL_TOKEN_ATTRIBUTES.contains(&key.as_str()) && is_token
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
        Some(Json::Array(list)) => extras.extend(list.iter().filter_map(|v| added_token(v, true))),
        _ => {}
    }
    (named, extras)
}

/// Adds the tokens transformers adds to the backend at init: config-declared added tokens that
/// the backend does not have as such, then special tokens it does not know at all.
fn add_missing_tokens(
    inner: &mut tokenizers::Tokenizer,
    init: &Map<String, Json>,
    named: &[(String, AddedToken)],
    extras: &[AddedToken],
) {
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
}

/// Whether decode applies `clean_up_tokenization`: transformers skips it for BPE models
/// unless the config forces it.
fn cleans_up_spaces(init: &Map<String, Json>, inner: &tokenizers::Tokenizer) -> bool {
    let is_bpe = matches!(inner.get_model(), ModelWrapper::BPE(_));
    let clean_flag = init
        .get("clean_up_tokenization_spaces")
        .is_some_and(json_truthy);
    let force_bpe = init
        .get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        .is_some_and(json_truthy);
    clean_flag && (!is_bpe || force_bpe)
}

/// Whether the vocabulary has a pair of thinking tokens mlx-lm recognises.
fn has_thinking_tokens(inner: &tokenizers::Tokenizer) -> bool {
    [
        ["<think>", "</think>"],
        ["<longcat_think>", "</longcat_think>"],
        ["<|think:start|>", "<|think:end|>"],
        ["<|channel>", "<channel|>"],
    ]
    .iter()
    .any(|pair| pair.iter().all(|t| inner.token_to_id(t).is_some()))
        || ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
            .iter()
            .all(|t| inner.token_to_id(t).is_some())
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
