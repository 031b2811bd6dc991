//! Continuous batching: one loop per model runs every live sequence in shared `[B, L]` forward
//! passes, and sequences join and leave between steps.
//!
//! Every live sequence is a row of one running batch cache ([`crate::batch`]). Each loop turn
//! (`Scheduler`) admits waiting requests while there is room (up to
//! [`EngineConfig::max_batch`] live sequences; identical prompts admitted together are computed
//! once, and the row is copied to each of them when its prompt is done), then runs one forward
//! pass over all rows:
//! - while some row still computes its prompt, a pass of each such row's next chunk of at most
//!   [`EngineConfig::prefill_step_size`] prompt tokens, or (a mixed pass) of at most
//!   [`EngineConfig::mixed_step_size`] beside one token of every decoding row (with
//!   [`PromptPasses::Separate`], prompts that join decoding rows run in passes of their own
//!   instead, each followed by a decode step, and join the rows once sampled). The pass takes
//!   the rows' tokens packed, `[1, T]` with `T` the tokens of all rows
//!   ([`crate::batch::Ragged`]): embeddings, norms, projections and MLPs compute real tokens
//!   only, and only attention (each row's queries against its own keys, a decoding row's one
//!   query without a mask) and the recurrences of the hybrid families split them by row.
//!   Decoding rows sample as in any step; a row whose prompt ends in the pass samples its
//!   first token and decodes from then on. Running sequences thus keep producing a token every
//!   pass while a new prompt is computed, and the prompt shares their forward pass
//!   ([`EngineStats::mixed_forwards`] counts such passes);
//! - otherwise a decode step: one token for every row, `[B, 1]` (one attention call over the
//!   rows, padding masked), pipelined (the next step is queued on the lazy tokens of this one
//!   before they are read back).
//!
//! Each sequence has its own sampler (its request's settings; its own random stream), penalty
//! history, stop tokens, stop guard and cancel flag; a finished or cancelled sequence leaves the
//! batch before the next step ([`crate::Cache::select_rows`]).
//!
//! [`Engine::start`] runs the loop on its own thread and gives a [`EngineHandle`] (`Send`,
//! `Sync`, `Clone`) to submit requests; each request streams [`Event`]s on its own channel.
//! [`crate::generate_batch`] runs the same loop on the caller's thread.
//!
//! Every row computes its prompt at its own pace. Attention K/V live in flat batch storage
//! ([`EngineKv::Flat`]: a request's prompt is always computed in full) or in the model's paged
//! pool ([`EngineKv::Paged`], the default on a GPU): every sequence then has its own blocks and
//! position, the rows are one view
//! (`crate::Cache::paged_rows`) whose steps read each row's keys from its blocks, and a prompt
//! whose leading blocks are cached (a repeated system prompt, a conversation sent again) skips
//! them ([`Usage::cached_prompt_tokens`]). For the hybrid families (Qwen3.5, LFM2) a skip
//! stops at the last block boundary with a recurrent-state snapshot: prompt chunks end at
//! multiples of [`crate::PagedConfig::snapshot_interval`], and a chunk that ends on a block
//! boundary keeps its row's state there, keyed like that prefix's blocks.
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
    /// Prompt tokens a row computes per forward pass that carries no decoding row (the prefill
    /// chunk; 0 = whole prompts). It bounds activation memory.
    pub prefill_step_size: usize,
    /// Prompt tokens a row computes per forward pass that also carries decoding rows (0 = whole
    /// prompts; [`PromptPasses::Mixed`]). A decoding row waits for the pass for its next token:
    /// a narrow chunk keeps the decoding rows going, a wide one finishes a prompt in fewer
    /// passes. Default 64.
    pub mixed_step_size: usize,
    /// Most requests waiting for a slot; [`EngineHandle::submit`] refuses more with
    /// [`EngineError::QueueFull`].
    pub max_queue: usize,
    /// Where the sequences' K/V live.
    pub kv: EngineKv,
    /// Whether prompt chunks share passes with decoding rows.
    pub prompt_passes: PromptPasses,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { max_batch: 32, prefill_step_size: 512, mixed_step_size: 64, max_queue: 256, kv: EngineKv::Auto, prompt_passes: PromptPasses::Auto }
    }
}

/// How an [`Engine`] computes the prompts of requests that join while others decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PromptPasses {
    /// [`PromptPasses::Mixed`] over the paged pool, [`PromptPasses::Separate`] over flat batch
    /// caches. Measured on the CPU (BENCHMARKS.md, "Continuous batching: prompts joining
    /// decoding streams"): over flat caches mixed passes gave fewer tok/s (0.85x) and a later
    /// first token (1.7x) than separate ones (a mixed pass also moves every decoding row's
    /// stored K/V right to keep the rows aligned; not profiled); over the paged pool the same
    /// tok/s within noise, a later first token (1.25x) and 2-3x shorter stalls of the streams
    /// already decoding, which is what mixing is for.
    #[default]
    Auto,
    /// A prompt's chunks of [`EngineConfig::mixed_step_size`] tokens share passes with one
    /// token of every decoding row.
    Mixed,
    /// Prompts joining decoding rows are computed in a batch of their own (chunks of
    /// [`EngineConfig::prefill_step_size`]), each pass followed by a decode step of the running
    /// rows; the batch joins the running rows once none of its prompts is left to compute
    /// (requests arriving meanwhile wait for that).
    Separate,
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
    /// caches; hybrid families: up to the last recurrent-state snapshot, see [`crate::engine`]).
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
    /// When the loop took the request into a batch.
    admitted: Instant,
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
            admitted: Instant::now(),
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

/// A row of the running cache.
#[derive(Clone)]
struct Row {
    /// The sequence (slab id).
    seq: usize,
    /// Sequences admitted with the same prompt: each gets a copy of this row when its prompt is
    /// done (one prompt computed once for a group).
    copies: Vec<usize>,
    /// Prompt positions computed so far (or served by the prefix cache).
    at: usize,
    /// The prompt's length: the row decodes once `at` reaches it.
    len: usize,
}

impl Row {
    fn prefilling(&self) -> bool {
        self.at < self.len
    }

    /// The row's sequence and its copies.
    fn members(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(self.seq).chain(self.copies.iter().copied())
    }
}

/// The continuous-batching loop over one model (see [`crate::engine`]).
pub(crate) struct Scheduler {
    model: Model,
    cfg: EngineConfig,
    pub(crate) seqs: Vec<Option<Seq>>,
    waiting: VecDeque<usize>,
    /// Every live row: decoding ones and ones still computing their prompt.
    running: Option<Cache>,
    /// The running cache's rows, in row order.
    rows: Vec<Row>,
    /// A decode step queued on the running rows whose tokens are not read yet (pipelining:
    /// step `n + 1` is queued on the lazy tokens of step `n` before they are read back).
    pending: Option<(Array, Array)>,
    /// Rows of every forward pass, in order.
    pub(crate) rows_per_forward: Vec<usize>,
    /// Forward passes that carried prompt-chunk rows and decode rows together, since last read.
    pub(crate) mixed_forwards: usize,
    /// The sequences live in the model's paged pool ([`EngineKv`]).
    paged: bool,
    /// Paged caches of models with recurrent layers: prompt chunks end at multiples of this many
    /// positions, where the rows' state is kept as a prefix snapshot
    /// ([`crate::PagedConfig::snapshot_interval`]).
    snapshot_interval: Option<usize>,
    /// [`PromptPasses::Separate`]: prompts that joined decoding rows, computed in passes of
    /// their own (their rows and cache) until their first tokens.
    joining: Option<(Vec<Row>, Cache)>,
    /// Prompt passes are separate from decode steps ([`PromptPasses`]).
    separate: bool,
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
        let separate = match cfg.prompt_passes {
            PromptPasses::Auto => !paged,
            PromptPasses::Mixed => false,
            PromptPasses::Separate => true,
        };
        Scheduler { model, cfg, seqs: Vec::new(), waiting: VecDeque::new(), running: None, rows: Vec::new(), pending: None, rows_per_forward: Vec::new(), mixed_forwards: 0, paged, snapshot_interval: None, joining: None, separate }
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
        !self.waiting.is_empty() || !self.rows.is_empty() || self.joining.is_some()
    }

    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    fn seq(&mut self, id: usize) -> &mut Seq {
        self.seqs[id].as_mut().expect("live slab id")
    }

    fn live(&self, id: usize) -> &Seq {
        self.seqs[id].as_ref().expect("live slab id")
    }

    /// Remove finished sequences from the slab when they stream to a channel (collected ones
    /// stay for the caller).
    fn release(&mut self, id: usize) {
        if matches!(self.seqs[id].as_ref().map(|s| &s.sink), Some(Sink::Channel(_))) {
            self.seqs[id] = None;
        }
    }

    /// One turn: admit waiting requests if there is room, then one forward pass over every
    /// row: a decode step, or (while some row computes its prompt) a pass that carries each
    /// such row's next prompt chunk beside one token of every decoding row.
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
        // Every row computes its prompt at its own pace (passes take the rows' tokens packed).
        // Separate prompt passes: prompts that would join decoding rows go to a batch of their
        // own, admitted when it is empty.
        let decoding = self.rows.iter().any(|r| !r.prefilling());
        if !self.waiting.is_empty() && (!self.separate || !decoding || self.joining.is_none()) {
            let joining: usize = self.joining.iter().flat_map(|(r, _)| r).map(|r| 1 + r.copies.len()).sum();
            let live: usize = self.rows.iter().map(|r| 1 + r.copies.len()).sum::<usize>() + joining;
            let room = self.cfg.max_batch.max(1).saturating_sub(live);
            if room > 0 {
                let take: Vec<usize> = (0..room.min(self.waiting.len())).filter_map(|_| self.waiting.pop_front()).collect();
                match self.prepare(&take) {
                    Ok((rows, cache)) if self.separate && decoding => self.joining = Some((rows, cache)),
                    Ok((rows, cache)) => {
                        if let Err(e) = self.join(rows, cache) {
                            self.fail_rows(&e);
                            return Err(e);
                        }
                    }
                    Err(e) => {
                        for id in take {
                            self.seq(id).fail(&e.to_string());
                            self.release(id);
                        }
                        return Err(e);
                    }
                }
            }
        }
        if let Err(e) = self.joining_pass() {
            self.fail_rows(&e);
            return Err(e);
        }
        if self.rows.is_empty() {
            return Ok(());
        }
        let r = if self.rows.iter().any(Row::prefilling) { self.mixed() } else { self.decode() };
        if let Err(e) = r {
            self.fail_rows(&e);
            return Err(e);
        }
        Ok(())
    }

    /// [`PromptPasses::Separate`]: one pass of the joining prompts' own batch (the running rows'
    /// queued step is read first); once none of them computes its prompt any more, they join
    /// the running rows.
    fn joining_pass(&mut self) -> Result<()> {
        let Some((rows, cache)) = self.joining.take() else { return Ok(()) };
        self.flush_pending()?;
        let running = (std::mem::replace(&mut self.rows, rows), self.running.replace(cache));
        let r = self.mixed();
        let joined = (std::mem::replace(&mut self.rows, running.0), std::mem::replace(&mut self.running, running.1));
        if let Err(e) = r {
            // the joining rows fail with the running ones
            self.rows.extend(joined.0);
            return Err(e);
        }
        match joined {
            (rows, Some(cache)) if !rows.is_empty() => {
                if rows.iter().any(Row::prefilling) {
                    self.joining = Some((rows, cache));
                } else {
                    self.join(rows, cache)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Every live row fails with `e`.
    fn fail_rows(&mut self, e: &ModelError) {
        let joining = self.joining.take().map(|(r, _)| r).unwrap_or_default();
        for row in std::mem::take(&mut self.rows).into_iter().chain(joining) {
            for id in row.members() {
                if let Some(s) = self.seqs[id].as_mut() {
                    if !s.done() {
                        s.fail(&e.to_string());
                    }
                }
                self.release(id);
            }
        }
        self.running = None;
        self.pending = None;
    }

    /// Rows for the sequences `ids` (one per distinct prompt, the others its copies) and their
    /// cache: flat rows holding nothing yet, or paged sequences begun on their prompts (a cached
    /// prefix, with its recurrent-state snapshot for hybrid models, is not computed again).
    fn prepare(&mut self, ids: &[usize]) -> Result<(Vec<Row>, Cache)> {
        let mut rows: Vec<Row> = Vec::new();
        for &id in ids {
            let len = self.live(id).prompt.len();
            match rows.iter().position(|r| self.live(r.seq).prompt == self.live(id).prompt) {
                Some(r) => rows[r].copies.push(id),
                None => rows.push(Row { seq: id, copies: Vec::new(), at: 0, len }),
            }
            self.seq(id).admitted = Instant::now();
        }
        if !self.paged {
            let spec = self.model.with_runtime(|rt| rt.cache_spec());
            let cache = Cache::new_batch(&spec, vec![0; rows.len()])?;
            return Ok((rows, cache));
        }
        let mut caches = Vec::with_capacity(rows.len());
        for r in &mut rows {
            let mut c = self.model.new_cache();
            if self.snapshot_interval.is_none() {
                self.snapshot_interval = c.snapshot_plan(None).map(|(interval, _)| interval);
            }
            let skipped = c.begin_paged(&self.live(r.seq).prompt, true)?;
            r.at = skipped;
            for id in r.members().collect::<Vec<_>>() {
                self.seq(id).cached = skipped;
            }
            caches.push(c);
        }
        let mut view = Cache::paged_rows(caches)?;
        view.set_queue_with_outputs(true);
        Ok((rows, view))
    }

    /// Add `rows` (in `cache`) after the running rows.
    fn join(&mut self, rows: Vec<Row>, cache: Cache) -> Result<()> {
        // The running rows' queued step is read first: the merged batch starts from host tokens.
        self.flush_pending()?;
        match self.running.as_mut() {
            Some(r) => r.merge_batch(cache)?,
            None => self.running = Some(cache),
        }
        self.rows.extend(rows);
        Ok(())
    }

    /// Rows whose sequences were all cancelled leave; a cancelled sequence of a row that goes on
    /// (a copy, or the row's own while copies remain) ends at once.
    fn drop_cancelled(&mut self) -> Result<()> {
        let mut keep = Vec::with_capacity(self.rows.len());
        for b in 0..self.rows.len() {
            let members: Vec<usize> = self.rows[b].members().collect();
            let (gone, left): (Vec<usize>, Vec<usize>) = members.into_iter().partition(|&id| self.live(id).cancel.is_cancelled());
            for &id in &gone {
                self.seq(id).end(FinishReason::Cancelled);
                self.release(id);
            }
            if let Some((&first, rest)) = left.split_first() {
                (self.rows[b].seq, self.rows[b].copies) = (first, rest.to_vec());
                keep.push(b);
            }
        }
        if keep.len() != self.rows.len() {
            self.filter(&keep)?;
        }
        Ok(())
    }

    /// Tokens each row computes in the next pass: one for a decoding row; a prompt row its next
    /// chunk of at most [`EngineConfig::prefill_step_size`] ([`EngineConfig::mixed_step_size`]
    /// beside decoding rows), from its own position (paged: ending at a snapshot boundary of a
    /// hybrid model).
    fn counts(&self) -> Vec<usize> {
        let decoding = self.rows.iter().any(|r| !r.prefilling());
        let chunk = if decoding { self.cfg.mixed_step_size } else { self.cfg.prefill_step_size };
        let chunk = if chunk == 0 { usize::MAX } else { chunk };
        self.rows
            .iter()
            .map(|r| {
                if !r.prefilling() {
                    return 1;
                }
                let n = (r.len - r.at).min(chunk);
                match self.snapshot_interval {
                    Some(iv) => n.min((r.at / iv + 1) * iv - r.at),
                    None => n,
                }
            })
            .collect()
    }

    /// One forward pass over every row while some compute their prompt: each decoding row's
    /// next token beside each prompt row's next chunk (packed, `[1, T]`). Decoding rows and rows whose prompt ends here sample; a prompt that ends
    /// gives a row to each sequence that shares it.
    fn mixed(&mut self) -> Result<()> {
        self.flush_pending()?;
        self.drop_cancelled()?;
        if self.rows.is_empty() {
            return Ok(());
        }
        let counts = self.counts();
        let n = self.rows.len();
        let mut cache = self.running.take().ok_or_else(|| ModelError::Cache("running rows without a cache (internal error)".into()))?;
        let starts: Vec<usize> = if self.paged {
            let inputs: Vec<(RowTokens, usize)> = self.rows.iter().zip(&counts).map(|(r, &c)| if r.prefilling() { (RowTokens::Next, c) } else { (RowTokens::Host(vec![self.live(r.seq).last()]), 1) }).collect();
            let plan = cache.schedule_rows(&inputs)?;
            for ((r, &c), &(pos, got)) in self.rows.iter().zip(&counts).zip(&plan) {
                if got != c || (r.prefilling() && pos != r.at) {
                    return Err(ModelError::Cache(format!("paged row planned {got} tokens from {pos}, expected {c} from {} (internal error)", r.at)));
                }
            }
            plan.iter().map(|&(pos, _)| pos).collect()
        } else {
            self.rows.iter().map(|r| r.at).collect()
        };
        // The rows' tokens packed, [1, T]: per-token layers compute real tokens only.
        cache.set_step_tokens(counts.clone())?;
        let mut ids = Vec::with_capacity(counts.iter().sum());
        for ((r, &c), &pos) in self.rows.iter().zip(&counts).zip(&starts) {
            if r.prefilling() {
                ids.extend_from_slice(&self.live(r.seq).prompt[pos..pos + c]);
            } else {
                ids.push(self.live(r.seq).last());
            }
        }
        let t = Array::from_slice(&ids, &[1, ids.len()])?;
        let out = self.model.with_runtime(|rt| rt.forward(&t, &mut cache, Logits::Last, false))?;
        self.rows_per_forward.push(n);
        let decoding = self.rows.iter().any(|r| !r.prefilling());
        if decoding && counts.iter().zip(&self.rows).any(|(&c, r)| r.prefilling() && c > 0) {
            self.mixed_forwards += 1;
        }
        // Rows that sample: decoding ones, and every sequence of a prompt that ends here.
        let (mut pick, mut who) = (Vec::new(), Vec::new());
        for (b, (r, &c)) in self.rows.iter().zip(&counts).enumerate() {
            if !r.prefilling() {
                pick.push(b);
                who.push(r.seq);
            } else if r.at + c == r.len {
                for id in r.members() {
                    pick.push(b);
                    who.push(id);
                }
            }
        }
        let alive = if pick.is_empty() {
            cache.eval_with(&[])?;
            Vec::new()
        } else {
            let logits = out.logits.ok_or_else(|| ModelError::Cache("forward returned no logits (internal error)".into()))?;
            let logits = logits.reshape(&[n as i32, -1])?;
            let identity = pick.len() == n && pick.iter().enumerate().all(|(i, &b)| i == b);
            let logits = if identity { logits } else { logits.take(&index(&pick)?, 0)? };
            for (&b, &id) in pick.iter().zip(&who) {
                if self.rows[b].prefilling() {
                    let s = self.seq(id);
                    s.prefill_time = s.admitted.elapsed();
                }
            }
            let (toks, lps) = self.sample(&logits, &who)?;
            cache.eval_with(&[&toks, &lps])?;
            let keep = self.accept(&toks, &lps, &who)?;
            let mut alive = vec![false; who.len()];
            for k in keep {
                alive[k] = true;
            }
            alive
        };
        // The rows after this pass: a prompt that ended becomes a decoding row per sequence still
        // going; finished rows leave.
        let (mut keep, mut rows) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut k = 0;
        for (b, (r, &c)) in self.rows.iter().zip(&counts).enumerate() {
            if r.prefilling() && r.at + c < r.len {
                keep.push(b);
                rows.push(Row { at: r.at + c, ..r.clone() });
                continue;
            }
            for id in r.members() {
                if alive[k] {
                    keep.push(b);
                    rows.push(Row { seq: id, copies: Vec::new(), at: r.len, len: r.len });
                }
                k += 1;
            }
        }
        self.rows = rows;
        if keep.is_empty() {
            return Ok(());
        }
        if keep.len() != n || keep.iter().enumerate().any(|(i, &b)| i != b) {
            cache.select_rows(&keep)?;
        }
        self.running = Some(cache);
        Ok(())
    }

    /// One decode step over the running rows: queue the step on host tokens unless one is
    /// queued already, queue the next one on its lazy tokens (when no row's sampling reads its
    /// history), then read the tokens back and hand them out.
    fn decode(&mut self) -> Result<()> {
        // Rows cancelled since the last step leave first.
        self.drop_cancelled()?;
        if self.rows.is_empty() {
            return Ok(());
        }
        let run: Vec<usize> = self.rows.iter().map(|r| r.seq).collect();
        let (toks, lps) = match self.pending.take() {
            Some(p) => p,
            None => {
                let input: Vec<u32> = run.iter().map(|&id| self.live(id).last()).collect();
                self.queue_step(&Array::from_slice(&input, &[input.len(), 1])?, Some(input.as_slice()))?
            }
        };
        let lazy = run.iter().all(|&id| self.live(id).lazy_feed);
        let next = if lazy { Some(self.queue_step(&toks.reshape(&[run.len() as i32, 1])?, None)?) } else { None };
        self.pending = next;
        let keep = self.accept(&toks, &lps, &run)?;
        if keep.len() != run.len() {
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
            let run: Vec<usize> = self.rows.iter().map(|r| r.seq).collect();
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
            let run: Vec<usize> = self.rows.iter().map(|r| r.seq).collect();
            let keep = self.accept(&toks, &lps, &run)?;
            if keep.len() != run.len() {
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
            self.rows.clear();
            return Ok(());
        }
        if let Some(c) = self.running.as_mut() {
            c.select_rows(keep)?;
        }
        if let Some((t, l)) = self.pending.take() {
            let idx = index(keep)?;
            self.pending = Some((t.take(&idx, 0)?, l.take(&idx, 0)?));
        }
        self.rows = keep.iter().map(|&b| self.rows[b].clone()).collect();
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
    mixed: AtomicUsize,
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
    /// Passes that carried prompt-chunk rows and decode rows together.
    pub mixed_forwards: usize,
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
        EngineStats { forwards: g(&self.shared.forwards), rows: g(&self.shared.rows), max_rows: g(&self.shared.max_rows), mixed_forwards: g(&self.shared.mixed) }
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
        shared.mixed.fetch_add(std::mem::take(&mut s.mixed_forwards), Ordering::SeqCst);
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
