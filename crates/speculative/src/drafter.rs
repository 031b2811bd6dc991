//! The [`Drafter`] trait and the plain draft-model drafter.
use crate::tracked::{forward, row, Tracked};
use mlx_array::random::{categorical, Key};
use mlx_array::ops::{concatenate, GPU_PRODUCT_ATTENTION_MAX_QUERIES};
use mlx_array::{Array, DType};
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

/// A drafter's agreement with one history token ([`Drafter::agreement`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agreed {
    /// The token's index in the history.
    pub position: usize,
    /// Whether the drafter's greedy guess from the tokens before it was this token: whether a
    /// proposal from there would have had its first draft accepted at temperature 0 without
    /// penalties. A run of these from a position is how many drafts it would have had accepted.
    pub guessed: bool,
    /// At temperature > 0 (the sampling settings of [`Drafter::catch_up`]): the drafter's
    /// log-prob of the token under its processed distribution, `log q(x)`. With the target's
    /// own `log p(x)` of the sampled token, `min(1, q(x) / p(x))` is an unbiased estimate of
    /// the probability that a draft from there is accepted (`sum_y min(p(y), q(y))`).
    pub logprob: Option<f32>,
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
    /// The target's residual stream after each layer of [`Drafter::target_taps`] over
    /// `[last, drafts..]` (`[1, k + 1, H]` each; empty when no taps are asked for).
    pub taps: &'a [Array],
}

impl Feedback<'_> {
    /// The history after this verdict: the history, the accepted drafts, the target's token.
    pub fn next_history(&self) -> Vec<u32> {
        self.history
            .iter()
            .chain(&self.drafts[..self.accepted])
            .copied()
            .chain(std::iter::once(self.next))
            .collect()
    }
}

impl Draft {
    /// No proposals.
    pub fn empty() -> Self {
        Draft {
            tokens: Vec::new(),
            logprobs: None,
        }
    }
}

/// Proposes tokens for the target to verify.
pub trait Drafter: Send {
    /// Up to `k` tokens to follow `history` (context, prompt and generated tokens; the target
    /// has not seen its last token yet), drawn with `sampling` (greedy at temperature 0).
    fn propose(&mut self, history: &[u32], k: usize, sampling: &SamplingConfig) -> Result<Draft>;
    /// [`Drafter::propose`] at the start of a speculative cycle, where `target_cache` (the
    /// verifier's, flat or paged) holds the target's run over all of `history` but its last
    /// token: drafters that attend over the target's K/V read them there.
    fn propose_on(
        &mut self,
        history: &[u32],
        k: usize,
        sampling: &SamplingConfig,
        _target_cache: &mut Cache,
    ) -> Result<Draft> {
        self.propose(history, k, sampling)
    }
    /// Positions of the target the drafter has run through the target itself so far (to catch
    /// up with a history it did not follow), beyond the verifier's forwards.
    fn target_positions_run(&self) -> usize {
        0
    }
    /// Called while the target's forward over the last proposals runs (queued, not yet read),
    /// at temperature 0 without penalties: draft up to `steps` forwards past `history` and
    /// `drafts` (the last [`Drafter::propose`]'s arguments and result) as if the target accepts
    /// every draft and its own token is the drafter's next guess, so that the host works
    /// while the device verifies; with `until`, stop before a forward once it returns true
    /// (the verify's result is ready: [`Array::is_available`]). A later `propose` whose
    /// history the guesses continue starts from them; one that departs from them rolls them
    /// back. Default: nothing (drafters that read the verdict's hidden states cannot run ahead
    /// of it).
    fn draft_ahead(&mut self, _history: &[u32], _drafts: &[u32], _steps: usize, _until: Option<&dyn Fn() -> bool>) -> Result<()> {
        Ok(())
    }
    /// Whether [`Drafter::draft_ahead`] drafts anything: a drafter that overrides it says so
    /// here, and [`crate::SpeculativeDecoder::with_draft_ahead`] refuses to run ahead with one
    /// that does not. Default: `false`.
    fn runs_ahead(&self) -> bool {
        false
    }
    /// A plain stretch of adaptive depth ran: `history` grew past what the drafter has seen.
    /// A drafter that catches up over skipped tokens through its own forwards (a draft model)
    /// lacking more than `window` of them starts over from the last `window` tokens of
    /// `history` at its next proposal instead, so that a probe after a long stretch catches up
    /// over at most `window` tokens (drafts from a shorter context; the verifier keeps the
    /// output exact whatever the drafts). Default: nothing (drafters that read the target's
    /// states do not catch up).
    fn skipped(&mut self, _history: &[u32], _window: usize) {}
    /// A plain stretch is under way and `history` holds its tokens so far: a drafter that
    /// catches up over skipped tokens runs all but the newest now (queued), as its next
    /// proposal would, so that the probe after the stretch has little left to catch up over.
    /// `window` is as in [`Drafter::skipped`], counted in tokens of the history so far: the
    /// decoder passes the part of its window the stretch has produced, so that a context
    /// starts over where the stretch's end would start it. `sampling` is the target's sampler
    /// settings: at temperature > 0 a drafter that measures its agreement
    /// ([`Drafter::agreement`]) notes its processed log-prob of each next token under them.
    /// Only worth it where the forwards run beside the target's steps ([`crate::Background`]);
    /// the decoder asks nothing else. Default: nothing.
    fn catch_up(&mut self, _history: &[u32], _window: usize, _sampling: &SamplingConfig) -> Result<()> {
        Ok(())
    }
    /// Whether [`Drafter::agreement`] measures anything. Default: `false`.
    fn measures_agreement(&self) -> bool {
        false
    }
    /// What [`Drafter::catch_up`] has learned since the last call (or the last
    /// [`Drafter::prefill`]), in order: for each history token it ran, an [`Agreed`] on the
    /// history's next token (teacher-forced agreement, measured for the price of the
    /// catch-up's logits). Waits for the catch-ups queued so far. Default: nothing measured
    /// (empty).
    fn agreement(&mut self) -> Result<Vec<Agreed>> {
        Ok(Vec::new())
    }
    /// The history may reach `positions` tokens in this generation
    /// ([`mlx_models::Speculator::reserve`]): a drafter with flat K/V storage of its own sizes
    /// it for them ([`Cache::reserve`]) when it next runs, so that it does not regrow while
    /// drafting. Default: nothing.
    fn reserve(&mut self, _positions: usize) {}
    /// The target has just run `history` (the context and the prompt of a new generation):
    /// a drafter that keeps a context of its own may run it now (queued), so that its first
    /// proposal does not catch up over the prompt ([`mlx_models::Speculator::prefill`]).
    /// Default: nothing.
    fn prefill(&mut self, _history: &[u32]) -> Result<()> {
        Ok(())
    }
    /// Compute every lazy array the drafter keeps (its cache, pending guesses, its RNG key)
    /// and wait for its queued work, so that it can move to another thread: MLX evaluates an
    /// array only on the thread that made it ([`crate::Background`] settles a drafter before
    /// it moves in either direction). Default: nothing (a drafter keeping no arrays of its own).
    fn settle(&mut self) -> Result<()> {
        Ok(())
    }
    /// The verdict on the last proposals.
    fn feedback(&mut self, _f: &Feedback<'_>) -> Result<()> {
        Ok(())
    }
    /// Whether [`Feedback::hidden`] is wanted (the target's forward then returns hidden states).
    fn wants_target_hidden(&self) -> bool {
        false
    }
    /// Target layers whose residual stream [`Feedback::taps`] should carry (strictly ascending).
    fn target_taps(&self) -> &[usize] {
        &[]
    }
    /// The bytes of the drafter's own stored weights, where it has a checkpoint of its own
    /// (`None`: unknown, or weights shared with the target). With adaptive depth, a drafter at
    /// least as heavy as its target is never asked ([`crate::SpeculativeDecoder::adaptive`]).
    fn weight_bytes(&self) -> Option<u64> {
        None
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

    /// Compute the current key ([`Drafter::settle`]).
    pub(crate) fn eval(&self) -> Result<()> {
        match &self.key {
            Some((_, k)) => Ok(k.as_array().eval()?),
            None => Ok(()),
        }
    }

    pub(crate) fn get(&mut self, cfg: &SamplingConfig) -> Result<&mut Key> {
        if self.key.as_ref().is_none_or(|(s, _)| *s != cfg.seed) {
            self.key = Some((cfg.seed, key_for(cfg, self.salt)?));
        }
        Ok(&mut self.key.as_mut().expect("set above").1)
    }
}

/// The draws of one proposal under the target's sampler settings: each draft token (argmax
/// when greedy, else drawn with the drafter's key) and the processed distribution it came from.
/// With settings that read the history (penalties) every draw sees the history and the drafts
/// before it, so each token reaches the host before the next draw.
pub(crate) struct Drawer<'a> {
    cfg: &'a SamplingConfig,
    sampler: Sampler,
    greedy: bool,
    host: bool,
    hist: Vec<u32>,
    toks: Vec<Array>,
    lps: Vec<Array>,
}

impl<'a> Drawer<'a> {
    pub(crate) fn new(cfg: &'a SamplingConfig, history: &[u32], k: usize) -> Result<Self> {
        let host = reads_history(cfg);
        Ok(Drawer {
            sampler: sampler_for(cfg)?,
            greedy: cfg.is_greedy(),
            host,
            hist: if host { history.to_vec() } else { Vec::new() },
            toks: Vec::with_capacity(k),
            lps: Vec::with_capacity(k),
            cfg,
        })
    }

    /// Drafts already drawn before this proposal's forwards (greedy, no penalties: the
    /// guesses of [`Drafter::draft_ahead`]).
    pub(crate) fn known(&mut self, toks: &[u32]) -> Result<()> {
        debug_assert!(self.greedy && !self.host);
        self.toks.push(Array::from_slice(toks, &[toks.len()])?);
        Ok(())
    }

    /// One draft from `logits` (`[1, V]`): the token, `[1]` u32.
    pub(crate) fn draw(&mut self, logits: &Array, key: &mut SeededKey) -> Result<Array> {
        let rows: [&[u32]; 1] = [self.hist.as_slice()];
        let hist: &[&[u32]] = if self.host { &rows } else { &[] };
        let err = |e: sampling::SamplingError| ModelError::InvalidInput(e.to_string());
        let t = if self.greedy {
            // the argmax of the penalised logits is the greedy distribution's (no log-softmax)
            let x = if self.host { self.sampler.penalised(logits, hist).map_err(err)? } else { logits.clone() };
            x.argmax(-1, false)?
        } else {
            let lp = self.sampler.distribution(logits, hist).map_err(err)?;
            let t = categorical(&lp, -1, &split(key.get(self.cfg)?)?)?;
            self.lps.push(lp);
            t
        }
        .astype(DType::U32)?;
        if self.host {
            self.hist.push(t.to_vec::<u32>()?[0]);
        }
        self.toks.push(t.clone());
        Ok(t)
    }

    /// The proposal, evaluated together with `extra` arrays the caller reads next.
    pub(crate) fn finish(self, extra: &[&Array]) -> Result<Draft> {
        let cat = |v: &[Array]| concatenate(&v.iter().collect::<Vec<_>>(), 0);
        let tokens = cat(&self.toks)?;
        let logprobs = if self.greedy || self.lps.is_empty() {
            None
        } else {
            Some(cat(&self.lps)?)
        };
        let mut outs = vec![&tokens];
        outs.extend(logprobs.iter());
        outs.extend(extra.iter().copied());
        mlx_array::eval(&outs)?;
        Ok(Draft {
            tokens: tokens.to_vec::<u32>()?,
            logprobs,
        })
    }
}

/// A smaller LM sharing the target's vocabulary (e.g. Qwen3-0.6B for Qwen3-8B), decoding with
/// its own cache and the target's sampler settings.
pub struct DraftModel {
    model: Model,
    cache: Cache,
    tracked: Tracked,
    key: SeededKey,
    depth: usize,
    catch_up_pieces: Option<usize>,
    ahead: Option<Ahead>,
    reused: usize,
    proposals: usize,
    /// The history position the draft's context starts at (`tracked` holds the tokens from
    /// there): 0 unless [`Drafter::skipped`] cut the context to a window.
    start: usize,
    /// The start of a window to begin the next proposal from ([`Drafter::skipped`]).
    restart: Option<usize>,
    restarts: usize,
    /// Positions to size the cache's flat storage for ([`Drafter::reserve`]).
    reserve: usize,
    /// Tokens run by [`Drafter::catch_up`], over its life.
    caught_up: usize,
    /// [`Drafter::catch_up`]'s pieces, not yet read, for [`Drafter::agreement`].
    guessed: Vec<Guessed>,
}

/// What a catch-up's agreement is measured against ([`DraftModel::feed`]).
struct Next<'a> {
    /// The history: the tokens after those fed start at `at`.
    history: &'a [u32],
    at: usize,
    /// The target's sampler settings.
    sampling: &'a SamplingConfig,
}

/// One piece of a catch-up, for [`Drafter::agreement`].
struct Guessed {
    /// The history index of `next[0]`.
    at: usize,
    /// `[n]` u32: the greedy guess after each token of the piece.
    guesses: Array,
    /// The history's next tokens.
    next: Vec<u32>,
    /// At temperature > 0, `[n]` f32: the processed log-prob of each next token.
    logprobs: Option<Array>,
}

/// Greedy guesses drawn by [`Drafter::draft_ahead`], not yet read on the host.
struct Ahead {
    /// The tokens they follow: the history and drafts of the proposal they continue.
    base: Vec<u32>,
    /// `[n]` u32: each follows `base` and the guesses before it; all but the last are in the
    /// cache (after `base`), which [`Tracked`] does not know yet.
    guesses: Array,
}

impl DraftModel {
    /// Proposals per cycle by default (as mlx-lm's `--num-draft-tokens`).
    pub const DEFAULT_DEPTH: usize = 3;

    /// A drafter over `model`; on a GPU its catching up runs in pieces of
    /// [`GPU_PRODUCT_ATTENTION_MAX_QUERIES`] tokens ([`DraftModel::with_catch_up_pieces`]).
    pub fn new(model: Model) -> Self {
        let cache = model.new_cache();
        let gpu = mlx_array::default_device().is_ok_and(|d| d == mlx_array::Device::Gpu);
        DraftModel {
            model,
            cache,
            tracked: Tracked::new(Vec::new()),
            key: SeededKey::new(1),
            depth: Self::DEFAULT_DEPTH,
            catch_up_pieces: gpu.then_some(GPU_PRODUCT_ATTENTION_MAX_QUERIES),
            ahead: None,
            reused: 0,
            proposals: 0,
            start: 0,
            restart: None,
            restarts: 0,
            reserve: 0,
            caught_up: 0,
            guessed: Vec::new(),
        }
    }

    /// Proposals asked of this drafter ([`Drafter::propose`] calls with `k > 0`), over its life.
    pub fn proposals(&self) -> usize {
        self.proposals
    }

    /// Drafts taken from [`Drafter::draft_ahead`]'s guesses instead of a forward, over this
    /// drafter's life.
    pub fn reused_drafts(&self) -> usize {
        self.reused
    }

    /// Times the draft started over from a window of the history instead of catching up
    /// ([`Drafter::skipped`]), over this drafter's life.
    pub fn restarts(&self) -> usize {
        self.restarts
    }

    /// Tokens run during plain stretches ([`Drafter::catch_up`]), over this drafter's life.
    pub fn caught_up(&self) -> usize {
        self.caught_up
    }

    /// A typed error for a token outside the draft's vocabulary.
    fn check_vocab(&self, history: &[u32]) -> Result<()> {
        let vocab = self.model.info().vocab_size;
        match history.iter().find(|&&t| t as usize >= vocab) {
            Some(&t) => Err(ModelError::InvalidInput(format!(
                "token {t} is outside the draft model's vocabulary of {vocab}"
            ))),
            None => Ok(()),
        }
    }

    /// Roll the cache back to its longest prefix of `before`'s context (starting over from
    /// the history's start when they share nothing, or from a window due after a plain
    /// stretch), size its storage and snapshot it there: returns the tokens of the context it
    /// lacks.
    fn hold_prefix(&mut self, before: &[u32]) -> Result<Vec<u32>> {
        let model = self.model.clone();
        let fresh = || model.new_cache();
        // a context sharing nothing with `before` from its start (a new generation, or a
        // history shorter than the window's start): the whole history (a rollback to nothing
        // can also be a recurrent cache restored to its window's start, which keeps the window)
        if self.start > 0 && self.tracked.common_prefix(context(self.start, before)) == 0 {
            self.start = 0;
        }
        let mut held = self.tracked.rollback(&mut self.cache, context(self.start, before), Some(&fresh))?;
        // a window after a plain stretch: start over from it
        if let Some(from) = self.restart.take().filter(|&f| f > self.start + held && f < before.len()) {
            self.cache = fresh();
            self.tracked.reset(Vec::new());
            (self.start, held) = (from, 0);
            self.restarts += 1;
        }
        self.cache.reserve(self.reserve)?;
        self.tracked.snapshot(&self.cache);
        Ok(context(self.start, before)[held..].to_vec())
    }

    /// Run `toks` into the cache in pieces of [`DraftModel::with_catch_up_pieces`] (queued, not
    /// waited for): without logits, or with `next` (the history tokens after `toks`) keeping
    /// each piece's greedy guesses, and at temperature > 0 its processed log-probs of the next
    /// tokens, for [`Drafter::agreement`].
    fn feed(&mut self, toks: &[u32], next: Option<Next<'_>>) -> Result<()> {
        if toks.is_empty() {
            return Ok(());
        }
        debug_assert!(next.as_ref().is_none_or(|n| n.at + toks.len() <= n.history.len()));
        let piece = self.catch_up_pieces.unwrap_or(toks.len());
        let logits = if next.is_some() { Logits::All } else { Logits::None };
        let sampler = match &next {
            Some(n) if !n.sampling.is_greedy() => Some(sampler_for(n.sampling)?),
            _ => None,
        };
        let from = self.guessed.len();
        for (i, p) in toks.chunks(piece).enumerate() {
            let out = forward(&self.model, &mut self.cache, &row(p)?, logits, false)?;
            self.tracked.fed(p);
            if let Some(n) = &next {
                let logits = out.logits.ok_or_else(|| ModelError::Cache("draft forward returned no logits".into()))?;
                let rows = logits.reshape(&[p.len() as i32, -1])?;
                let at = n.at + i * piece;
                let following = n.history[at..at + p.len()].to_vec();
                let logprobs = match &sampler {
                    Some(sampler) => {
                        // each row's history: the tokens before its next one
                        let hists: Vec<&[u32]> = if reads_history(n.sampling) { (0..p.len()).map(|r| &n.history[..at + r]).collect() } else { Vec::new() };
                        let lp = sampler.distribution(&rows, &hists).map_err(|e| ModelError::InvalidInput(e.to_string()))?;
                        let idx = Array::from_slice(&following, &[p.len(), 1])?;
                        Some(lp.take_along_axis(&idx, -1)?.reshape(&[-1])?)
                    }
                    None => None,
                };
                let guesses = rows.argmax(-1, false)?.astype(DType::U32)?;
                self.guessed.push(Guessed { at, guesses, next: following, logprobs });
            }
        }
        let queued: Vec<&Array> = self.guessed[from..].iter().flat_map(|g| std::iter::once(&g.guesses).chain(g.logprobs.iter())).collect();
        self.cache.async_eval_with(&queued)
    }

    /// One forward of `toks` (`[1, L]`) into the draft's cache: the last position's logits,
    /// `[1, V]`.
    fn last_logits(&mut self, toks: &Array) -> Result<Array> {
        let out = forward(&self.model, &mut self.cache, toks, Logits::Last, false)?;
        Ok(out
            .logits
            .ok_or_else(|| ModelError::Cache("draft forward returned no logits".into()))?
            .reshape(&[1, -1])?)
    }

    /// Read the pending guesses: the cache then holds (and [`Tracked`] knows) all but the last;
    /// returns the chain `base` + guesses, each guess the greedy draft after the tokens before
    /// it.
    fn resolve_ahead(&mut self) -> Result<Option<Vec<u32>>> {
        let Some(Ahead { mut base, guesses }) = self.ahead.take() else {
            return Ok(None);
        };
        let g = guesses.to_vec::<u32>()?;
        self.tracked.fed(&g[..g.len() - 1]);
        base.extend_from_slice(&g);
        Ok(Some(base))
    }

    /// Run the tokens the draft's cache lacks (the history since it last drafted: a whole plain
    /// stretch of adaptive depth) in forwards of at most `n` tokens (`None`: in one). On a GPU
    /// the default keeps each piece's attention as matrix products, where libmlx's fused
    /// attention would build a cuDNN graph for every new length (tens of ms, more than the
    /// pieces cost). `Some(0)` counts as `None`.
    pub fn with_catch_up_pieces(mut self, n: Option<usize>) -> Self {
        self.catch_up_pieces = n.filter(|&n| n > 0);
        self
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The draft's own cache (its K/V over the context it drafts from).
    pub fn cache(&self) -> &Cache {
        &self.cache
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
            return Ok(Draft::empty());
        }
        self.proposals += 1;
        self.check_vocab(history)?;
        let model = self.model.clone();
        let fresh = || model.new_cache();
        // guesses drawn ahead that continue `history` are the first drafts (the cache holds
        // all but the last of them)
        let chain = self.resolve_ahead()?;
        let known: Vec<u32> = match chain {
            Some(c) if cfg.is_greedy() && !reads_history(cfg) && c.len() > history.len() && c.starts_with(history) => {
                c[history.len()..].iter().take(k).copied().collect()
            }
            _ => Vec::new(),
        };
        let mut drawer = Drawer::new(cfg, history, k)?;
        let first = if let Some((&newest, held_known)) = known.split_last() {
            let want: Vec<u32> = context(self.start, history).iter().chain(held_known).copied().collect();
            // trims only: [`Drafter::draft_ahead`] runs ahead where the cache can trim back
            self.tracked.sync(&model, &mut self.cache, &want, Some(&fresh))?;
            self.cache.reserve(self.reserve)?;
            self.tracked.snapshot(&self.cache);
            self.reused += known.len();
            drawer.known(&known)?;
            if known.len() == k {
                return drawer.finish(&[]);
            }
            vec![newest]
        } else {
            // the tokens of `before` the cache lacks (the last cycle's final draft and the
            // target's token, typically) run in the first draft forward, ahead of `last`
            let mut first = self.hold_prefix(before)?;
            first.push(last);
            // all but the last piece (1..=piece tokens) fed ahead of the first draw
            let head = self.catch_up_pieces.map_or(0, |p| (first.len() - 1) / p * p);
            self.feed(&first[..head], None)?;
            first.drain(..head);
            first
        };
        let mut cur = row(&first)?;
        for i in known.len()..k {
            let logits = self.last_logits(&cur)?;
            if i == known.len() {
                self.tracked.fed(&first);
            }
            cur = drawer.draw(&logits, &mut self.key)?.reshape(&[1, 1])?;
            // the last draw is not fed: its K/V would be rolled back whatever the verdict
            if i + 1 < k {
                self.cache.async_eval_with(&[&cur])?;
            }
        }
        let draft = drawer.finish(&[])?;
        // fed after `first`: the drafts after the known ones, all but the last
        let from = known.len();
        self.tracked
            .tokens
            .extend_from_slice(&draft.tokens[from..k - 1]);
        Ok(draft)
    }

    fn runs_ahead(&self) -> bool {
        true
    }
    fn draft_ahead(&mut self, history: &[u32], drafts: &[u32], steps: usize, until: Option<&dyn Fn() -> bool>) -> Result<()> {
        let Some((&newest, fed)) = drafts.split_last() else {
            return Ok(());
        };
        // only straight after the proposal of `drafts` (its cache state)
        let full = history;
        let history = context(self.start, full);
        let holds_proposal = self.ahead.is_none()
            && self.tracked.tokens.len() == history.len() + fed.len()
            && self.tracked.tokens.starts_with(history)
            && self.tracked.tokens.ends_with(fed);
        // a rejection of the first draft drops the drafts and the guesses
        if steps == 0 || !holds_proposal || !self.cache.can_trim((drafts.len() + steps).min(self.cache.offset())) {
            return Ok(());
        }
        let mut guesses = Vec::with_capacity(steps);
        let mut cur = row(&[newest])?;
        for i in 0..steps {
            if until.is_some_and(|ready| ready()) {
                break;
            }
            let logits = self.last_logits(&cur)?;
            if i == 0 {
                self.tracked.fed(&[newest]);
            }
            let g = logits.argmax(-1, false)?.astype(DType::U32)?;
            cur = g.reshape(&[1, 1])?;
            self.cache.async_eval_with(&[&cur])?;
            guesses.push(g);
        }
        if guesses.is_empty() {
            return Ok(());
        }
        let base: Vec<u32> = full.iter().chain(drafts).copied().collect();
        let guesses = concatenate(&guesses.iter().collect::<Vec<_>>(), 0)?;
        self.ahead = Some(Ahead { base, guesses });
        Ok(())
    }

    fn settle(&mut self) -> Result<()> {
        if let Some(a) = &self.ahead {
            a.guesses.eval()?;
        }
        self.cache.eval_with(&[])?;
        self.key.eval()?;
        Ok(mlx_array::synchronize()?)
    }

    fn skipped(&mut self, history: &[u32], window: usize) {
        // the context the cache may hold: `tracked` over the history from `start` (drafts past
        // it are rolled back at the next proposal)
        let ctx = context(self.start, history);
        let held = self.tracked.common_prefix(ctx);
        let lacking = ctx.len() - held;
        self.restart = (held > 0 && lacking > window).then(|| history.len() - window);
    }

    fn catch_up(&mut self, history: &[u32], window: usize, sampling: &SamplingConfig) -> Result<()> {
        let Some((_, before)) = history.split_last() else { return Ok(()) };
        self.check_vocab(history)?;
        // a window too short to be fed from: its start would be taken as a context of nothing
        // (a new history) at the next proposal
        if window <= 1 {
            return Ok(());
        }
        self.resolve_ahead()?;
        self.skipped(before, window - 1);
        let rest = self.hold_prefix(before)?;
        self.caught_up += rest.len();
        // the token after each: the rest of `rest`, then the history's newest
        let next = Next { history, at: history.len() - rest.len(), sampling };
        self.feed(&rest, Some(next))
    }

    fn measures_agreement(&self) -> bool {
        true
    }

    fn agreement(&mut self) -> Result<Vec<Agreed>> {
        let guessed = std::mem::take(&mut self.guessed);
        mlx_array::eval(&guessed.iter().flat_map(|g| std::iter::once(&g.guesses).chain(g.logprobs.iter())).collect::<Vec<_>>())?;
        let mut agreed = Vec::new();
        for g in guessed {
            let lps = g.logprobs.as_ref().map(|l| l.to_vec::<f32>()).transpose()?;
            for (i, (guess, next)) in g.guesses.to_vec::<u32>()?.iter().zip(&g.next).enumerate() {
                agreed.push(Agreed { position: g.at + i, guessed: guess == next, logprob: lps.as_ref().map(|l| l[i]) });
            }
        }
        Ok(agreed)
    }

    fn reserve(&mut self, positions: usize) {
        self.reserve = positions;
    }

    fn prefill(&mut self, history: &[u32]) -> Result<()> {
        self.check_vocab(history)?;
        // a new history: what catching up learned of the last one is stale
        self.guessed.clear();
        // guesses drawn ahead in an earlier generation: the cache holds them
        self.resolve_ahead()?;
        let rest = self.hold_prefix(history)?;
        self.feed(&rest, None)
    }

    fn weight_bytes(&self) -> Option<u64> {
        mlx_models::weights::checkpoint_bytes(self.model.dir()).ok().flatten()
    }

    fn vocab_size(&self) -> usize {
        self.model.info().vocab_size
    }

    fn default_depth(&self) -> usize {
        self.depth
    }
}

/// The part of `history` a draft context starting at `start` covers (all of it when `history`
/// is shorter).
fn context(start: usize, history: &[u32]) -> &[u32] {
    &history[start.min(history.len())..]
}

/// A fresh subkey of `key` (which advances).
pub(crate) fn split(key: &mut Key) -> Result<Key> {
    let (next, d) = key.split()?;
    *key = next;
    Ok(d)
}
