//! The [`Drafter`] trait and the plain draft-model drafter.
use crate::tracked::{forward, Tracked};
use mlx_array::random::{categorical, Key};
use mlx_array::{ops::concatenate, Array, DType};
use mlx_models::{Cache, Logits, Model, ModelError, Result};
use sampling::{Sampler, SamplingConfig};

/// A cycle's proposals.
#[derive(Debug, Clone)]
pub struct Draft {
    /// Up to `k` proposed tokens.
    pub tokens: Vec<u32>,
    /// `[tokens.len(), V]` normalised log-probs of the distribution each token was drawn from,
    /// with the target's sampler settings applied (temperature > 0 only; `None` when greedy).
    pub logprobs: Option<Array>,
}

/// What the target decided about the last proposals, for drafters that learn from it.
pub struct Feedback<'a> {
    /// The history the proposals followed (ending with the token the target had not seen).
    pub history: &'a [u32],
    /// The proposals and how many of them were accepted.
    pub drafts: &'a [u32],
    pub accepted: usize,
    /// The target's own token after the accepted drafts.
    pub next: u32,
    /// The target's final-normed hidden states over `[last, drafts..]` (`[1, k + 1, H]`), when
    /// [`Drafter::wants_target_hidden`].
    pub hidden: Option<&'a Array>,
}

/// Proposes tokens for the target to verify.
pub trait Drafter: Send {
    /// Up to `k` tokens to follow `history` (context, prompt and generated tokens; the target
    /// has not seen its last token yet), drawn with `sampling` (greedy at temperature 0).
    fn propose(&mut self, history: &[u32], k: usize, sampling: &SamplingConfig) -> Result<Draft>;
    /// The verdict on the last proposals.
    fn feedback(&mut self, _f: &Feedback<'_>) -> Result<()> {
        Ok(())
    }
    /// Whether [`Feedback::hidden`] is wanted (the target's forward then returns hidden states).
    fn wants_target_hidden(&self) -> bool {
        false
    }
    /// The vocabulary size of the draft distribution.
    fn vocab_size(&self) -> usize;
    /// Proposals per cycle when the caller does not say.
    fn default_depth(&self) -> usize;
    /// The most proposals per cycle, where the drafter has a limit (a requested depth is
    /// clamped to `1..=max`).
    fn max_depth(&self) -> Option<usize> {
        None
    }
}

/// Whether `cfg` reads the token history (penalties): then every draw must reach the host
/// before the next one.
pub(crate) fn reads_history(cfg: &SamplingConfig) -> bool {
    cfg.repetition_penalty != 1.0 || cfg.presence_penalty != 0.0 || cfg.frequency_penalty != 0.0
}

/// A sampler for `cfg` (its seed only matters for [`Sampler::sample`], unused here).
pub(crate) fn sampler_for(cfg: &SamplingConfig) -> Result<Sampler> {
    Sampler::new(SamplingConfig {
        seed: Some(0),
        ..cfg.clone()
    })
    .map_err(|e| ModelError::InvalidInput(e.to_string()))
}

/// A key seeded from `cfg.seed` mixed with `salt` (the clock when unseeded).
fn key_for(cfg: &SamplingConfig, salt: u64) -> Result<Key> {
    let seed = cfg.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    Ok(Key::new(seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))?)
}

/// An RNG key that follows the sampler settings' seed: made by [`key_for`] on first use and
/// whenever `cfg.seed` changes, advanced by every draw. Each user has its own `salt`.
pub(crate) struct SeededKey {
    salt: u64,
    key: Option<(Option<u64>, Key)>,
}

impl SeededKey {
    pub(crate) fn new(salt: u64) -> Self {
        SeededKey { salt, key: None }
    }

    pub(crate) fn get(&mut self, cfg: &SamplingConfig) -> Result<&mut Key> {
        if self.key.as_ref().is_none_or(|(s, _)| *s != cfg.seed) {
            self.key = Some((cfg.seed, key_for(cfg, self.salt)?));
        }
        Ok(&mut self.key.as_mut().expect("set above").1)
    }
}

/// One draft draw from `logits` (`[1, V]`) under `sampler` (the target's settings `cfg`): the
/// token (argmax when `greedy`, else drawn with `key`) and the processed log-distribution. With
/// `host` (settings that read the history) the penalties see `hist`, and the token joins it.
pub(crate) fn draw(
    sampler: &Sampler,
    logits: &Array,
    hist: &mut Vec<u32>,
    host: bool,
    greedy: bool,
    key: &mut SeededKey,
    cfg: &SamplingConfig,
) -> Result<(Array, Array)> {
    let rows: [&[u32]; 1] = [hist.as_slice()];
    let lp = sampler
        .distribution(logits, if host { &rows } else { &[] })
        .map_err(|e| ModelError::InvalidInput(e.to_string()))?;
    let t = if greedy {
        lp.argmax(-1, false)?
    } else {
        categorical(&lp, -1, &split(key.get(cfg)?)?)?
    }
    .astype(DType::U32)?;
    if host {
        hist.push(t.to_vec::<u32>()?[0]);
    }
    Ok((t, lp))
}

/// A smaller LM sharing the target's vocabulary (e.g. Qwen3-0.6B for Qwen3-8B), decoding with
/// its own cache and the target's sampler settings.
pub struct DraftModel {
    model: Model,
    cache: Cache,
    tracked: Tracked,
    key: SeededKey,
    depth: usize,
}

impl DraftModel {
    /// Proposals per cycle by default (as mlx-lm's `--num-draft-tokens`).
    pub const DEFAULT_DEPTH: usize = 3;

    pub fn new(model: Model) -> Self {
        let cache = model.new_cache();
        DraftModel {
            model,
            cache,
            tracked: Tracked::new(Vec::new()),
            key: SeededKey::new(1),
            depth: Self::DEFAULT_DEPTH,
        }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

}

impl Drafter for DraftModel {
    fn propose(&mut self, history: &[u32], k: usize, cfg: &SamplingConfig) -> Result<Draft> {
        let Some((&last, before)) = history.split_last() else {
            return Err(ModelError::InvalidInput(
                "drafting needs a non-empty history".into(),
            ));
        };
        if k == 0 {
            return Ok(Draft {
                tokens: Vec::new(),
                logprobs: None,
            });
        }
        let vocab = self.model.info().vocab_size;
        if let Some(&t) = history.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!(
                "token {t} is outside the draft model's vocabulary of {vocab}"
            )));
        }
        let model = self.model.clone();
        let fresh = || model.new_cache();
        self.tracked
            .sync(&self.model, &mut self.cache, before, Some(&fresh))?;
        self.tracked.snapshot(&self.cache);
        let sampler = sampler_for(cfg)?;
        let greedy = cfg.is_greedy();
        let host = reads_history(cfg);
        let mut hist: Vec<u32> = if host { history.to_vec() } else { Vec::new() };
        let mut toks: Vec<Array> = Vec::with_capacity(k);
        let mut lps: Vec<Array> = Vec::with_capacity(k);
        let mut cur = Array::from_slice(&[last], &[1, 1])?;
        for i in 0..k {
            let out = forward(&self.model, &mut self.cache, &cur, Logits::Last, false)?;
            let logits = out
                .logits
                .ok_or_else(|| ModelError::Cache("draft forward returned no logits".into()))?
                .reshape(&[1, -1])?;
            let (t, lp) = draw(&sampler, &logits, &mut hist, host, greedy, &mut self.key, cfg)?;
            cur = t.reshape(&[1, 1])?;
            toks.push(t);
            if !greedy {
                lps.push(lp);
            }
            // the last draw is not fed: its K/V would be rolled back whatever the verdict
            if i + 1 < k {
                self.cache.async_eval_with(&[&cur])?;
            }
        }
        let tokens = concatenate(&toks.iter().collect::<Vec<_>>(), 0)?;
        let logprobs = if greedy {
            None
        } else {
            Some(concatenate(&lps.iter().collect::<Vec<_>>(), 0)?)
        };
        let mut outs = vec![&tokens];
        outs.extend(logprobs.iter());
        mlx_array::eval(&outs)?;
        let tokens = tokens.to_vec::<u32>()?;
        self.tracked.tokens.push(last);
        self.tracked.tokens.extend_from_slice(&tokens[..k - 1]);
        Ok(Draft { tokens, logprobs })
    }

    fn vocab_size(&self) -> usize {
        self.model.info().vocab_size
    }

    fn default_depth(&self) -> usize {
        self.depth
    }
}

/// A fresh subkey of `key` (which advances).
pub(crate) fn split(key: &mut Key) -> Result<Key> {
    let (next, d) = key.split()?;
    *key = next;
    Ok(d)
}
