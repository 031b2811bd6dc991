//! Token generation: chunked prefill, then sampled decode with stop tokens, stop guards,
//! forced tokens and cancellation. Decode is pipelined as in mlx-lm: step `n + 1` is queued
//! (`async_eval`) before token `n` is read back, so the host never waits on an idle device.
use crate::cache::Cache;
use crate::model::Model;
use crate::runtime::Logits;
use crate::{ModelError, Result};
use mlx_array::Array;
use sampling::{Sampler, SamplingConfig, StopGuard};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token was produced (it is not part of the output).
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// The model produced tool calls (set by chat sessions).
    ToolCalls,
    /// A repetition stop guard fired.
    Repetition,
    /// The [`CancelHandle`] was triggered.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Repetition => "repetition",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Settings of one generation.
#[derive(Debug, Clone)]
pub struct GenerateConfig {
    pub max_new_tokens: usize,
    pub sampling: SamplingConfig,
    /// Prompt tokens per prefill forward pass (bounds activation memory); 0 = all at once.
    pub prefill_step_size: usize,
    /// Stop tokens; `None` = the model's eos ids.
    pub stop_tokens: Option<Vec<u32>>,
    /// The tokens already in the cache before the prompt (a continued conversation): the
    /// repetition, presence and frequency penalties count them with the prompt.
    pub context: Vec<u32>,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        GenerateConfig { max_new_tokens: 256, sampling: SamplingConfig::default(), prefill_step_size: 2048, stop_tokens: None, context: Vec::new() }
    }
}

/// Stops a running generation from another thread.
#[derive(Clone, Default, Debug)]
pub struct CancelHandle(Arc<AtomicBool>);

impl CancelHandle {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Timings of one generation.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Performance {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Start to first generated token (prefill included), ms.
    pub ttft_ms: f64,
    pub prefill_tokens_per_sec: f64,
    pub decode_tokens_per_sec: f64,
    /// Speculative decoding's counters, when a [`Speculator`] ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeStats>,
}

/// Counters of speculative decoding over one generation.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SpeculativeStats {
    /// Cycles: one target forward call each (drafts verified, or a plain step when none were
    /// drafted, which counts as depth 0).
    pub cycles: usize,
    /// Accepted draft tokens per cycle (the target's own token of each cycle not counted).
    pub accepted_mean: f64,
    /// Tokens per cycle: the accepted drafts and the target's own token (`accepted_mean` + 1;
    /// 0 before the first cycle).
    pub tokens_per_cycle: f64,
    /// Per draft position `i`: accepted / drafted at that position.
    pub acceptance_by_position: Vec<f64>,
    /// Draft tokens proposed per cycle.
    pub depth_mean: f64,
}

/// A speculative decoder for [`Generator::with_speculator`] (the `mlx-speculative` crate has
/// the drafters and the verifier). The generator prefills the prompt and samples the first token
/// as usual; from then on the cache holds every token but the newest, and each
/// [`Speculator::cycle`] returns the next tokens.
pub trait Speculator: Send {
    /// A new generation starts (per-generation state and counters reset).
    fn start(&mut self);
    /// Produce 1..=`max` tokens after `history` (context, prompt and generated tokens; the cache
    /// holds all of them but the last), each with its log-prob under the target's processed
    /// distribution. Afterwards the cache holds `history` and every returned token but the last.
    fn cycle(&mut self, model: &Model, cache: &mut Cache, history: &[u32], sampler: &mut Sampler, max: usize) -> Result<Vec<Token>>;
    /// Make the cache hold exactly `history`: a prefix of what the last cycle left in it, or that
    /// and the cycle's last token (generation ended part-way through the returned tokens).
    fn settle(&mut self, model: &Model, cache: &mut Cache, history: &[u32]) -> Result<()>;
    /// Counters since [`Speculator::start`].
    fn stats(&self) -> SpeculativeStats;
    /// How many of the next tokens to leave to plain decoding (a policy settled on no drafts until
    /// its next probe), asked between cycles with the cache holding every token but the newest:
    /// the generator decodes them its own pipelined way, then calls [`Speculator::resume`].
    /// Default: none (every token comes from [`Speculator::cycle`]).
    fn plain_tokens(&mut self, _history: &[u32]) -> usize {
        0
    }
    /// A plain stretch of `n` tokens that took `secs` has ended: the cache holds `history` but its
    /// newest token, as after a cycle.
    fn resume(&mut self, _history: &[u32], _n: usize, _secs: f64) {}
    /// A token of a plain stretch was sampled (`history` ends with it) with log-prob `logprob`
    /// under the target's processed distribution of `sampling`: asked for every token of a
    /// stretch, before [`Speculator::plain_progress`] or [`Speculator::resume`]. Default:
    /// nothing.
    fn plain_sampled(&mut self, _history: &[u32], _logprob: f32, _sampling: &SamplingConfig) {}
    /// A token of a plain stretch was produced (`history` ends with it) and `left` more are to
    /// come before [`Speculator::resume`] (asked for all but the stretch's last token; the cache
    /// holds `history` but its newest token, or all of it). Not asked during a stretch that
    /// runs to the generation's end ([`GenerateConfig::max_new_tokens`]), which no cycle
    /// follows. Default: nothing.
    fn plain_progress(&mut self, _history: &[u32], _left: usize) -> Result<()> {
        Ok(())
    }
    /// The history may reach `positions` tokens in this generation (asked after
    /// [`Speculator::start`], with what the target's flat cache was sized for): a speculator
    /// with flat K/V storage of its own sizes it likewise ([`Cache::reserve`]) when it next runs.
    /// Default: nothing.
    fn reserve(&mut self, _positions: usize) {}
    /// The prompt has been prefilled and `history` (context and prompt) is in the target
    /// `model`'s cache; the first token is sampled but not yet handed out. A speculator with a
    /// context of its own (a draft model's cache) may queue its run over `history` now, as the
    /// target's prefill, rather than in its first cycle. Not called when the first token ends
    /// the generation. Default: nothing.
    fn prefill(&mut self, _model: &Model, _history: &[u32]) -> Result<()> {
        Ok(())
    }
}

/// One generated token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Token {
    pub id: u32,
    /// Log-probability under the processed sampling distribution.
    pub logprob: f32,
}

/// Iterator over generated tokens; see [`generate`]. When it ends, [`Generator::finish_reason`]
/// says why. The cache then holds the prompt and every yielded token (a stop token is fed too,
/// so the cache ends on a turn boundary).
pub struct Generator<'a> {
    model: &'a Model,
    cache: &'a mut Cache,
    sampler: Sampler,
    guard: StopGuard,
    stop: Vec<u32>,
    cfg: GenerateConfig,
    history: Vec<u32>,
    prompt: Vec<u32>,
    pending: Option<(Array, Array)>,
    forced: Option<u32>,
    /// Sampling reads no token history: step n + 1 can be fed the lazy token n.
    lazy_feed: bool,
    queued_on_lazy: bool,
    produced: usize,
    finish: Option<FinishReason>,
    stop_token: Option<u32>,
    cancel: CancelHandle,
    started: Instant,
    first_token: Option<Duration>,
    prefill_time: Duration,
    spec: Option<SpecState<'a>>,
    /// The media whose tokens are in the prompt ([`Generator::with_media`]).
    media: Vec<crate::media::PreparedMedia>,
    /// Positions the flat cache was sized for ([`Cache::reserve`]).
    reserved: usize,
}

/// A generator's speculative decoding: the speculator and the tokens of its last cycle not yet
/// handed out.
struct SpecState<'a> {
    speculator: &'a mut dyn Speculator,
    queue: std::collections::VecDeque<Token>,
    /// The cache does not hold `history` exactly (tokens handed out but not fed, or rolled-back
    /// tokens still in it).
    unsettled: bool,
    /// Tokens of the current plain stretch ([`Speculator::plain_tokens`]) not yet produced, its
    /// length and start.
    plain_left: usize,
    plain_len: usize,
    plain_started: Option<Instant>,
    /// The stretch runs to the generation's end ([`GenerateConfig::max_new_tokens`]): no cycle
    /// follows it, so [`Speculator::plain_progress`] is not asked.
    plain_final: bool,
}

/// New tokens a generation sizes its flat K/V storage for up front ([`Cache::reserve`]); a
/// longer one grows it as it goes.
pub const RESERVE_NEW: usize = 1024;
/// Positions past the generation's end reserved as well (a speculative verify step's drafts).
const RESERVE_SLACK: usize = 32;

/// Start generating after `prompt` (appended to `cache`; pass only the tokens not yet in it).
/// [`GenerateConfig::context`] holds the tokens already in the cache, for the penalties. A flat
/// cache's storage is sized for the prompt and `max_new_tokens` (up to [`RESERVE_NEW`]) at once.
pub fn generate<'a>(model: &'a Model, cache: &'a mut Cache, prompt: &[u32], cfg: GenerateConfig) -> Result<Generator<'a>> {
    if prompt.is_empty() {
        return Err(ModelError::InvalidInput("generation needs at least one prompt token".into()));
    }
    let vocab = model.info().vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(ModelError::InvalidInput(format!("token id {bad} out of range for vocab size {vocab}")));
    }
    let sampler = Sampler::new(cfg.sampling.clone()).map_err(|e| ModelError::InvalidInput(e.to_string()))?;
    let sc = &cfg.sampling;
    let lazy_feed = sc.repetition_penalty == 1.0 && sc.presence_penalty == 0.0 && sc.frequency_penalty == 0.0;
    let guard = StopGuard::new(&cfg.sampling).map_err(|e| ModelError::InvalidInput(e.to_string()))?;
    let stop = cfg.stop_tokens.clone().unwrap_or_else(|| model.info().eos_token_ids.clone());
    let mut history = cfg.context.clone();
    history.extend_from_slice(prompt);
    // flat K/V storage sized for the whole generation at its prefill (up to RESERVE_NEW new
    // tokens; a speculative verify writes up to RESERVE_SLACK more before rolling back)
    let reserved = cache.offset() + prompt.len() + cfg.max_new_tokens.min(RESERVE_NEW) + RESERVE_SLACK;
    cache.reserve(reserved)?;
    // One queueing call a step: the pool writes of a paged cache go with the step's outputs.
    cache.set_queue_with_outputs(true);
    Ok(Generator {
        model,
        cache,
        sampler,
        guard,
        stop,
        cfg,
        history,
        prompt: prompt.to_vec(),
        pending: None,
        forced: None,
        lazy_feed,
        queued_on_lazy: false,
        produced: 0,
        finish: None,
        stop_token: None,
        cancel: CancelHandle::default(),
        started: Instant::now(),
        first_token: None,
        prefill_time: Duration::ZERO,
        spec: None,
        media: Vec::new(),
        reserved,
    })
}

impl<'a> Generator<'a> {
    /// A handle that stops this generation (checked before each token).
    pub fn cancel_handle(&self) -> CancelHandle {
        self.cancel.clone()
    }
    /// Use `handle` (e.g. one shared with a UI) instead of the generator's own.
    pub fn with_cancel(mut self, handle: CancelHandle) -> Self {
        self.cancel = handle;
        self
    }
    /// Decode speculatively with `speculator` (call before the first token). Output is
    /// distributed as plain sampling's (token for token the same at temperature 0); streaming,
    /// stop tokens, guards and cancellation work as without it. [`Generator::force_next`] is
    /// refused while speculating.
    pub fn with_speculator(mut self, speculator: &'a mut dyn Speculator) -> Self {
        speculator.start();
        speculator.reserve(self.reserved);
        self.spec = Some(SpecState { speculator, queue: Default::default(), unsettled: false, plain_left: 0, plain_len: 0, plain_started: None, plain_final: false });
        self
    }
    /// The prompt holds the (expanded) tokens of `media`, in order: it is prefilled in one call
    /// through the model's [`crate::media::MediaModel`] (tower outputs merged at those tokens).
    pub fn with_media(mut self, media: Vec<crate::media::PreparedMedia>) -> Self {
        self.media = media;
        self
    }
    /// Make the next token `id` whatever the model prefers (thinking budgets). While decoding
    /// speculatively the next token is an [`ModelError::UnsupportedOption`] error instead.
    pub fn force_next(&mut self, id: u32) {
        self.forced = Some(id);
        self.pending = None;
    }
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }
    /// The stop token that ended generation (it was fed to the cache but not yielded).
    pub fn stop_token(&self) -> Option<u32> {
        self.stop_token
    }
    pub fn performance(&self) -> Performance {
        let decode = self.started.elapsed().saturating_sub(self.first_token.unwrap_or_default());
        let n = self.produced;
        Performance {
            prompt_tokens: self.prompt.len(),
            generated_tokens: n,
            ttft_ms: self.first_token.unwrap_or_default().as_secs_f64() * 1e3,
            prefill_tokens_per_sec: self.prompt.len() as f64 / self.prefill_time.as_secs_f64().max(1e-9),
            decode_tokens_per_sec: if n > 1 { (n - 1) as f64 / decode.as_secs_f64().max(1e-9) } else { 0.0 },
            speculative: self.spec.as_ref().map(|s| s.speculator.stats()),
        }
    }

    /// Run the model on `input` and queue a sample of the next token.
    fn step(&mut self, input: &Array) -> Result<(Array, Array)> {
        let out = self.model.with_runtime(|rt| rt.forward(input, self.cache, Logits::Last, false))?;
        self.sample_queued(out)
    }

    /// The whole prompt with its media, through the model's media side.
    fn forward_media(&mut self, logits: Logits) -> Result<crate::runtime::ForwardOutput> {
        let (prompt, media) = (&self.prompt, &self.media);
        let cache = &mut *self.cache;
        self.model.with_runtime(|rt| {
            let m = rt.media().ok_or_else(|| ModelError::UnsupportedOption(format!("{} takes no images or audio", rt.info().model_type)))?;
            let input = m.embed(prompt, media, cache)?;
            m.forward_embedded(&input, cache, logits, false)
        })
    }

    /// Sample the next token from a forward call's logits, queued with the cache's writes.
    fn sample_queued(&mut self, out: crate::runtime::ForwardOutput) -> Result<(Array, Array)> {
        let sampled = out.logits.ok_or_else(|| ModelError::Cache("forward returned no logits (internal error)".into())).and_then(|l| {
            let logits = l.reshape(&[1, -1])?;
            let mut sample = |lg: &Array| self.sampler.sample(lg, &[&self.history]).map(|s| (s.tokens, s.logprobs)).map_err(|e| ModelError::InvalidInput(e.to_string()));
            match self.model.tensor_parallel() {
                Some(g) => crate::layers::parallel::sample_on_root(g, &logits, self.model.info().vocab_size, sample),
                None => sample(&logits),
            }
        });
        match sampled {
            Ok((tokens, logprobs)) => {
                self.cache.async_eval_with(&[&tokens, &logprobs])?;
                Ok((tokens, logprobs))
            }
            Err(e) => {
                self.cache.eval_with(&[])?; // the forward's pool writes must still be queued
                Err(e)
            }
        }
    }

    fn prefill(&mut self) -> Result<(Array, Array)> {
        let t0 = Instant::now();
        if !self.media.is_empty() {
            let out = self.forward_media(Logits::Last)?;
            let r = self.sample_queued(out)?;
            r.0.eval()?;
            self.prefill_time = t0.elapsed();
            crate::observe::record_phase("prefill", self.prefill_time);
            return Ok(r);
        }
        let p = self.prompt.clone();
        let step = if self.cfg.prefill_step_size == 0 { p.len() } else { self.cfg.prefill_step_size };
        // As mlx-lm: full chunks without logits while more than one chunk remains, then the rest
        // (1..=step tokens, ending with the prompt's last token) with the last position's logits.
        let mut rest = &p[..];
        while rest.len() > step {
            let t = Array::from_slice(&rest[..step], &[1, step])?;
            self.model.with_runtime(|rt| rt.forward(&t, self.cache, Logits::None, false))?;
            self.cache.eval_with(&[])?;
            rest = &rest[step..];
        }
        let t = Array::from_slice(rest, &[1, rest.len()])?;
        let r = self.step(&t)?;
        r.0.eval()?;
        self.prefill_time = t0.elapsed();
        crate::observe::record_phase("prefill", self.prefill_time);
        Ok(r)
    }

    fn next_token(&mut self) -> Result<Option<Token>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        if self.cancel.is_cancelled() {
            self.finish = Some(FinishReason::Cancelled);
            self.settle_speculation()?;
            return Ok(None);
        }
        if self.produced >= self.cfg.max_new_tokens {
            self.finish = Some(FinishReason::Length);
            self.settle_speculation()?;
            return Ok(None);
        }
        if self.first_token.is_some() && self.spec.is_some() && !self.plain_stretch()? {
            return self.next_speculative();
        }
        // Pipelining needs sampling that reads no history; with a speculator only inside a plain
        // stretch and not at its last token, which stays out of the cache (the speculator's
        // invariant).
        let pipelined = self.lazy_feed && self.spec.as_ref().is_none_or(|s| s.plain_left > 1);
        let (id, logprob) = match self.forced.take() {
            Some(id) => (id, 0.0),
            None => {
                let (tok, lp) = match self.pending.take() {
                    Some(p) => p,
                    None if self.produced == 0 && self.first_token.is_none() => self.prefill()?,
                    None => return Err(ModelError::Cache("generator has no queued step (internal error)".into())),
                };
                // Pipelining (as mlx-lm's generate_step): queue step n + 1 on the still-lazy
                // token n before reading token n back, so the device never waits for the host.
                // Penalties need id n in the history first, so they take the plain path.
                if pipelined {
                    self.pending = Some(self.step(&tok.reshape(&[1, 1])?)?);
                    self.queued_on_lazy = true;
                }
                // Read the queued arrays themselves (to_vec of a fresh reshape would wait for step n + 1).
                let (id, lp) = (tok.to_vec::<u32>()?[0], lp.to_vec::<f32>()?[0]);
                // A NaN or +inf logit makes the log-normaliser NaN or inf, so the sampled token's
                // log-prob shows it at no extra cost (no scan of the logits).
                if lp.is_nan() || lp == f32::INFINITY {
                    self.pending = None;
                    self.finish = Some(FinishReason::Cancelled);
                    return Err(ModelError::NonFiniteLogits { step: self.produced, logprob: lp });
                }
                (id, lp)
            }
        };
        let fed = std::mem::take(&mut self.queued_on_lazy);
        if self.first_token.is_none() {
            if self.prefill_time.is_zero() {
                // First token forced: the prompt must still be prefilled into the cache.
                self.prefill_forced()?;
            }
            let more = !self.stop.contains(&id) && self.cfg.max_new_tokens > 1;
            if let Some(spec) = self.spec.as_mut().filter(|_| more) {
                spec.speculator.prefill(self.model, &self.history)?;
            }
            self.first_token = Some(self.started.elapsed());
        }
        self.history.push(id);
        let is_stop = self.stop.contains(&id);
        let guard = self.guard.push(id);
        let plain = self.spec.as_ref().map_or(0, |s| s.plain_left);
        if let Some(spec) = self.spec.as_mut().filter(|_| plain > 0) {
            spec.speculator.plain_sampled(&self.history, logprob, self.sampler.config());
            spec.plain_left -= 1;
            if spec.plain_left == 0 {
                let secs = spec.plain_started.take().map_or(0.0, |t| t.elapsed().as_secs_f64());
                spec.speculator.resume(&self.history, spec.plain_len, secs);
            } else if !spec.plain_final {
                spec.speculator.plain_progress(&self.history, spec.plain_left)?;
            }
        }
        // Queue the next step before handing this token out (pipelining); a stop token is fed
        // too, so the cache ends on a turn boundary.
        if fed {
            // Token n is already in the cache and step n + 1 is queued.
            if is_stop {
                self.pending = None;
                self.cache.eval_with(&[])?;
            }
        } else if let Some(spec) = self.spec.as_mut().filter(|_| plain <= 1) {
            // Speculation: the newest token stays out of the cache until the next cycle.
            spec.unsettled = true;
            if is_stop || guard.is_some() || self.produced + 1 >= self.cfg.max_new_tokens {
                self.settle_speculation()?;
            }
        } else if self.forced.is_none() {
            let t = Array::from_slice(&[id], &[1, 1])?;
            if is_stop {
                self.model.with_runtime(|rt| rt.forward(&t, self.cache, Logits::None, false))?;
                self.cache.eval_with(&[])?;
            } else {
                self.pending = Some(self.step(&t)?);
            }
        }
        if is_stop {
            self.finish = Some(FinishReason::Stop);
            self.stop_token = Some(id);
            return Ok(None);
        }
        self.produced += 1;
        if guard.is_some() {
            self.finish = Some(FinishReason::Repetition);
        }
        Ok(Some(Token { id, logprob }))
    }

    /// Whether the next token comes from a plain stretch: one under way, or one the speculator
    /// asks for now (between cycles), which starts by feeding the newest token as plain decoding
    /// does.
    fn plain_stretch(&mut self) -> Result<bool> {
        let max = self.cfg.max_new_tokens - self.produced;
        let Some(spec) = self.spec.as_mut() else { return Ok(false) };
        if spec.plain_left > 0 {
            return Ok(true);
        }
        if !spec.queue.is_empty() || self.pending.is_some() || self.forced.is_some() {
            return Ok(false);
        }
        let n = spec.speculator.plain_tokens(&self.history).min(max);
        if n == 0 {
            return Ok(false);
        }
        (spec.plain_left, spec.plain_len, spec.plain_started, spec.plain_final) = (n, n, Some(Instant::now()), n == max);
        // the cache holds the history but its newest token, and nothing rolled back
        spec.unsettled = false;
        let last = *self.history.last().ok_or_else(|| ModelError::Cache("a plain stretch needs a history (internal error)".into()))?;
        self.pending = Some(self.step(&Array::from_slice(&[last], &[1, 1])?)?);
        Ok(true)
    }

    /// The next token of a speculative generation: from the last cycle's tokens, or a new cycle.
    fn next_speculative(&mut self) -> Result<Option<Token>> {
        if self.forced.is_some() {
            self.finish = Some(FinishReason::Cancelled);
            return Err(ModelError::UnsupportedOption("forcing a token is not supported while decoding speculatively".into()));
        }
        let spec = self.spec.as_mut().ok_or_else(|| ModelError::Cache("no speculator (internal error)".into()))?;
        if spec.queue.is_empty() {
            let max = self.cfg.max_new_tokens - self.produced;
            let toks = spec.speculator.cycle(self.model, self.cache, &self.history, &mut self.sampler, max)?;
            if toks.is_empty() || toks.len() > max {
                return Err(ModelError::Cache(format!("speculator returned {} tokens for at most {max} (internal error)", toks.len())));
            }
            spec.queue.extend(toks);
            spec.unsettled = true;
        }
        let tok = spec.queue.pop_front().ok_or_else(|| ModelError::Cache("empty speculative queue (internal error)".into()))?;
        if tok.logprob.is_nan() || tok.logprob == f32::INFINITY {
            self.finish = Some(FinishReason::Cancelled);
            return Err(ModelError::NonFiniteLogits { step: self.produced, logprob: tok.logprob });
        }
        self.history.push(tok.id);
        let is_stop = self.stop.contains(&tok.id);
        let guard = self.guard.push(tok.id);
        if is_stop || guard.is_some() || self.produced + 1 >= self.cfg.max_new_tokens {
            self.settle_speculation()?;
        }
        if is_stop {
            self.finish = Some(FinishReason::Stop);
            self.stop_token = Some(tok.id);
            return Ok(None);
        }
        self.produced += 1;
        if guard.is_some() {
            self.finish = Some(FinishReason::Repetition);
        }
        Ok(Some(tok))
    }

    /// Speculation ending: drop the tokens not handed out and make the cache hold the history
    /// (every handed-out token, and a stop token), as plain decoding leaves it.
    fn settle_speculation(&mut self) -> Result<()> {
        if let Some(spec) = &mut self.spec {
            spec.queue.clear();
            if spec.unsettled {
                spec.unsettled = false;
                spec.speculator.settle(self.model, self.cache, &self.history)?;
            }
        }
        Ok(())
    }

    fn prefill_forced(&mut self) -> Result<()> {
        let t0 = Instant::now();
        if self.media.is_empty() {
            let p = self.prompt.clone();
            let t = Array::from_slice(&p, &[1, p.len()])?;
            self.model.with_runtime(|rt| rt.forward(&t, self.cache, Logits::None, false))?;
        } else {
            self.forward_media(Logits::None)?;
        }
        self.cache.eval_with(&[])?;
        self.prefill_time = t0.elapsed();
        Ok(())
    }
}

impl Drop for Generator<'_> {
    fn drop(&mut self) {
        // Every step queues its own pool writes; this covers a step cut short by a panic, so
        // that no other thread's forward call waits on writes nobody will queue. It also waits
        // for the step queued ahead (pipelining) and for those writes: no work of this
        // generation is still running on MLX's stream once the generator is gone (a program
        // that returns from `main` right after must not exit under a computing stream thread).
        let pending = self.pending.take();
        // A speculative generation dropped part-way: leave the cache holding what was handed out.
        if self.spec.as_ref().is_some_and(|s| s.unsettled) {
            let _ = self.settle_speculation();
        }
        let outs: Vec<&Array> = pending.as_ref().map(|(t, l)| vec![t, l]).unwrap_or_default();
        let _ = self.cache.eval_with(&outs);
        self.cache.set_queue_with_outputs(false);
    }
}

impl Iterator for Generator<'_> {
    type Item = Result<Token>;
    fn next(&mut self) -> Option<Self::Item> {
        let decode_step = (self.first_token.is_some() && crate::observe::is_profiling_enabled()).then(Instant::now);
        let r = self.next_token();
        if let (Some(t0), Ok(Some(_))) = (decode_step, &r) {
            crate::observe::record_phase("decode", t0.elapsed());
        }
        match r {
            Ok(Some(t)) => Some(Ok(t)),
            Ok(None) => None,
            Err(e) => {
                self.finish = Some(FinishReason::Cancelled);
                Some(Err(e))
            }
        }
    }
}
