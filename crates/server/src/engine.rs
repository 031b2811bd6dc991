//! The generation engine behind the HTTP layer: a request is a token prompt plus generation
//! settings, the answer a [`Submission`]: a stream of [`GenEvent`]s and a cancel handle.
//! Dropping the stream cancels the request (queued or running).
//!
//! Two implementations of [`Engine`]:
//! - [`BatchEngine`] (the default): every request of the model on one continuous-batching loop
//!   ([`mlx_models::Engine`]): sequences join the running batch between steps and leave it when
//!   done. On a GPU its sequences live in the model's paged pool, so a prompt whose leading
//!   blocks are cached prefills only the rest (`cached_tokens`); flat batch caches on the CPU
//!   (`--engine-kv` chooses).
//! - [`SequentialEngine`]: one request at a time on a dedicated thread, over
//!   `mlx_models::generate`; it keeps a few finished sequences' KV caches and continues the one
//!   sharing the longest prefix with a new prompt (a conversation continued through
//!   `previous_response_id` or a resent chat history prefills only its new tokens).
use mlx_models::chat::common_prefix_len;
use mlx_models::{generate, Cache, CancelHandle, FinishReason, GenerateConfig, Model};
use sampling::SamplingConfig;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// The whole prompt (the engine finds what it already holds).
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingConfig,
    /// Token ids that end generation (not reported as tokens).
    pub stop_tokens: Vec<u32>,
}

/// Events of one request, read on a blocking thread.
pub trait EventStream: Send {
    /// The next event; `None` when the engine dropped the request without a final event.
    fn recv(&mut self) -> Option<GenEvent>;
}

/// An accepted request.
pub struct Submission {
    pub events: Box<dyn EventStream>,
    /// Stops the generation early (the stream then ends with `Done`, finish reason `cancelled`).
    pub cancel: CancelHandle,
}

/// What a request reports, in order: `Token`s, then exactly one `Done` or `Error`.
#[derive(Debug, Clone)]
pub enum GenEvent {
    Token { id: u32, logprob: f32 },
    Done(GenSummary),
    Error(String),
}

/// The end of a request.
#[derive(Debug, Clone)]
pub struct GenSummary {
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens not recomputed (kept from an earlier sequence or found in the paged
    /// prefix cache).
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    /// The stop token that ended generation (in the KV cache, not reported as a token), when the
    /// engine reports it.
    pub stop_token: Option<u32>,
    /// Time the request waited in the queue.
    pub queue_time: Duration,
    /// Prefill plus first token, from the start of the run.
    pub ttft: Duration,
    pub decode_tokens_per_sec: f64,
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the request queue is full ({capacity} requests waiting); retry later")]
    QueueFull { capacity: usize },
    #[error("the generation engine has stopped")]
    ShutDown,
    /// The engine refused the request itself (prompt too long, bad sampling settings).
    #[error("{0}")]
    Invalid(String),
}

/// Counters of an engine.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    /// Requests accepted and not yet started.
    pub queued: usize,
    /// Requests generating now.
    pub running: usize,
    pub queue_capacity: usize,
    /// Paged KV pool: blocks in use, blocks holding reusable prefix content, total blocks.
    pub kv_blocks_used: Option<usize>,
    pub kv_blocks_cached: Option<usize>,
    pub kv_blocks_total: Option<usize>,
    /// Largest number of sequences one forward pass carried so far.
    pub max_sequences_per_step: usize,
}

/// A generation engine for one model.
pub trait Engine: Send + Sync {
    /// Queue `req`. Dropping the returned stream cancels it.
    fn submit(&self, req: GenRequest) -> Result<Submission, SubmitError>;
    fn stats(&self) -> EngineStats;
}

fn paged_blocks(model: &Model) -> (Option<usize>, Option<usize>, Option<usize>) {
    match model.paged_stats() {
        Some(s) => (
            Some(s.groups.iter().map(|g| g.in_use).sum()),
            Some(s.groups.iter().map(|g| g.cached).sum()),
            Some(s.groups.iter().map(|g| g.total).sum()),
        ),
        None => (None, None, None),
    }
}

struct Job {
    req: GenRequest,
    tx: UnboundedSender<GenEvent>,
    cancel: CancelHandle,
    enqueued: Instant,
}

struct TokioStream(UnboundedReceiver<GenEvent>);

impl EventStream for TokioStream {
    fn recv(&mut self) -> Option<GenEvent> {
        self.0.blocking_recv()
    }
}

struct Shared {
    queued: AtomicUsize,
    running: AtomicUsize,
    steps_max: AtomicU64,
}

/// One request at a time on a dedicated thread (see the module docs).
pub struct SequentialEngine {
    tx: SyncSender<Job>,
    model: Model,
    capacity: usize,
    shared: Arc<Shared>,
}

/// A finished sequence kept for reuse: `ids` are exactly the tokens `cache` holds.
struct Kept {
    ids: Vec<u32>,
    cache: Cache,
}

impl SequentialEngine {
    /// Start the worker thread. `queue_capacity`: requests that may wait (more are refused);
    /// `kept_sequences`: finished sequences whose caches are kept for prefix reuse.
    pub fn start(
        model: Model,
        queue_capacity: usize,
        kept_sequences: usize,
    ) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<Job>(queue_capacity);
        let shared = Arc::new(Shared {
            queued: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            steps_max: AtomicU64::new(0),
        });
        let (m, sh) = (model.clone(), shared.clone());
        std::thread::Builder::new()
            .name("mlx-engine".into())
            .spawn(move || {
                let mut kept: Vec<Kept> = Vec::new();
                while let Ok(job) = rx.recv() {
                    sh.queued.fetch_sub(1, Ordering::SeqCst);
                    if job.tx.is_closed() {
                        continue;
                    }
                    sh.running.store(1, Ordering::SeqCst);
                    sh.steps_max.store(1, Ordering::SeqCst);
                    let tx = job.tx.clone();
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run_job(&m, &mut kept, kept_sequences, job)
                    }));
                    if r.is_err() {
                        kept.clear();
                        let _ = tx.send(GenEvent::Error(
                            "the generation engine failed on this request (internal error)".into(),
                        ));
                    }
                    sh.running.store(0, Ordering::SeqCst);
                }
            })?;
        Ok(SequentialEngine {
            tx,
            model,
            capacity: queue_capacity,
            shared,
        })
    }
}

impl Engine for SequentialEngine {
    fn submit(&self, req: GenRequest) -> Result<Submission, SubmitError> {
        let (tx, rx) = unbounded_channel();
        let cancel = CancelHandle::default();
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(Job {
            req,
            tx,
            cancel: cancel.clone(),
            enqueued: Instant::now(),
        }) {
            Ok(()) => Ok(Submission {
                events: Box::new(TokioStream(rx)),
                cancel,
            }),
            Err(e) => {
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::QueueFull {
                        capacity: self.capacity,
                    },
                    TrySendError::Disconnected(_) => SubmitError::ShutDown,
                })
            }
        }
    }

    fn stats(&self) -> EngineStats {
        let (used, cached, total) = paged_blocks(&self.model);
        EngineStats {
            queued: self.shared.queued.load(Ordering::SeqCst),
            running: self.shared.running.load(Ordering::SeqCst),
            queue_capacity: self.capacity,
            kv_blocks_used: used,
            kv_blocks_cached: cached,
            kv_blocks_total: total,
            max_sequences_per_step: self.shared.steps_max.load(Ordering::SeqCst) as usize,
        }
    }
}

/// Take the kept sequence sharing the longest prefix with `prompt`, cut back to that prefix
/// (leaving at least one prompt token to prefill); a fresh cache when none shares anything or
/// the best one cannot be cut (recurrent layers).
fn take_cache(model: &Model, kept: &mut Vec<Kept>, prompt: &[u32]) -> (Cache, usize) {
    let best = kept
        .iter()
        .enumerate()
        .map(|(i, k)| (i, common_prefix_len(&k.ids, prompt)))
        .max_by_key(|&(_, n)| n);
    if let Some((i, n)) = best {
        let keep = n.min(prompt.len() - 1);
        if keep > 0 {
            let Kept { ids, mut cache } = kept.remove(i);
            if keep == ids.len() || cache.trim(ids.len() - keep).is_ok() {
                return (cache, keep);
            }
        }
    }
    (model.new_cache(), 0)
}

fn run_job(model: &Model, kept: &mut Vec<Kept>, max_kept: usize, job: Job) {
    let Job {
        req,
        tx,
        cancel,
        enqueued,
    } = job;
    let queue_time = enqueued.elapsed();
    let (mut cache, keep) = take_cache(model, kept, &req.prompt);
    let hits_before = model.paged_stats().map_or(0, |s| s.cached_prompt_tokens);
    let cfg = GenerateConfig {
        max_new_tokens: req.max_new_tokens,
        sampling: req.sampling.clone(),
        prefill_step_size: 2048,
        stop_tokens: Some(req.stop_tokens.clone()),
        context: req.prompt[..keep].to_vec(),
    };
    let mut generated: Vec<u32> = Vec::new();
    let outcome =
        (|| -> mlx_models::Result<(FinishReason, Option<u32>, mlx_models::Performance)> {
            let mut gen =
                generate(model, &mut cache, &req.prompt[keep..], cfg)?.with_cancel(cancel.clone());
            for t in gen.by_ref() {
                let t = t?;
                generated.push(t.id);
                if tx
                    .send(GenEvent::Token {
                        id: t.id,
                        logprob: t.logprob,
                    })
                    .is_err()
                {
                    cancel.cancel();
                }
            }
            Ok((
                gen.finish_reason().unwrap_or(FinishReason::Stop),
                gen.stop_token(),
                gen.performance(),
            ))
        })();
    match outcome {
        Ok((finish_reason, stop, perf)) => {
            let hits = model
                .paged_stats()
                .map_or(0, |s| s.cached_prompt_tokens)
                .saturating_sub(hits_before) as usize;
            let mut ids = req.prompt.clone();
            ids.extend_from_slice(&generated);
            ids.extend(stop);
            let held = cache.offset();
            if held <= ids.len() && max_kept > 0 {
                ids.truncate(held);
                if kept.len() >= max_kept {
                    kept.remove(0);
                }
                kept.push(Kept { ids, cache });
            }
            let _ = tx.send(GenEvent::Done(GenSummary {
                finish_reason,
                prompt_tokens: req.prompt.len(),
                cached_tokens: (keep + hits).min(req.prompt.len()),
                generated_tokens: generated.len(),
                stop_token: stop,
                queue_time,
                ttft: Duration::from_secs_f64(perf.ttft_ms / 1e3),
                decode_tokens_per_sec: perf.decode_tokens_per_sec,
            }));
        }
        Err(e) => {
            let _ = tx.send(GenEvent::Error(e.to_string()));
        }
    }
}

/// Every request on one continuous-batching loop ([`mlx_models::Engine`]).
pub struct BatchEngine {
    engine: mlx_models::Engine,
    model: Model,
    capacity: usize,
    /// Requests accepted and not yet finished (queued ones included).
    inflight: Arc<AtomicUsize>,
}

impl BatchEngine {
    /// Start the loop: at most `max_batch` sequences per forward pass, `max_queue` waiting, K/V
    /// where `kv` says.
    pub fn start(
        model: Model,
        max_batch: usize,
        max_queue: usize,
        kv: mlx_models::EngineKv,
    ) -> mlx_models::Result<Self> {
        let cfg = mlx_models::EngineConfig {
            max_batch,
            kv,
            max_queue,
            ..Default::default()
        };
        let engine = mlx_models::Engine::start(model.clone(), cfg)?;
        Ok(BatchEngine {
            engine,
            model,
            capacity: max_queue,
            inflight: Arc::new(AtomicUsize::new(0)),
        })
    }
}

/// A request of the batching loop; dropping it cancels the request.
struct BatchStream {
    h: mlx_models::RequestHandle,
    prompt_tokens: usize,
    enqueued: Instant,
    inflight: Option<Arc<AtomicUsize>>,
}

impl BatchStream {
    fn done(&mut self) {
        if let Some(n) = self.inflight.take() {
            n.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl EventStream for BatchStream {
    fn recv(&mut self) -> Option<GenEvent> {
        let ev = match self.h.events.recv() {
            Ok(mlx_models::Event::Token(t)) => {
                return Some(GenEvent::Token {
                    id: t.id,
                    logprob: t.logprob,
                })
            }
            Ok(mlx_models::Event::Finished {
                reason,
                usage,
                performance,
            }) => {
                let ttft = Duration::from_secs_f64(performance.ttft_ms / 1e3);
                GenEvent::Done(GenSummary {
                    finish_reason: reason,
                    prompt_tokens: usage.prompt_tokens.max(self.prompt_tokens),
                    cached_tokens: usage.cached_prompt_tokens,
                    generated_tokens: usage.completion_tokens,
                    stop_token: None,
                    queue_time: self.enqueued.elapsed().saturating_sub(ttft),
                    ttft,
                    decode_tokens_per_sec: performance.decode_tokens_per_sec,
                })
            }
            Ok(mlx_models::Event::Error(e)) => GenEvent::Error(e),
            Err(_) => {
                self.done();
                return None;
            }
        };
        self.done();
        Some(ev)
    }
}

impl Drop for BatchStream {
    fn drop(&mut self) {
        self.h.cancel.cancel();
        self.done();
    }
}

impl Engine for BatchEngine {
    fn submit(&self, req: GenRequest) -> Result<Submission, SubmitError> {
        let cfg = GenerateConfig {
            max_new_tokens: req.max_new_tokens,
            sampling: req.sampling,
            stop_tokens: Some(req.stop_tokens),
            ..Default::default()
        };
        let prompt_tokens = req.prompt.len();
        let h = self
            .engine
            .handle()
            .submit(req.prompt, &cfg)
            .map_err(|e| match e {
                mlx_models::EngineError::QueueFull(_) => SubmitError::QueueFull {
                    capacity: self.capacity,
                },
                mlx_models::EngineError::Stopped => SubmitError::ShutDown,
                mlx_models::EngineError::Model(m) => SubmitError::Invalid(m.to_string()),
            })?;
        self.inflight.fetch_add(1, Ordering::SeqCst);
        let cancel = h.cancel.clone();
        Ok(Submission {
            events: Box::new(BatchStream {
                h,
                prompt_tokens,
                enqueued: Instant::now(),
                inflight: Some(self.inflight.clone()),
            }),
            cancel,
        })
    }

    fn stats(&self) -> EngineStats {
        let handle = self.engine.handle();
        let queued = handle.queued();
        let s = handle.stats();
        let (used, cached, total) = paged_blocks(&self.model);
        EngineStats {
            queued,
            running: self.inflight.load(Ordering::SeqCst).saturating_sub(queued),
            queue_capacity: self.capacity,
            kv_blocks_used: used,
            kv_blocks_cached: cached,
            kv_blocks_total: total,
            max_sequences_per_step: s.max_rows,
        }
    }
}
