//! Prompt files shared by `train-dspark`, `calibrate` and `measure`: JSONL, one object per
//! line with a `prompt` string (one user turn), a `messages` chat list (`role`/`content`), or a
//! `prompt_ids` list of token ids fed as-is (no tokenizer, no chat template), so runs can be
//! compared with other implementations token for token. `prompt` and `messages` lines go
//! through the chat template, or are fed as plain text (`--ignore-chat-template`, for base
//! models). Other keys are ignored; blank lines are skipped; every problem names the file and
//! the line.

use crate::engine::chat_template::ChatMessage;
use crate::engine::error::{EngineError, Result};
use crate::engine::session::Session;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// What one line of a prompt file asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// A conversation (a `prompt` string is one user turn), rendered through the chat template.
    Chat(Vec<ChatMessage>),
    /// Token ids used exactly as given.
    Ids(Vec<u32>),
}

/// One prompt with the line it came from (for error messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptLine {
    /// 1-based line number in the file.
    pub line: usize,
    /// The prompt.
    pub input: PromptInput,
}

/// A parsed prompt file.
#[derive(Debug, Clone)]
pub struct PromptFile {
    /// The file it was read from.
    pub path: PathBuf,
    /// Its prompts in file order (never empty).
    pub prompts: Vec<PromptLine>,
}

const SHAPE: &str =
    "each line must be a JSON object with a `prompt` string, a `messages` list or a `prompt_ids` list";

/// Parses one line's object.
fn parse_line(v: &Value) -> std::result::Result<PromptInput, String> {
    if let Some(p) = v.get("prompt").and_then(Value::as_str) {
        return Ok(PromptInput::Chat(vec![ChatMessage::new("user", p)]));
    }
    if let Some(list) = v.get("messages").and_then(Value::as_array) {
        let msgs = list
            .iter()
            .map(|m| {
                match (
                    m.get("role").and_then(Value::as_str),
                    m.get("content").and_then(Value::as_str),
                ) {
                    (Some(r), Some(c)) => Ok(ChatMessage::new(r, c)),
                    _ => Err("a message lacks a `role` or `content` string".to_owned()),
                }
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if !msgs.iter().any(|m| m.role == "user") {
            return Err("the conversation has no user turn".into());
        }
        return Ok(PromptInput::Chat(msgs));
    }
    if let Some(list) = v.get("prompt_ids").and_then(Value::as_array) {
        let ids = list
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| format!("`prompt_ids` holds {t}, which is not a token id"))
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if ids.is_empty() {
            return Err("`prompt_ids` is empty".into());
        }
        return Ok(PromptInput::Ids(ids));
    }
    Err("no `prompt` string, `messages` list or `prompt_ids` list".into())
}

impl PromptFile {
    /// Reads and checks a prompt file (it must hold at least one prompt).
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| EngineError::file(path, format!("cannot read the prompt file ({e})")))?;
        let mut prompts = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad =
                |why: &str| EngineError::file(path, format!("line {}: {why}; {SHAPE}", i + 1));
            let v: Value = serde_json::from_str(line).map_err(|_| bad("not valid JSON"))?;
            let input = parse_line(&v).map_err(|why| bad(&why))?;
            prompts.push(PromptLine { line: i + 1, input });
        }
        if prompts.is_empty() {
            return Err(EngineError::file(
                path,
                format!("the prompt file holds no prompts; {SHAPE}"),
            ));
        }
        Ok(Self {
            path: path.to_path_buf(),
            prompts,
        })
    }

    /// Every prompt as the target's token ids: `prompt` and `messages` lines through the chat
    /// template where [`renders_chat`] says so, else as plain text ([`plain_ids`]);
    /// `prompt_ids` as given after a check against the model's vocabulary.
    pub fn token_ids(&self, session: &Session, use_chat_template: bool) -> Result<Vec<Vec<u32>>> {
        let chat = renders_chat(session, use_chat_template);
        self.prompts
            .iter()
            .map(|p| match &p.input {
                PromptInput::Ids(ids) => self.checked_ids(session, p.line, ids),
                PromptInput::Chat(msgs) if chat => chat_ids(session, msgs),
                PromptInput::Chat(msgs) => plain_ids(session, msgs),
            })
            .collect()
    }

    /// `ids` of line `line` after a check against the model's vocabulary.
    pub fn checked_ids(&self, session: &Session, line: usize, ids: &[u32]) -> Result<Vec<u32>> {
        let vocab = session.model.model.vocab_size() as i64;
        match ids.iter().find(|&&t| t as i64 >= vocab) {
            Some(bad) => Err(EngineError::file(
                &self.path,
                format!(
                    "line {line}: `prompt_ids` has id {bad}, outside the model's vocabulary of {vocab} tokens; use ids below {vocab}"
                ),
            )),
            None => Ok(ids.to_vec()),
        }
    }
}

/// Whether `prompt` and `messages` lines go through the chat template: unless
/// `--ignore-chat-template` asked otherwise, when the model has one; a model without one (a
/// base model) reads them as plain text, as `generate` feeds its prompt.
pub fn renders_chat(session: &Session, use_chat_template: bool) -> bool {
    use_chat_template && session.tokenizer.has_chat_template()
}

/// A conversation's prompt ids, as `generate` builds them for one user turn.
fn chat_ids(session: &Session, msgs: &[ChatMessage]) -> Result<Vec<u32>> {
    let tok = &session.tokenizer;
    tok.encode(&tok.apply_chat_template(msgs, true)?, false)
}

/// A conversation as plain text, as `generate --ignore-chat-template` feeds a prompt: the
/// turns' contents joined by newlines, encoded with the tokenizer's special tokens.
pub fn plain_ids(session: &Session, msgs: &[ChatMessage]) -> Result<Vec<u32>> {
    let text: Vec<&str> = msgs.iter().map(|m| m.content.as_str()).collect();
    session.tokenizer.encode(&text.join("\n"), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<PromptFile> {
        let dir = tempfile::tempdir().map_err(|e| EngineError::Runtime(e.to_string()))?;
        let p = dir.path().join("p.jsonl");
        std::fs::write(&p, text).map_err(|e| EngineError::Runtime(e.to_string()))?;
        PromptFile::read(&p)
    }

    fn err(text: &str) -> String {
        match read(text) {
            Ok(f) => panic!("accepted {text:?}: {:?}", f.prompts),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn reads_the_three_shapes_with_line_numbers() {
        let f = read(
            "{\"prompt\": \"hi\"}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n{\"prompt_ids\": [0, 5, 7]}\n",
        )
        .unwrap();
        let lines: Vec<usize> = f.prompts.iter().map(|p| p.line).collect();
        assert_eq!(lines, [1, 3, 4]);
        assert_eq!(
            f.prompts[0].input,
            PromptInput::Chat(vec![ChatMessage::new("user", "hi")])
        );
        assert_eq!(f.prompts[2].input, PromptInput::Ids(vec![0, 5, 7]));
    }

    #[test]
    fn refuses_bad_lines_naming_the_line() {
        assert!(err("").contains("no prompts"));
        assert!(err("\n \n").contains("no prompts"));
        let e = err("{\"prompt\": \"ok\"}\n{oops\n");
        assert!(e.contains("line 2: not valid JSON"), "{e}");
        let e = err("{\"prompt\": \"ok\"}\n\n{\"text\": 3}\n");
        assert!(e.contains("line 3: no `prompt`"), "{e}");
        assert!(err("{\"prompt_ids\": []}").contains("line 1: `prompt_ids` is empty"));
        assert!(err("{\"prompt_ids\": [1, -2]}").contains("-2"));
        assert!(err("{\"prompt_ids\": [1.5]}").contains("1.5"));
        assert!(
            err("{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}]}")
                .contains("no user turn")
        );
        assert!(err("{\"messages\": [{\"role\": \"user\"}]}").contains("lacks"));
    }
}
