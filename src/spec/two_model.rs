//! The `model` drafter: a separate, smaller model that shares the target's tokenizer and
//! drafts greedily with its own caches.

use super::autoregressive::CachedDrafter;
use super::source::{Draft, DraftSource, TargetView};
use crate::engine::error::{EngineError, Result};
use crate::engine::forks::Forks;
use crate::engine::models::{self, LanguageModel};
use crate::engine::tokenizer::Tokenizer;
use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;

/// The `model` drafter.
pub struct TwoModelSource {
    /// Shared by the drafters of a batch's slots (each has its own caches); they draft in turn.
    model: Rc<RefCell<Box<dyn LanguageModel>>>,
    state: CachedDrafter,
    prefill_step: usize,
}

/// Fails unless the two tokenizers map every id to the same token.
pub fn check_same_vocab(target: &Tokenizer, draft: &Tokenizer, draft_dir: &Path) -> Result<()> {
    if target.vocab_len() != draft.vocab_len() {
        return Err(EngineError::file(
            draft_dir,
            format!(
                "the draft model's tokenizer has {} tokens but the target's has {}; a draft model must share the target's tokenizer",
                draft.vocab_len(),
                target.vocab_len()
            ),
        ));
    }
    let n = target.vocab_len() as u32;
    if let Some(id) = (0..n).find(|&i| target.id_to_token(i) != draft.id_to_token(i)) {
        return Err(EngineError::file(
            draft_dir,
            format!("the draft model's tokenizer differs from the target's at token id {id}; a draft model must share the target's tokenizer"),
        ));
    }
    Ok(())
}

impl TwoModelSource {
    /// Loads the draft model from `dir` and checks its tokenizer against the target's.
    pub fn open(
        dir: &Path,
        target_tokenizer: &Tokenizer,
        target_vocab: i32,
        forks: Forks,
        prefill_step: usize,
    ) -> Result<Self> {
        let draft_tokenizer = Tokenizer::load(dir)?;
        check_same_vocab(target_tokenizer, &draft_tokenizer, dir)?;
        let loaded = models::load(dir, forks)?;
        if loaded.model.vocab_size() != target_vocab {
            return Err(EngineError::file(
                dir,
                format!(
                    "the draft model's vocab_size is {} but the target's is {}; they must match",
                    loaded.model.vocab_size(),
                    target_vocab
                ),
            ));
        }
        let caches = loaded.model.make_caches();
        Ok(Self {
            model: Rc::new(RefCell::new(loaded.model)),
            state: CachedDrafter::new(caches, Vec::new()),
            prefill_step,
        })
    }
}

impl DraftSource for TwoModelSource {
    fn name(&self) -> &'static str {
        "model"
    }

    fn begin(&mut self, _target: TargetView<'_>, prompt: &[u32]) -> Result<()> {
        // Start from empty caches: the same drafter may serve one generation after another.
        let mut model = self.model.borrow_mut();
        self.state = CachedDrafter::new(model.make_caches(), Vec::new());
        self.state
            .prefill(prompt, self.prefill_step, &mut |x, c| model.forward(x, c))
    }

    fn draft(&mut self, _target: TargetView<'_>, sequence: &[u32], n: usize) -> Result<Draft> {
        let mut model = self.model.borrow_mut();
        let tokens = self
            .state
            .draft(sequence, n, &mut |x, c| model.forward(x, c))?;
        Ok(Draft {
            tokens,
            probs: None,
        })
    }

    fn commit(&mut self, _target: TargetView<'_>, committed: usize) -> Result<()> {
        let mut model = self.model.borrow_mut();
        self.state
            .commit(committed, &mut |x, c| model.forward(x, c))
    }

    fn fork(&self) -> Result<Option<Box<dyn DraftSource>>> {
        let caches = self.model.borrow().make_caches();
        Ok(Some(Box::new(Self {
            model: Rc::clone(&self.model),
            state: CachedDrafter::new(caches, Vec::new()),
            prefill_step: self.prefill_step,
        })))
    }
}
