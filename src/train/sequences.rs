//! The regenerated training sequences of `train-dspark`'s first stage, kept as a small JSONL
//! file of token ids: a header line with what decides them (the target's config, the
//! generation settings), then one line per prompt in prompt-file order,
//! `{"prompt": J, "prompt_sha256": H, "ids": [...], "reply_from": N}`, each appended and
//! synced before the next prompt starts.
//!
//! Why a file of its own: regeneration is the slow stage (hours for thousands of prompts on a
//! CPU), its output is a few MB, and hidden states are cheap to recompute from it. A run that
//! stops resumes after the last whole line (a torn last line, from a kill mid-write, is dropped);
//! a file built on the first lines of a prompt file continues on the whole file; and a file
//! kept or committed with its sha256 lets another machine build the hidden-state cache without
//! regenerating. Each line names its prompt's digest, so a file is never continued or used
//! with other prompts.

use super::data::TrainPrompt;
use crate::convert::registry::hex;
use crate::engine::error::{EngineError, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One regenerated sequence: the prompt's ids, then the target's reply from `reply_from` on
/// (the reply is the loss mask).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    /// Prompt and reply token ids.
    pub ids: Vec<u32>,
    /// Where the reply starts.
    pub reply_from: usize,
}

impl Sequence {
    /// `prompt` followed by `reply`.
    pub fn new(prompt: &[u32], reply: &[u32]) -> Self {
        let mut ids = prompt.to_vec();
        ids.extend(reply);
        Self {
            ids,
            reply_from: prompt.len(),
        }
    }

    /// True at the reply's positions.
    pub fn mask(&self) -> Vec<bool> {
        (0..self.ids.len()).map(|i| i >= self.reply_from).collect()
    }

    /// Reply tokens (the positions the loss is taken on).
    pub fn loss_tokens(&self) -> usize {
        self.ids.len() - self.reply_from
    }
}

/// One line of the file after the header.
#[derive(Debug, Serialize, Deserialize)]
struct Line {
    prompt: usize,
    prompt_sha256: String,
    ids: Vec<u32>,
    reply_from: usize,
}

/// The sha256 of a training prompt (its chat turns or its ids, as canonical JSON), so a line
/// can say which prompt it continues.
pub fn prompt_digest(prompt: &TrainPrompt) -> String {
    let v = match prompt {
        TrainPrompt::Chat(msgs) => serde_json::json!({
            "messages": msgs.iter().map(|m| [&m.role, &m.content]).collect::<Vec<_>>()
        }),
        TrainPrompt::Ids(ids) => serde_json::json!({ "prompt_ids": ids }),
    };
    hex(&Sha256::digest(v.to_string().as_bytes()))
}

/// The whole lines of the file at `path` (a missing file has none): its header, its records
/// (each checked to be the next prompt's, with its reply inside its ids) and the byte length
/// of those lines; a torn last line is left out.
fn read_lines(path: &Path) -> Result<(Option<Value>, Vec<Line>, usize)> {
    let bad = |why: String| EngineError::file(path, why);
    let text = match std::fs::read(path) {
        Ok(bytes) => String::from_utf8(bytes)
            .map_err(|_| bad("is not UTF-8 text; is it a sequences file?".into()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(bad(format!("cannot read it ({e})"))),
    };
    // Only whole lines count: a write cut off by a kill leaves no newline behind it.
    let whole = text.rfind('\n').map_or(0, |i| i + 1);
    let mut lines = text[..whole].lines();
    let Some(first) = lines.next() else {
        return Ok((None, Vec::new(), 0));
    };
    let header = serde_json::from_str::<Value>(first)
        .ok()
        .filter(|h| h.get("mlxb_sequences").is_some())
        .ok_or_else(|| bad("line 1 is not a sequences header; is it a sequences file?".into()))?;
    let mut records = Vec::new();
    for (j, line) in lines.enumerate() {
        let l: Line = serde_json::from_str(line).map_err(|e| {
            bad(format!(
                "line {}: not a sequence ({e}); is the file damaged?",
                j + 2
            ))
        })?;
        if l.prompt != j || l.reply_from > l.ids.len() {
            return Err(bad(format!(
                "line {}: not the sequence of prompt {j}; is the file damaged?",
                j + 2
            )));
        }
        records.push(l);
    }
    Ok((Some(header), records, whole))
}

/// Reads a sequences file for use elsewhere (its header and sequences), without appending.
pub fn read_sequences(path: &Path) -> Result<(Value, Vec<Sequence>)> {
    let (header, lines, _) = read_lines(path)?;
    let header = header.ok_or_else(|| {
        EngineError::file(
            path,
            "holds no sequences; run `train-dspark --sequences-only` to make it",
        )
    })?;
    let seqs = lines
        .into_iter()
        .map(|l| Sequence {
            ids: l.ids,
            reply_from: l.reply_from,
        })
        .collect();
    Ok((header, seqs))
}

/// A sequences file open for appending, with the sequences it already holds.
pub struct SequenceFile {
    path: PathBuf,
    file: File,
    done: Vec<Sequence>,
}

impl SequenceFile {
    /// Opens `path`, or creates it with `header`. An existing file must carry the same header
    /// and, line by line, the digests of `prompts`' first entries; a torn last line is cut off.
    /// Nothing is changed when it is refused.
    pub fn open(path: &Path, header: &Value, prompts: &[TrainPrompt]) -> Result<Self> {
        let bad = |why: String| EngineError::file(path, why);
        let (have, lines, whole) = read_lines(path)?;
        let mut done = Vec::new();
        match have {
            None => {
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(|e| {
                        EngineError::file(dir, format!("cannot create the directory ({e})"))
                    })?;
                }
                crate::engine::fsutil::write_atomic(path, format!("{header}\n").as_bytes())?;
            }
            Some(have) => {
                if &have != header {
                    return Err(bad(format!(
                        "was regenerated with other settings or another target ({have}, here {header}); use another --sequences file"
                    )));
                }
                if lines.len() > prompts.len() {
                    return Err(bad(format!(
                        "holds {} sequences, more than the {} prompts given; use the prompt file it was built from or another --sequences file",
                        lines.len(),
                        prompts.len()
                    )));
                }
                for (j, l) in lines.into_iter().enumerate() {
                    if prompts.get(j).map(prompt_digest) != Some(l.prompt_sha256) {
                        return Err(bad(format!(
                            "line {}: regenerated from another prompt than line {} of this prompt file; use another --sequences file",
                            j + 2,
                            j + 1
                        )));
                    }
                    done.push(Sequence {
                        ids: l.ids,
                        reply_from: l.reply_from,
                    });
                }
            }
        }
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| bad(format!("cannot open it for writing ({e})")))?;
        file.set_len(whole.max(header.to_string().len() + 1) as u64)
            .map_err(|e| bad(format!("cannot cut its torn last line ({e})")))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            done,
        })
    }

    /// The sequences held so far, in prompt order.
    pub fn done(&self) -> &[Sequence] {
        &self.done
    }

    /// Appends the sequence of the next prompt and syncs it to disk.
    pub fn append(&mut self, prompt: &TrainPrompt, seq: Sequence) -> Result<()> {
        let line = Line {
            prompt: self.done.len(),
            prompt_sha256: prompt_digest(prompt),
            ids: seq.ids,
            reply_from: seq.reply_from,
        };
        let text = serde_json::json!(line).to_string() + "\n";
        use std::io::{Seek, SeekFrom};
        self.file
            .seek(SeekFrom::End(0))
            .and_then(|_| self.file.write_all(text.as_bytes()))
            .and_then(|_| self.file.sync_data())
            .map_err(|e| {
                EngineError::file(
                    &self.path,
                    format!("cannot append a sequence ({e}); is the disk full?"),
                )
            })?;
        self.done.push(Sequence {
            ids: line.ids,
            reply_from: line.reply_from,
        });
        Ok(())
    }

    /// The sha256 of the sequences' ids (not of the file's bytes), which names the hidden-state
    /// cache built from them.
    pub fn digest(&self) -> String {
        digest_of(&self.done)
    }
}

/// The sha256 of `sequences`' ids (reply start and ids, one JSON line each), as
/// [`SequenceFile::digest`] and the cache's per-shard record name them.
pub fn digest_of(sequences: &[Sequence]) -> String {
    let mut h = Sha256::new();
    for s in sequences {
        h.update(
            serde_json::json!([s.reply_from, s.ids])
                .to_string()
                .as_bytes(),
        );
        h.update(b"\n");
    }
    hex(&h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompts() -> Vec<TrainPrompt> {
        (0..3).map(|i| TrainPrompt::Ids(vec![i, i + 1])).collect()
    }

    #[test]
    fn resumes_after_the_last_whole_line_and_checks_prompts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.jsonl");
        let header = serde_json::json!({"mlxb_sequences": 1, "max_tokens": 8});
        let p = prompts();
        let mut f = SequenceFile::open(&path, &header, &p).unwrap();
        f.append(&p[0], Sequence::new(&[0, 1], &[7, 8])).unwrap();
        f.append(&p[1], Sequence::new(&[1, 2], &[9])).unwrap();
        let digest = f.digest();
        drop(f);
        // A kill mid-write leaves a torn line; it is cut off and the two whole ones stay.
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"prompt\": 2, \"ids\": [2, 3");
        std::fs::write(&path, &text).unwrap();
        let mut f = SequenceFile::open(&path, &header, &p).unwrap();
        assert_eq!(f.done().len(), 2);
        assert_eq!(f.done()[0].mask(), vec![false, false, true, true]);
        assert_eq!(f.digest(), digest);
        f.append(&p[2], Sequence::new(&[2, 3], &[4])).unwrap();
        drop(f);
        let lines = std::fs::read_to_string(&path).unwrap();
        assert_eq!(lines.lines().count(), 4, "{lines}");
        assert!(lines.ends_with("\"reply_from\":2}\n"), "{lines}");

        // Other settings, or other prompts, are refused and leave the file as it was.
        let before = std::fs::read(&path).unwrap();
        let other = serde_json::json!({"mlxb_sequences": 1, "max_tokens": 9});
        let e = SequenceFile::open(&path, &other, &p).err().unwrap();
        assert!(e.to_string().contains("other settings"), "{e}");
        let mut q = prompts();
        q[1] = TrainPrompt::Ids(vec![5]);
        let e = SequenceFile::open(&path, &header, &q).err().unwrap();
        assert!(e.to_string().contains("line 3"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), before);
        // A longer prompt file with the same first prompts continues it.
        let mut more = prompts();
        more.push(TrainPrompt::Ids(vec![9]));
        assert_eq!(
            SequenceFile::open(&path, &header, &more)
                .unwrap()
                .done()
                .len(),
            3
        );
    }
}
