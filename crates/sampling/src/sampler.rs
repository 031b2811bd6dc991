//! [`Sampler`]: one decoding step from `[B, V]` logits to token ids and log-probs.
use crate::config::SamplingConfig;
use crate::error::Result;
use crate::filters::{log_softmax, tempered_filtered};
use crate::penalties::{apply_penalties, rows_vocab};
use mlx_array::random::{categorical, Key};
use mlx_array::{Array, DType};

/// What a sampling step returns besides the tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SampleOptions {
    /// Also return the `n` most likely tokens of the processed distribution per row (sorted,
    /// most likely first); 0 = none. Capped at the vocabulary size.
    pub top_logprobs: usize,
    /// Also return the log-prob of each chosen token under the raw logits (no penalties, no
    /// temperature, no truncation), e.g. for RL rollouts.
    pub raw_logprobs: bool,
}

/// The `n` most likely alternatives per row.
#[derive(Debug, Clone)]
pub struct TopLogprobs {
    /// `[B, n]` u32 token ids, most likely first.
    pub ids: Array,
    /// `[B, n]` f32 log-probs of those tokens (processed distribution).
    pub logprobs: Array,
}

/// One step's result, still on the device (lazy); see [`Sample::to_host`].
#[derive(Debug, Clone)]
pub struct Sample {
    /// `[B]` u32 token ids.
    pub tokens: Array,
    /// `[B]` f32 log-prob of each token under the processed distribution (see [`Sampler`]).
    pub logprobs: Array,
    /// `[B]` f32 log-prob under the raw logits, when asked for.
    pub raw_logprobs: Option<Array>,
    /// The top-n alternatives, when asked for.
    pub top: Option<TopLogprobs>,
}

/// A [`Sample`] copied to the host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostSample {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub raw_logprobs: Option<Vec<f32>>,
    /// Per row, `(token id, log-prob)` most likely first.
    pub top: Option<Vec<Vec<(u32, f32)>>>,
}

impl Sample {
    fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![&self.tokens, &self.logprobs];
        v.extend(self.raw_logprobs.iter());
        if let Some(t) = &self.top {
            v.extend([&t.ids, &t.logprobs]);
        }
        v
    }

    /// Evaluate every array of this sample in one graph traversal.
    pub fn eval(&self) -> Result<()> {
        Ok(mlx_array::eval(&self.arrays())?)
    }

    /// Evaluate and copy out.
    pub fn to_host(&self) -> Result<HostSample> {
        self.eval()?;
        let top = match &self.top {
            None => None,
            Some(t) => {
                let n = t.ids.dim(-1)?;
                let (ids, lps) = (t.ids.to_vec::<u32>()?, t.logprobs.to_vec::<f32>()?);
                Some(ids.chunks(n.max(1)).zip(lps.chunks(n.max(1))).map(|(i, l)| i.iter().copied().zip(l.iter().copied()).collect()).collect())
            }
        };
        Ok(HostSample {
            tokens: self.tokens.to_vec::<u32>()?,
            logprobs: self.logprobs.to_vec::<f32>()?,
            raw_logprobs: self.raw_logprobs.as_ref().map(|a| a.to_vec::<f32>()).transpose()?,
            top,
        })
    }
}

/// A seeded sampler for one [`SamplingConfig`].
///
/// * Processing, in mlx-lm's order: logit bias, repetition penalty, presence penalty,
///   frequency penalty (all in f32, see [`crate::apply_penalties`]); then, unless greedy,
///   temperature and the truncation filters (see [`crate::filters`]).
/// * Greedy (temperature 0) takes the argmax of the penalised logits; its `logprobs` are
///   those of the penalised logits at temperature 1, untruncated (the T→0 limit would be a
///   point mass, log-prob 0). That is what mlx-lm's `generate_step` reports too.
/// * Otherwise the token is drawn from the processed distribution (penalties, temperature,
///   top-p ∩ min-p ∩ top-k, renormalised) and `logprobs` is its log-prob there.
///
/// Randomness: the sampler holds an MLX key made from the seed; each non-greedy step splits
/// it (one draw key, one carried on), so a seed fixes the whole token sequence, and greedy
/// steps consume nothing. Rows of a batch draw independently from one key.
pub struct Sampler {
    cfg: SamplingConfig,
    key: Key,
}

impl Sampler {
    /// Validate `cfg` and seed the key (from `cfg.seed`, or the clock when `None`).
    pub fn new(cfg: SamplingConfig) -> Result<Self> {
        cfg.validate()?;
        let seed = cfg.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
        });
        Ok(Sampler { key: Key::new(seed)?, cfg })
    }

    /// The (validated) settings.
    pub fn config(&self) -> &SamplingConfig {
        &self.cfg
    }

    /// Penalised f32 logits `[B, V]` (bias and penalties applied; see [`crate::apply_penalties`]).
    pub fn penalised(&self, logits: &Array, history: &[&[u32]]) -> Result<Array> {
        rows_vocab(logits)?;
        apply_penalties(&logits.astype(DType::F32)?, history, &self.cfg)
    }

    /// The processed distribution `[B, V]` as normalised log-probs (`-inf` = filtered out): the
    /// distribution a token is drawn from, or for greedy decoding the one its log-prob is
    /// reported under. For speculative-decoding acceptance and tests.
    pub fn distribution(&self, logits: &Array, history: &[&[u32]]) -> Result<Array> {
        let x = self.penalised(logits, history)?;
        if self.cfg.is_greedy() { log_softmax(&x) } else { tempered_filtered(&x, &self.cfg) }
    }

    /// One step: tokens and their log-probs. `logits` is `[B, V]` (any float dtype; the
    /// last position of the model's output), `history[r]` row `r`'s tokens so far (prompt +
    /// generated, oldest first), or `&[]` for none.
    pub fn sample(&mut self, logits: &Array, history: &[&[u32]]) -> Result<Sample> {
        self.sample_with(logits, history, &SampleOptions::default())
    }

    /// [`Sampler::sample`] with top-n alternatives and/or raw log-probs.
    pub fn sample_with(&mut self, logits: &Array, history: &[&[u32]], opts: &SampleOptions) -> Result<Sample> {
        let x = self.penalised(logits, history)?;
        let pick_col = |a: &Array, tokens: &Array| -> Result<Array> { Ok(a.take_along_axis(&tokens.expand_dims(-1)?, -1)?.squeeze(&[-1])?) };
        // Greedy: the argmax and x[t] - logsumexp(x), without materialising the log-softmax
        // (one primitive on the CPU: `Array::greedy_pick`).
        let (tokens, logprobs, lp) = if self.cfg.is_greedy() {
            let (tokens, logprobs) = x.greedy_pick()?;
            (tokens, logprobs, None)
        } else {
            let lp = tempered_filtered(&x, &self.cfg)?;
            let (next, draw) = self.key.split()?;
            self.key = next;
            let tokens = categorical(&lp, -1, &draw)?;
            (tokens.clone(), pick_col(&lp, &tokens)?, Some(lp))
        };
        let pick = |a: &Array| pick_col(a, &tokens);
        let raw_logprobs = if opts.raw_logprobs {
            let raw = logits.astype(DType::F32)?;
            Some(pick(&raw)?.sub(&raw.logsumexp(&[-1], false)?)?)
        } else {
            None
        };
        let top = if opts.top_logprobs > 0 {
            let full = match lp {
                Some(lp) => lp,
                None => log_softmax(&x)?,
            };
            Some(top_n(&full, opts.top_logprobs)?)
        } else {
            None
        };
        Ok(Sample { tokens, logprobs, raw_logprobs, top })
    }
}

/// The `n` largest entries per row of `[B, V]` log-probs, sorted descending.
fn top_n(lp: &Array, n: usize) -> Result<TopLogprobs> {
    let n = n.min(lp.dim(-1)?);
    let ids = lp.topk_indices(n, -1)?;
    let vals = lp.take_along_axis(&ids, -1)?;
    let order = vals.neg()?.argsort(-1)?;
    Ok(TopLogprobs { ids: ids.take_along_axis(&order, -1)?, logprobs: vals.take_along_axis(&order, -1)? })
}
