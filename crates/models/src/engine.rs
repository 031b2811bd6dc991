//! Continuous batching: one loop per model runs every live sequence in shared `[B, L]` forward
//! passes, and sequences join and leave between steps.
//!
//! The loop ([`Scheduler`]) alternates two kinds of forward pass over batch caches
//! ([`crate::batch`]):
//! - a prefill chunk: the waiting requests admitted together (up to
//!   [`EngineConfig::max_batch`] live sequences), left-padded to their longest prompt, at most
//!   [`EngineConfig::prefill_step_size`] columns per pass; identical prompts are computed once
//!   and copied; after the last chunk each sequence samples its first token and the rows join
//!   the running batch ([`crate::Cache::merge_batch`]);
//! - a decode step: one token for every running sequence, `[B, 1]`.
//!
//! While a prefill is in progress, each loop turn runs one of its chunks and then one decode
//! step, so running sequences keep producing tokens while a long prompt is prefilled. Each
//! sequence has its own sampler (its request's settings; its own random stream), penalty
//! history, stop tokens, stop guard and cancel flag; a finished or cancelled sequence leaves the
//! batch before the next step ([`crate::Cache::select_rows`]).
//!
//! [`Engine::start`] runs the loop on its own thread and gives a [`EngineHandle`] (`Send`,
//! `Sync`, `Clone`) to submit requests; each request streams [`Event`]s on its own channel.
//! [`crate::generate_batch`] runs the same loop on the caller's thread.
//!
//! Attention K/V live in flat batch storage ([`EngineKv::Flat`]: a request's prompt is always
//! computed in full) or in the model's paged pool ([`EngineKv::Paged`], the default on a GPU):
//! every sequence then has its own blocks and position, the running rows are one view
//! ([`crate::Cache::paged_rows`]) whose steps read each row's keys from its blocks, and a prompt
//! whose leading blocks are cached (a repeated system prompt, a conversation sent again) skips
//! them ([`Usage::cached_prompt_tokens`]; attention-only families: recurrent state has no
//! snapshots here). A prefill chunk and a decode step are separate forward passes.
use crate::cache::Cache;
use crate::paged::RowTokens;
use crate::generate::{CancelHandle, FinishReason, GenerateConfig, Performance, Token};
use crate::model::Model;
use crate::runtime::Logits;
use crate::{ModelError, Result};
use mlx_array::Array;
use sampling::{Sampler, StopGuard};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Settings of an [`Engine`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most sequences in one forward pass (running plus the ones being prefilled).
    pub max_batch: usize,
    /// Prompt columns per prefill pass (bounds activation memory); 0 = whole prompts.
    pub prefill_step_size: usize,
    /// Most requests waiting for a slot; [`EngineHandle::submit`] refuses more with
    /// [`EngineError::QueueFull`].
    pub max_queue: usize,
    /// Where the sequences' K/V live.
    pub kv: EngineKv,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { max_batch: 32, prefill_step_size: 512, max_queue: 256, kv: EngineKv::Auto }
    }
}

/// Where an [`Engine`]'s sequences keep their K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKv {
    /// The paged pool on a GPU, when the model has one; flat batch caches otherwise (on the
    /// CPU, reading K/V out of blocks every step costs more than a contiguous cache).
    #[default]
    Auto,
    /// The model's paged pool (each sequence its own blocks; prompt prefixes cached across
    /// requests); flat batch caches when the model has none.
    Paged,
    /// Flat batch caches: prompts always computed in full.
    Flat,
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Too many requests wait already.
    #[error("request queue full ({0} waiting)")]
    QueueFull(usize),
    /// The engine's loop has stopped.
    #[error("the engine has stopped")]
    Stopped,
    /// The request itself is invalid (empty prompt, ids out of range, too long for the model,
    /// invalid sampling settings).
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the paged prefix cache instead of computed (0 with flat
    /// caches: see [`crate::engine`]).
    pub cached_prompt_tokens: usize,
}

/// What a request's channel carries: tokens, then exactly one `Finished` or `Error`.
#[derive(Debug, Clone)]
pub enum Event {
    Token(Token),
    Finished { reason: FinishReason, usage: Usage, performance: Performance },
    /// The forward pass that carried this request failed; the request is over.
    Error(String),
}

/// A submitted request: its events and a handle that cancels it. Dropping the receiver also
/// cancels it (the loop notices at its next token).
pub struct RequestHandle {
    pub id: u64,
    pub events: Receiver<Event>,
    pub cancel: CancelHandle,
}

/// Where a sequence's events go.
enum Sink {
    /// Kept on the sequence ([`crate::generate_batch`]).
    Collect,
    Channel(Sender<Event>),
}

/// One sequence in the loop.
pub(crate) struct Seq {
    pub(crate) prompt: Vec<u32>,
    max_new_tokens: usize,
    sampler: Sampler,
    greedy: bool,
    /// Sampling reads no history (no penalties): a step may be fed the previous lazy token.
    lazy_feed: bool,
    guard: StopGuard,
    stop: Vec<u32>,
    history: Vec<u32>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) logprobs: Vec<f32>,
    pub(crate) finish: Option<FinishReason>,
    cancel: CancelHandle,
    sink: Sink,
    submitted: Instant,
    pub(crate) first_token: Option<Duration>,
    pub(crate) finished_at: Duration,
    prefill_time: Duration,
    /// Leading prompt tokens the paged prefix cache served.
    pub(crate) cached: usize,
}

impl Seq {
    /// A sequence for `prompt` under `cfg` (`cfg.context` must be empty); `seed` overrides the
    /// sampling seed (per-row streams of [`crate::generate_batch`]).
    pub(crate) fn new(model: &Model, prompt: Vec<u32>, cfg: &GenerateConfig, seed: Option<u64>, cancel: CancelHandle, sink: Option<Sender<Event>>) -> Result<Self> {
        if prompt.is_empty() {
            return Err(ModelError::InvalidInput("generation needs at least one prompt token".into()));
        }
        if !cfg.context.is_empty() {
            return Err(ModelError::InvalidInput("batched generation starts from an empty cache: GenerateConfig::context must be empty".into()));
        }
        let info = model.info();
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(ModelError::InvalidInput(format!("token id {bad} out of range for vocab size {}", info.vocab_size)));
        }
        if prompt.len() >= info.max_position_embeddings {
            return Err(ModelError::InvalidInput(format!("prompt of {} tokens does not fit the model's context of {}", prompt.len(), info.max_position_embeddings)));
        }
        let bad = |e: sampling::SamplingError| ModelError::InvalidInput(e.to_string());
        let mut sc = cfg.sampling.clone();
        if let Some(s) = seed {
            sc = sc.with_seed(s);
        }
        let greedy = sc.is_greedy();
        let lazy_feed = sc.repetition_penalty == 1.0 && sc.presence_penalty == 0.0 && sc.frequency_penalty == 0.0;
        Ok(Seq {
            history: prompt.clone(),
            prompt,
            max_new_tokens: cfg.max_new_tokens,
            guard: StopGuard::new(&sc).map_err(bad)?,
            sampler: Sampler::new(sc).map_err(bad)?,
            greedy,
            lazy_feed,
            stop: cfg.stop_tokens.clone().unwrap_or_else(|| info.eos_token_ids.clone()),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish: if cfg.max_new_tokens == 0 { Some(FinishReason::Length) } else { None },
            cancel,
            sink: match sink {
                Some(s) => Sink::Channel(s),
                None => Sink::Collect,
            },
            submitted: Instant::now(),
            first_token: None,
            finished_at: Duration::ZERO,
            prefill_time: Duration::ZERO,
            cached: 0,
        })
    }

    fn last(&self) -> u32 {
        *self.tokens.last().or(self.prompt.last()).expect("non-empty prompt")
    }

    /// Take sampled token `id` (log-prob `lp`): emit it, or end the sequence.
    fn accept(&mut self, id: u32, lp: f32) {
        let now = self.submitted.elapsed();
        if self.first_token.is_none() {
            self.first_token = Some(now);
        }
        if lp.is_nan() || lp == f32::INFINITY {
            let e = ModelError::NonFiniteLogits { step: self.tokens.len(), logprob: lp };
            self.fail(&e.to_string());
            return;
        }
        if self.stop.contains(&id) {
            self.end(FinishReason::Stop);
            return;
        }
        self.tokens.push(id);
        self.logprobs.push(lp);
        self.history.push(id);
        if let Sink::Channel(tx) = &self.sink {
            if tx.send(Event::Token(Token { id, logprob: lp })).is_err() {
                self.cancel.cancel();
            }
        }
        if self.cancel.is_cancelled() {
            self.end(FinishReason::Cancelled);
        } else if self.guard.push(id).is_some() {
            self.end(FinishReason::Repetition);
        } else if self.tokens.len() >= self.max_new_tokens {
            self.end(FinishReason::Length);
        }
    }

    pub(crate) fn performance(&self) -> Performance {
        let k = self.tokens.len();
        let first = self.first_token.unwrap_or_default();
        Performance {
            prompt_tokens: self.prompt.len(),
            generated_tokens: k,
            ttft_ms: first.as_secs_f64() * 1e3,
            prefill_tokens_per_sec: self.prompt.len() as f64 / self.prefill_time.as_secs_f64().max(1e-9),
            decode_tokens_per_sec: if k > 1 { (k - 1) as f64 / self.finished_at.saturating_sub(first).as_secs_f64().max(1e-9) } else { 0.0 },
            speculative: None,
        }
    }

    /// End with `reason` and send `Finished`.
    pub(crate) fn end(&mut self, reason: FinishReason) {
        if self.finish.is_some() && self.finished_at != Duration::ZERO {
            return;
        }
        self.finish = Some(reason);
        self.finished_at = self.submitted.elapsed();
        if let Sink::Channel(tx) = &self.sink {
            let usage = Usage { prompt_tokens: self.prompt.len(), completion_tokens: self.tokens.len(), cached_prompt_tokens: self.cached };
            let _ = tx.send(Event::Finished { reason, usage, performance: self.performance() });
        }
    }

    fn fail(&mut self, msg: &str) {
        self.finish = Some(FinishReason::Cancelled);
        self.finished_at = self.submitted.elapsed();
        if let Sink::Channel(tx) = &self.sink {
            let _ = tx.send(Event::Error(msg.to_string()));
        }
    }

    fn done(&self) -> bool {
        self.finish.is_some()
    }
}

/// A prefill in progress.
struct Prefill {
    rows: PrefillRows,
    /// Each row's padding before its first token to compute, in columns: rows are right-aligned
    /// on the longest, so every row's last token falls in the last chunk.
    pad: Vec<usize>,
    /// The sequences (slab ids).
    seqs: Vec<usize>,
    next: usize,
    longest: usize,
    started: Instant,
}

/// Where a prefill's rows live.
enum PrefillRows {
    /// One flat batch cache with a row per distinct prompt (`prompts`); sequence `i` is row
    /// `row_of[i]`.
    Flat { cache: Cache, prompts: Vec<Vec<u32>>, row_of: Vec<usize> },
    /// Each sequence's paged cache (joined into a view for each chunk, for the rows with tokens
    /// in it).
    Paged(Vec<Option<Cache>>),
}

/// The continuous-batching loop over one model (see [`crate::engine`]).
pub(crate) struct Scheduler {
    model: Model,
    cfg: EngineConfig,
    pub(crate) seqs: Vec<Option<Seq>>,
    waiting: VecDeque<usize>,
    prefill: Option<Prefill>,
    running: Option<Cache>,
    /// Slab ids of the running cache's rows, in row order.
    run: Vec<usize>,
    /// A decode step queued on the running rows whose tokens are not read yet (pipelining:
    /// step `n + 1` is queued on the lazy tokens of step `n` before they are read back).
    pending: Option<(Array, Array)>,
    /// Rows of every forward pass, in order.
    pub(crate) rows_per_forward: Vec<usize>,
    /// The sequences live in the model's paged pool ([`EngineKv`]).
    paged: bool,
    /// Paged: new sequences may start on cached prompt blocks (no recurrent layers).
    prefix_skip: bool,
}

impl Scheduler {
    pub(crate) fn new(model: Model, cfg: EngineConfig) -> Self {
        let pool = model.paged_stats().is_some();
        let paged = pool
            && match cfg.kv {
                EngineKv::Flat => false,
                EngineKv::Paged => true,
                EngineKv::Auto => !crate::layers::runs_on_cpu(),
            };
        let prefix_skip = !model.with_runtime(|rt| rt.cache_spec()).layers.iter().any(|l| matches!(l, crate::kv::LayerKind::Recurrent { .. }));
        Scheduler { model, cfg, seqs: Vec::new(), waiting: VecDeque::new(), prefill: None, running: None, run: Vec::new(), pending: None, rows_per_forward: Vec::new(), paged, prefix_skip }
    }

    /// Queue `seq`; returns its slab id.
    pub(crate) fn add(&mut self, seq: Seq) -> usize {
        let id = match self.seqs.iter().position(Option::is_none) {
            Some(i) => {
                self.seqs[i] = Some(seq);
                i
            }
            None => {
                self.seqs.push(Some(seq));
                self.seqs.len() - 1
            }
        };
        self.waiting.push_back(id);
        id
    }

    /// Whether any sequence waits or runs.
    pub(crate) fn busy(&self) -> bool {
        !self.waiting.is_empty() || self.prefill.is_some() || !self.run.is_empty()
    }

    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    fn seq(&mut self, id: usize) -> &mut Seq {
        self.seqs[id].as_mut().expect("live slab id")
    }

    /// Remove finished sequences from the slab when they stream to a channel (collected ones
    /// stay for the caller).
    fn release(&mut self, id: usize) {
        if matches!(self.seqs[id].as_ref().map(|s| &s.sink), Some(Sink::Channel(_))) {
            self.seqs[id] = None;
        }
    }

    /// One turn: start a prefill if there is room, run one prefill chunk, run one decode step.
    pub(crate) fn step(&mut self) -> Result<()> {
        // Cancelled waiting requests leave the queue at once.
        let mut i = 0;
        while i < self.waiting.len() {
            let id = self.waiting[i];
            let s = self.seq(id);
            if s.cancel.is_cancelled() || s.done() {
                if !s.done() {
                    s.end(FinishReason::Cancelled);
                } else if s.finished_at == Duration::ZERO {
                    let r = s.finish.expect("done");
                    s.finish = None;
                    s.end(r);
                }
                self.waiting.remove(i);
                self.release(id);
            } else {
                i += 1;
            }
        }
        if self.prefill.is_none() && !self.waiting.is_empty() {
            let room = self.cfg.max_batch.max(1).saturating_sub(self.run.len());
            if room > 0 {
                let take: Vec<usize> = (0..room.min(self.waiting.len())).filter_map(|_| self.waiting.pop_front()).collect();
                if let Err(e) = self.start_prefill(take.clone()) {
                    for id in take {
                        self.seq(id).fail(&e.to_string());
                        self.release(id);
                    }
                    return Err(e);
                }
            }
        }
        if self.prefill.is_some() {
            if let Err(e) = self.prefill_chunk() {
                let p = self.prefill.take().expect("prefill in progress");
                for id in p.seqs {
                    self.seq(id).fail(&e.to_string());
                    self.release(id);
                }
                return Err(e);
            }
        }
        if !self.run.is_empty() {
            if let Err(e) = self.decode() {
                for id in std::mem::take(&mut self.run) {
                    self.seq(id).fail(&e.to_string());
                    self.release(id);
                }
                self.running = None;
                self.pending = None;
                return Err(e);
            }
        }
        Ok(())
    }

    fn start_prefill(&mut self, ids: Vec<usize>) -> Result<()> {
        if self.paged {
            return self.start_prefill_paged(ids);
        }
        let mut prompts: Vec<Vec<u32>> = Vec::new();
        let mut row_of = Vec::with_capacity(ids.len());
        for &id in &ids {
            let p = &self.seqs[id].as_ref().expect("live").prompt;
            let r = match prompts.iter().position(|q| q == p) {
                Some(r) => r,
                None => {
                    prompts.push(p.clone());
                    prompts.len() - 1
                }
            };
            row_of.push(r);
        }
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let pad: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
        let spec = self.model.with_runtime(|rt| rt.cache_spec());
        let cache = Cache::new_batch(&spec, pad.clone())?;
        self.prefill = Some(Prefill { rows: PrefillRows::Flat { cache, prompts, row_of }, pad, seqs: ids, next: 0, longest, started: Instant::now() });
        Ok(())
    }

    /// A paged prefill: each sequence starts in the pool on its whole prompt (its cached
    /// prefix, if any, is not computed again) and the rest is right-aligned on the longest.
    fn start_prefill_paged(&mut self, ids: Vec<usize>) -> Result<()> {
        let (mut caches, mut rest) = (Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()));
        for &id in &ids {
            let mut c = self.model.new_cache();
            let s = self.seqs[id].as_mut().expect("live");
            let skipped = c.begin_paged(&s.prompt, self.prefix_skip)?;
            s.cached = skipped;
            rest.push(s.prompt.len() - skipped);
            caches.push(Some(c));
        }
        let longest = rest.iter().copied().max().unwrap_or(0);
        let pad = rest.iter().map(|r| longest - r).collect();
        self.prefill = Some(Prefill { rows: PrefillRows::Paged(caches), pad, seqs: ids, next: 0, longest, started: Instant::now() });
        Ok(())
    }

    /// One prefill pass; after the last, sample the first tokens and join the running batch.
    fn prefill_chunk(&mut self) -> Result<()> {
        let p = self.prefill.as_mut().expect("prefill in progress");
        let step = if self.cfg.prefill_step_size == 0 { p.longest } else { self.cfg.prefill_step_size };
        let (start, end) = (p.next, (p.next + step).min(p.longest));
        let last = end == p.longest;
        let want = if last { Logits::Last } else { Logits::None };
        let mut joined = None;
        let (out, rows) = match &mut p.rows {
            PrefillRows::Flat { cache, prompts, .. } => {
                let mut ids = Vec::with_capacity(prompts.len() * (end - start));
                for (q, &pd) in prompts.iter().zip(&p.pad) {
                    ids.extend((start..end).map(|c| if c < pd { 0 } else { q[c - pd] }));
                }
                let t = Array::from_slice(&ids, &[prompts.len(), end - start])?;
                let out = self.model.with_runtime(|rt| rt.forward(&t, cache, want, false))?;
                if !last {
                    cache.eval_with(&[])?;
                }
                (out, prompts.len())
            }
            PrefillRows::Paged(caches) => {
                // The rows with tokens in columns start..end (every row in the last chunk).
                let part: Vec<usize> = (0..caches.len()).filter(|&b| p.pad[b] < end).collect();
                let counts: Vec<(RowTokens, usize)> = part.iter().map(|&b| (RowTokens::Next, end - start.max(p.pad[b]))).collect();
                let taken = part.iter().map(|&b| caches[b].take().ok_or_else(|| ModelError::Cache("a prefill row is missing (internal error)".into()))).collect::<Result<Vec<_>>>()?;
                let mut view = Cache::paged_rows(taken)?;
                view.set_queue_with_outputs(true);
                let plan = view.schedule_rows(&counts)?;
                let cols = plan.iter().map(|&(_, n)| n).max().unwrap_or(0);
                let mut ids = Vec::with_capacity(part.len() * cols);
                for (&b, &(pos, n)) in part.iter().zip(&plan) {
                    let prompt = &self.seqs[p.seqs[b]].as_ref().expect("live").prompt;
                    ids.extend(std::iter::repeat_n(0u32, cols - n));
                    ids.extend_from_slice(&prompt[pos..pos + n]);
                }
                let t = Array::from_slice(&ids, &[part.len(), cols])?;
                let out = self.model.with_runtime(|rt| rt.forward(&t, &mut view, want, false))?;
                if last {
                    joined = Some(view);
                } else {
                    view.eval_with(&[])?;
                    for (c, &b) in view.into_rows()?.into_iter().zip(&part) {
                        caches[b] = Some(c);
                    }
                }
                (out, part.len())
            }
        };
        self.rows_per_forward.push(rows);
        p.next = end;
        if !last {
            return Ok(());
        }
        let p = self.prefill.take().expect("prefill in progress");
        let logits = out.logits.ok_or_else(|| ModelError::Cache("prefill returned no logits (internal error)".into()))?;
        let logits = logits.reshape(&[rows as i32, -1])?;
        let (mut cache, logits) = match p.rows {
            PrefillRows::Flat { mut cache, row_of, .. } => {
                let identity = row_of.len() == rows && row_of.iter().enumerate().all(|(i, &r)| i == r);
                if identity {
                    (cache, logits)
                } else {
                    cache.select_rows(&row_of)?;
                    (cache, logits.take(&index(&row_of)?, 0)?)
                }
            }
            PrefillRows::Paged(_) => (joined.ok_or_else(|| ModelError::Cache("paged prefill without its rows (internal error)".into()))?, logits),
        };
        let elapsed = p.started.elapsed();
        for &id in &p.seqs {
            self.seq(id).prefill_time = elapsed;
        }
        let (toks, lps) = self.sample(&logits, &p.seqs)?;
        cache.eval_with(&[&toks, &lps])?;
        let keep = self.accept(&toks, &lps, &p.seqs)?;
        let kept: Vec<usize> = keep.iter().map(|&b| p.seqs[b]).collect();
        if kept.is_empty() {
            return Ok(());
        }
        if keep.len() != p.seqs.len() {
            cache.select_rows(&keep)?;
        }
        // The running rows' queued step is read first: the merged batch starts from host tokens.
        self.flush_pending()?;
        match self.running.as_mut() {
            Some(r) => r.merge_batch(cache)?,
            None => self.running = Some(cache),
        }
        self.run.extend(kept);
        Ok(())
    }

    /// One decode step over the running rows: queue the step on host tokens unless one is
    /// queued already, queue the next one on its lazy tokens (when no row's sampling reads its
    /// history), then read the tokens back and hand them out.
    fn decode(&mut self) -> Result<()> {
        // Rows cancelled since the last step leave first.
        let keep: Vec<usize> = (0..self.run.len()).filter(|&b| !self.seqs[self.run[b]].as_ref().expect("live").cancel.is_cancelled()).collect();
        if keep.len() != self.run.len() {
            for b in 0..self.run.len() {
                if !keep.contains(&b) {
                    let id = self.run[b];
                    self.seq(id).end(FinishReason::Cancelled);
                    self.release(id);
                }
            }
            self.filter(&keep)?;
            if self.run.is_empty() {
                return Ok(());
            }
        }
        let (toks, lps) = match self.pending.take() {
            Some(p) => p,
            None => {
                let input: Vec<u32> = self.run.iter().map(|&id| self.seqs[id].as_ref().expect("live").last()).collect();
                self.queue_step(&Array::from_slice(&input, &[input.len(), 1])?, Some(input.as_slice()))?
            }
        };
        let lazy = self.run.iter().all(|&id| self.seqs[id].as_ref().expect("live").lazy_feed);
        let next = if lazy { Some(self.queue_step(&toks.reshape(&[self.run.len() as i32, 1])?, None)?) } else { None };
        self.pending = next;
        let run = self.run.clone();
        let keep = self.accept(&toks, &lps, &run)?;
        if keep.len() != self.run.len() {
            self.filter(&keep)?;
        }
        Ok(())
    }

    /// Queue one forward over the running rows with `input` (`[B, 1]`: `host`'s ids, or lazy
    /// tokens still being computed) and the sample of its logits; returns the (lazy) tokens and
    /// log-probs.
    fn queue_step(&mut self, input: &Array, host: Option<&[u32]>) -> Result<(Array, Array)> {
        let n = input.dims()[0];
        let mut cache = self.running.take().ok_or_else(|| ModelError::Cache("running rows without a cache (internal error)".into()))?;
        let planned = if self.paged { schedule_decode(&mut cache, input, host) } else { Ok(()) };
        let out = planned.and_then(|_| self.model.with_runtime(|rt| rt.forward(input, &mut cache, Logits::Last, false)));
        let sampled = out.and_then(|o| {
            self.rows_per_forward.push(n as usize);
            let logits = o.logits.ok_or_else(|| ModelError::Cache("forward returned no logits (internal error)".into()))?;
            let run = self.run.clone();
            self.sample(&logits.reshape(&[n, -1])?, &run)
        });
        let r = sampled.and_then(|(t, l)| {
            cache.async_eval_with(&[&t, &l])?;
            Ok((t, l))
        });
        self.running = Some(cache);
        r
    }

    /// Read the queued step's tokens back and hand them out (before the batch changes shape).
    fn flush_pending(&mut self) -> Result<()> {
        if let Some((toks, lps)) = self.pending.take() {
            let run = self.run.clone();
            let keep = self.accept(&toks, &lps, &run)?;
            if keep.len() != self.run.len() {
                self.filter(&keep)?;
            }
        }
        Ok(())
    }

    /// Keep the running rows `keep` (row indices), and their part of a queued step.
    fn filter(&mut self, keep: &[usize]) -> Result<()> {
        if keep.is_empty() {
            if let (Some((t, l)), Some(c)) = (self.pending.take(), self.running.as_mut()) {
                // nothing reads the queued step now: wait for it rather than leave it running
                c.eval_with(&[&t, &l])?;
            }
            self.running = None;
            self.run.clear();
            return Ok(());
        }
        if let Some(c) = self.running.as_mut() {
            c.select_rows(keep)?;
        }
        if let Some((t, l)) = self.pending.take() {
            let idx = index(keep)?;
            self.pending = Some((t.take(&idx, 0)?, l.take(&idx, 0)?));
        }
        self.run = keep.iter().map(|&b| self.run[b]).collect();
        Ok(())
    }

    /// Lazy tokens and log-probs (`[n]`) sampled from `logits` (`[n, V]`, row `b` sequence
    /// `ids[b]`): one batched call when every row is greedy with one configuration (greedy
    /// draws no randomness), else each row with its own sampler.
    fn sample(&mut self, logits: &Array, ids: &[usize]) -> Result<(Array, Array)> {
        let bad = |e: sampling::SamplingError| ModelError::InvalidInput(e.to_string());
        let seqs: Vec<&Seq> = ids.iter().map(|&id| self.seqs[id].as_ref().expect("live")).collect();
        let shared = seqs.iter().all(|s| s.greedy && s.sampler.config() == seqs[0].sampler.config());
        if shared {
            // Penalties read each row's history; without them the rows pass none.
            let hist: Vec<Vec<u32>> = seqs.iter().map(|s| if s.lazy_feed { Vec::new() } else { s.history.clone() }).collect();
            let hist: Vec<&[u32]> = hist.iter().map(Vec::as_slice).collect();
            let out = self.seqs[ids[0]].as_mut().expect("live").sampler.sample(logits, &hist).map_err(bad)?;
            return Ok((out.tokens, out.logprobs));
        }
        let (mut t, mut l) = (Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()));
        for (b, &id) in ids.iter().enumerate() {
            let s = self.seqs[id].as_mut().expect("live");
            let out = s.sampler.sample(&logits.slice_axis(0, b, b + 1)?, &[s.history.as_slice()]).map_err(bad)?;
            t.push(out.tokens);
            l.push(out.logprobs);
        }
        let (t, l): (Vec<&Array>, Vec<&Array>) = (t.iter().collect(), l.iter().collect());
        Ok((mlx_array::ops::concatenate(&t, 0)?, mlx_array::ops::concatenate(&l, 0)?))
    }

    /// Read sampled tokens back and hand each to its sequence (row `b` is `ids[b]`); returns
    /// the rows still going.
    fn accept(&mut self, toks: &Array, lps: &Array, ids: &[usize]) -> Result<Vec<usize>> {
        let (toks, lps) = (toks.to_vec::<u32>()?, lps.to_vec::<f32>()?);
        let mut keep = Vec::with_capacity(ids.len());
        for (b, &id) in ids.iter().enumerate() {
            let s = self.seq(id);
            if !s.done() {
                s.accept(toks[b], lps[b]);
            }
            if s.done() {
                self.release(id);
            } else {
                keep.push(b);
            }
        }
        Ok(keep)
    }
}

fn index(rows: &[usize]) -> Result<Array> {
    Ok(Array::from_slice(&rows.iter().map(|&r| r as i32).collect::<Vec<_>>(), &[rows.len()])?)
}

/// A request sent to the loop.
struct Submit {
    seq: Seq,
}

/// Counters of a running [`Engine`].
#[derive(Debug, Default)]
struct Shared {
    /// Requests submitted and not yet taken into a batch by the loop.
    queued: AtomicUsize,
    next_id: AtomicUsize,
    forwards: AtomicUsize,
    rows: AtomicUsize,
    max_rows: AtomicUsize,
}

/// Forward-pass counters of an [`Engine`] since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Forward passes run (prefill chunks and decode steps).
    pub forwards: usize,
    /// Sequences carried, summed over the passes (`rows / forwards` is the mean batch).
    pub rows: usize,
    /// The most sequences one pass carried.
    pub max_rows: usize,
}

/// Submits requests to an [`Engine`]'s loop. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Submit>,
    model: Model,
    shared: Arc<Shared>,
    max_queue: usize,
}

impl EngineHandle {
    /// Queue `prompt` with `cfg` (`max_new_tokens`, `sampling`, `stop_tokens`; `context` must be
    /// empty, `prefill_step_size` is the engine's). Invalid requests are refused here, before
    /// they reach the loop.
    pub fn submit(&self, prompt: Vec<u32>, cfg: &GenerateConfig) -> std::result::Result<RequestHandle, EngineError> {
        let queued = self.shared.queued.load(Ordering::SeqCst);
        if queued >= self.max_queue {
            return Err(EngineError::QueueFull(queued));
        }
        let (tx, rx) = mpsc::channel();
        let cancel = CancelHandle::default();
        let seq = Seq::new(&self.model, prompt, cfg, None, cancel.clone(), Some(tx))?;
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        let id = self.shared.next_id.fetch_add(1, Ordering::SeqCst) as u64;
        self.tx.send(Submit { seq }).map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            EngineError::Stopped
        })?;
        Ok(RequestHandle { id, events: rx, cancel })
    }

    /// Requests submitted and not yet started.
    pub fn queued(&self) -> usize {
        self.shared.queued.load(Ordering::SeqCst)
    }

    /// Forward-pass counters.
    pub fn stats(&self) -> EngineStats {
        let g = |a: &AtomicUsize| a.load(Ordering::SeqCst);
        EngineStats { forwards: g(&self.shared.forwards), rows: g(&self.shared.rows), max_rows: g(&self.shared.max_rows) }
    }
}

/// The continuous-batching loop of one model on its own thread (see [`crate::engine`]). The
/// loop ends when every [`EngineHandle`] is dropped and its requests are done.
pub struct Engine {
    handle: EngineHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Engine {
    /// Start the loop for `model`.
    pub fn start(model: Model, cfg: EngineConfig) -> Result<Engine> {
        let (tx, rx) = mpsc::channel::<Submit>();
        let shared = Arc::new(Shared::default());
        let handle = EngineHandle { tx, model: model.clone(), shared: shared.clone(), max_queue: cfg.max_queue };
        let thread = std::thread::Builder::new()
            .name("mlx-models-engine".into())
            .spawn(move || run_loop(model, cfg, rx, shared))
            .map_err(|e| ModelError::InvalidInput(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine { handle, thread: Some(thread) })
    }

    /// A handle to submit requests (clone it for other threads).
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }
}

impl Drop for Engine {
    /// Drops this engine's handle and waits for the loop when no other handle is left (a loop
    /// with live handles elsewhere keeps running and ends when they are dropped).
    fn drop(&mut self) {
        let (tx, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.handle.tx, tx));
        if let Some(t) = self.thread.take() {
            if Arc::strong_count(&self.handle.shared) <= 2 {
                let _ = t.join();
            }
        }
    }
}

fn run_loop(model: Model, cfg: EngineConfig, rx: Receiver<Submit>, shared: Arc<Shared>) {
    let mut s = Scheduler::new(model, cfg);
    let mut open = true;
    loop {
        // Take what was submitted; wait for it only when idle.
        loop {
            let got = if s.busy() || !open { rx.try_recv().map_err(|e| matches!(e, mpsc::TryRecvError::Disconnected)) } else { rx.recv().map_err(|_| true) };
            match got {
                Ok(Submit { seq }) => {
                    s.add(seq);
                }
                Err(disconnected) => {
                    if disconnected {
                        open = false;
                    }
                    break;
                }
            }
        }
        if !s.busy() {
            if !open {
                return;
            }
            continue;
        }
        let before = s.waiting();
        // A failed step has already sent `Error` to the requests it carried.
        let _ = s.step();
        shared.queued.fetch_sub(before.saturating_sub(s.waiting()).min(shared.queued.load(Ordering::SeqCst)), Ordering::SeqCst);
        for n in s.rows_per_forward.drain(..) {
            shared.forwards.fetch_add(1, Ordering::SeqCst);
            shared.rows.fetch_add(n, Ordering::SeqCst);
            shared.max_rows.fetch_max(n, Ordering::SeqCst);
        }
    }
}

/// Plan a decode step of a view over paged rows: one new token a row, `host`'s ids or row `b` of
/// the lazy `input` (`[B, 1]`).
fn schedule_decode(cache: &mut Cache, input: &Array, host: Option<&[u32]>) -> Result<()> {
    let inputs: Vec<(RowTokens, usize)> = match host {
        Some(ids) => ids.iter().map(|&t| (RowTokens::Host(vec![t]), 1)).collect(),
        None => (0..input.dims()[0] as usize).map(|b| Ok((RowTokens::Lazy(input.slice_axis(0, b, b + 1)?.reshape(&[1])?), 1))).collect::<Result<_>>()?,
    };
    cache.schedule_rows(&inputs)?;
    Ok(())
}
