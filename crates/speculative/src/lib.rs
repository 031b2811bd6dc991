//! # mlx-speculative
//!
//! Speculative decoding over [`mlx_models`]: a [`Drafter`] proposes up to `k` tokens, the
//! target model scores the last accepted token and all proposals in one forward call, and the
//! verifier keeps the longest prefix the target agrees with plus the target's own next token. At
//! temperature 0 the output is the target's greedy output, token for token.
//!
//! Caches: both sides keep every token but the newest one (`last`) in their KV cache; rejected
//! proposals are rolled back with [`mlx_models::Cache::trim`] (flat and paged caches; recurrent
//! layers cannot be trimmed, so hybrid models are refused up front).
use mlx_array::{Array, DType};
use mlx_models::{Cache, Logits, Model, ModelError};

/// Why speculative decoding failed.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Array(#[from] mlx_array::Error),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, SpecError>;

/// Proposes tokens for the target to verify.
pub trait Drafter {
    /// Take the prompt (all but its last token are to be cached; the last is `last` of the
    /// first [`Drafter::propose`]).
    fn prefill(&mut self, prompt: &[u32]) -> Result<()>;
    /// Up to `k` tokens to follow `last`.
    fn propose(&mut self, last: u32, k: usize) -> Result<Vec<u32>>;
    /// The target kept the first `accepted` of the last proposals; its own next token follows
    /// them (the next `last`).
    fn accept(&mut self, proposed: &[u32], accepted: usize) -> Result<()>;
}

/// A smaller LM sharing the target's vocabulary, decoding greedily with its own cache.
pub struct DraftModel {
    model: Model,
    cache: Cache,
}

impl DraftModel {
    pub fn new(model: Model) -> Result<Self> {
        let mut cache = model.new_cache();
        cache.trim(0).map_err(|e| SpecError::Invalid(format!("the draft model's cache cannot roll back: {e}")))?;
        Ok(DraftModel { model, cache })
    }
}

fn argmax_rows(logits: &Array) -> Result<Vec<u32>> {
    Ok(logits.argmax(-1, false)?.astype(DType::U32)?.reshape(&[-1])?.to_vec::<u32>()?)
}

fn forward(model: &Model, cache: &mut Cache, toks: &[u32], logits: Logits) -> Result<Option<Array>> {
    let t = Array::from_slice(toks, &[1, toks.len()])?;
    Ok(model.forward(&t, cache, logits, false)?.logits)
}

impl Drafter for DraftModel {
    fn prefill(&mut self, prompt: &[u32]) -> Result<()> {
        if prompt.len() > 1 {
            forward(&self.model, &mut self.cache, &prompt[..prompt.len() - 1], Logits::None)?;
            self.cache.eval_with(&[])?;
        }
        Ok(())
    }

    fn propose(&mut self, last: u32, k: usize) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(k);
        let mut cur = last;
        for _ in 0..k {
            let l = forward(&self.model, &mut self.cache, &[cur], Logits::Last)?.ok_or_else(|| SpecError::Invalid("draft forward returned no logits".into()))?;
            cur = argmax_rows(&l)?[0];
            out.push(cur);
        }
        Ok(out)
    }

    fn accept(&mut self, proposed: &[u32], accepted: usize) -> Result<()> {
        // The cache holds `last` and proposals 0..k-1 (the last proposal was never fed).
        let k = proposed.len();
        if accepted < k {
            self.cache.trim(k - 1 - accepted)?;
        } else if let Some(&d) = proposed.last() {
            forward(&self.model, &mut self.cache, &[d], Logits::None)?;
            self.cache.eval_with(&[])?;
        }
        Ok(())
    }
}

/// What a speculative run produced.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecOutput {
    pub tokens: Vec<u32>,
    /// Target forward calls (one per round).
    pub rounds: usize,
    /// Proposals made and accepted.
    pub proposed: usize,
    pub accepted: usize,
}

impl SpecOutput {
    /// Accepted / proposed.
    pub fn acceptance(&self) -> f64 {
        if self.proposed == 0 { 0.0 } else { self.accepted as f64 / self.proposed as f64 }
    }
}

/// Greedy speculative decoding: `max_new` tokens (fewer when one of `stop` comes, which is not
/// returned), `k` proposals per round. Equal to the target's plain greedy decoding.
pub fn generate_greedy(target: &Model, drafter: &mut dyn Drafter, prompt: &[u32], max_new: usize, k: usize, stop: &[u32]) -> Result<SpecOutput> {
    if prompt.is_empty() || k == 0 {
        return Err(SpecError::Invalid("need a non-empty prompt and k >= 1".into()));
    }
    let vocab = target.info().vocab_size as u32;
    if let Some(&t) = prompt.iter().find(|&&t| t >= vocab) {
        return Err(SpecError::Invalid(format!("prompt token {t} out of range for vocab size {vocab}")));
    }
    let mut cache = target.new_cache();
    cache.trim(0).map_err(|e| SpecError::Invalid(format!("the target's cache cannot roll back: {e}")))?;
    if prompt.len() > 1 {
        forward(target, &mut cache, &prompt[..prompt.len() - 1], Logits::None)?;
        cache.eval_with(&[])?;
    }
    drafter.prefill(prompt)?;
    let mut out = SpecOutput { tokens: Vec::new(), rounds: 0, proposed: 0, accepted: 0 };
    let mut last = prompt[prompt.len() - 1];
    while out.tokens.len() < max_new {
        let want = k.min(max_new - out.tokens.len());
        let drafts = drafter.propose(last, want)?;
        if drafts.iter().any(|&d| d >= vocab) {
            return Err(SpecError::Invalid("the drafter proposed a token outside the target's vocabulary".into()));
        }
        let mut seq = Vec::with_capacity(drafts.len() + 1);
        seq.push(last);
        seq.extend_from_slice(&drafts);
        let logits = forward(target, &mut cache, &seq, Logits::All)?.ok_or_else(|| SpecError::Invalid("target forward returned no logits".into()))?;
        let greedy = argmax_rows(&logits)?; // greedy[i]: the target's token after seq[..=i]
        let n = drafts.iter().zip(&greedy).take_while(|(d, g)| d == g).count();
        out.rounds += 1;
        out.proposed += drafts.len();
        out.accepted += n;
        // keep `last` and the accepted proposals in the cache; greedy[n] is the new `last`
        cache.trim(drafts.len() - n)?;
        drafter.accept(&drafts, n)?;
        for &t in drafts[..n].iter().chain(std::iter::once(&greedy[n])) {
            if stop.contains(&t) {
                return Ok(out);
            }
            out.tokens.push(t);
            if out.tokens.len() == max_new {
                return Ok(out);
            }
        }
        last = greedy[n];
    }
    Ok(out)
}
