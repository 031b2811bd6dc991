//! A drafter on a thread of its own ([`crate::DraftAhead::Background`]): it drafts ahead from
//! each proposal while the caller's thread builds and runs the verify forward, so that the two
//! graphs are built in parallel instead of one after the other.
//!
//! MLX gives each thread its own default stream, and a lazy array can only be evaluated on the
//! thread that made it: only token ids and evaluated arrays cross between the threads. The
//! drafter's model arrays are computed at load ([`mlx_models::Model::materialize`]); a drafter
//! that reads the target's states (its cache, hidden states or taps) cannot move, and
//! [`Background::spawn`] refuses it.
use crate::drafter::{Agreed, Draft, Drafter, Feedback};
use mlx_models::{Cache, ModelError, Result};
use sampling::SamplingConfig;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

/// Work for the drafter's thread. Jobs with a `reply` are answered in order; the others report
/// an error at the next answer.
enum Job {
    Propose { history: Vec<u32>, k: usize, cfg: SamplingConfig, reply: SyncSender<Result<Draft>> },
    Ahead { history: Vec<u32>, drafts: Vec<u32>, steps: usize },
    Feedback { history: Vec<u32>, drafts: Vec<u32>, accepted: usize, next: u32 },
    Skipped { history: Vec<u32>, window: usize },
    CatchUp { history: Vec<u32>, window: usize, cfg: SamplingConfig },
    Reserve(usize),
    Prefill { history: Vec<u32>, reply: SyncSender<Result<()>> },
    TargetPositions { reply: SyncSender<usize> },
    Agreement { reply: SyncSender<Result<Vec<Agreed>>> },
}

/// What the drafter says of itself that does not change (asked once, before it moves).
struct Fixed {
    vocab: usize,
    depth: usize,
    max_depth: Option<usize>,
    weight_bytes: Option<u64>,
    measures_agreement: bool,
}

/// A [`Drafter`] that runs ahead ([`Drafter::runs_ahead`]) moved to a thread of its own.
/// Proposals and the prefill wait for the thread; drafting ahead and catching up do not: the thread drafts
/// from the last proposal until it is next asked for an answer (or `steps` forwards), while the
/// caller goes on. Output is the drafter's own: the thread only changes when its work runs.
pub struct Background {
    jobs: Option<Sender<Job>>,
    /// Jobs with a reply sent so far: drafting ahead stops before a forward once the thread
    /// has one waiting.
    asked: Arc<AtomicUsize>,
    thread: Option<JoinHandle<Result<Box<dyn Drafter>>>>,
    fixed: Fixed,
}

impl Background {
    /// Move `inner` to a new thread. [`ModelError::UnsupportedOption`] for a drafter that does
    /// not run ahead or that reads the target's states.
    pub fn spawn(inner: Box<dyn Drafter>) -> Result<Self> {
        Self::try_spawn(inner).map_err(|(e, _)| e)
    }

    /// [`Background::spawn`], handing the drafter back with the error.
    pub(crate) fn try_spawn(mut inner: Box<dyn Drafter>) -> std::result::Result<Self, (ModelError, Box<dyn Drafter>)> {
        if !inner.runs_ahead() || inner.wants_target_hidden() || !inner.target_taps().is_empty() {
            return Err((
                ModelError::UnsupportedOption(
                    "drafting in the background: only a plain draft model runs on a thread of its own; this drafter reads the target's states".into(),
                ),
                inner,
            ));
        }
        if let Err(e) = inner.settle() {
            return Err((e, inner));
        }
        let fixed = Fixed {
            vocab: inner.vocab_size(),
            depth: inner.default_depth(),
            max_depth: inner.max_depth(),
            weight_bytes: inner.weight_bytes(),
            measures_agreement: inner.measures_agreement(),
        };
        let (tx, rx) = channel();
        let asked = Arc::new(AtomicUsize::new(0));
        let seen = asked.clone();
        // handed over through a slot, so that a thread that cannot start gives it back
        let slot = Arc::new(Mutex::new(Some(inner)));
        let handed = slot.clone();
        let started = std::thread::Builder::new().name("mlx-draft".into()).spawn(move || {
            match handed.lock().unwrap_or_else(PoisonError::into_inner).take() {
                Some(inner) => serve(inner, rx, seen),
                None => Err(ModelError::Worker("the draft thread found no drafter".into())),
            }
        });
        match started {
            Ok(thread) => Ok(Background { jobs: Some(tx), asked, thread: Some(thread), fixed }),
            Err(e) => {
                let e = ModelError::Worker(format!("cannot start the draft thread: {e}"));
                match slot.lock().unwrap_or_else(PoisonError::into_inner).take() {
                    Some(inner) => Err((e, inner)),
                    None => Err((e, Box::new(Lost))),
                }
            }
        }
    }

    /// Stop the thread and take the drafter back, settled ([`Drafter::settle`]) in the state
    /// its last job left it.
    pub fn into_inner(mut self) -> Result<Box<dyn Drafter>> {
        self.stop()
    }

    fn stop(&mut self) -> Result<Box<dyn Drafter>> {
        // drafting ahead stops at its next forward; the thread ends once the queue is empty
        self.asked.fetch_add(1, Ordering::AcqRel);
        self.jobs = None;
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(ModelError::Worker("the draft thread panicked".into())),
            None => Err(ModelError::Worker("the draft thread was already stopped".into())),
        }
    }

    fn send(&self, job: Job) -> Result<()> {
        self.jobs
            .as_ref()
            .and_then(|j| j.send(job).ok())
            .ok_or_else(|| ModelError::Worker("the draft thread stopped (it panicked)".into()))
    }

    /// Send a job with a reply and wait for it.
    fn ask<T>(&self, job: impl FnOnce(SyncSender<T>) -> Job) -> Result<T> {
        let (tx, rx) = sync_channel(1);
        self.asked.fetch_add(1, Ordering::AcqRel);
        self.send(job(tx))?;
        rx.recv().map_err(|_| ModelError::Worker("the draft thread stopped (it panicked)".into()))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        // nothing to report to: a drafter that failed to settle is dropped all the same
        let _ = self.stop();
    }
}

/// The drafter's thread: jobs in order until the sender is gone; returns the drafter, settled.
fn serve(mut inner: Box<dyn Drafter>, jobs: Receiver<Job>, asked: Arc<AtomicUsize>) -> Result<Box<dyn Drafter>> {
    let mut seen = 0;
    // an error of a job without a reply, for the next answer
    let mut deferred: Option<ModelError> = None;
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Propose { history, k, cfg, reply } => {
                seen += 1;
                let _ = reply.send(or_deferred(&mut deferred, || inner.propose(&history, k, &cfg)));
            }
            Job::Prefill { history, reply } => {
                seen += 1;
                let _ = reply.send(or_deferred(&mut deferred, || inner.prefill(&history)));
            }
            Job::Agreement { reply } => {
                seen += 1;
                let _ = reply.send(or_deferred(&mut deferred, || inner.agreement()));
            }
            Job::TargetPositions { reply } => {
                seen += 1;
                let _ = reply.send(inner.target_positions_run());
            }
            Job::Ahead { history, drafts, steps } => {
                let stop = || asked.load(Ordering::Acquire) > seen;
                if let Err(e) = inner.draft_ahead(&history, &drafts, steps, Some(&stop)) {
                    deferred.get_or_insert(e);
                }
            }
            Job::Feedback { history, drafts, accepted, next } => {
                let f = Feedback { history: &history, drafts: &drafts, accepted, next, hidden: None, taps: &[] };
                if let Err(e) = inner.feedback(&f) {
                    deferred.get_or_insert(e);
                }
            }
            Job::Skipped { history, window } => inner.skipped(&history, window),
            Job::CatchUp { history, window, cfg } => {
                if let Err(e) = inner.catch_up(&history, window, &cfg) {
                    deferred.get_or_insert(e);
                }
            }
            Job::Reserve(n) => inner.reserve(n),
        }
    }
    if let Some(e) = deferred {
        return Err(e);
    }
    inner.settle()?;
    Ok(inner)
}

/// The error a job without a reply left for the next answer, else `job`'s answer.
fn or_deferred<T>(deferred: &mut Option<ModelError>, job: impl FnOnce() -> Result<T>) -> Result<T> {
    match deferred.take() {
        Some(e) => Err(e),
        None => job(),
    }
}

impl Drafter for Background {
    fn propose(&mut self, history: &[u32], k: usize, sampling: &SamplingConfig) -> Result<Draft> {
        self.ask(|reply| Job::Propose { history: history.to_vec(), k, cfg: sampling.clone(), reply })?
    }
    /// The target's cache stays on the caller's thread: [`Drafter::propose`] (a drafter that
    /// reads it cannot be moved here).
    fn propose_on(&mut self, history: &[u32], k: usize, sampling: &SamplingConfig, _target_cache: &mut Cache) -> Result<Draft> {
        self.propose(history, k, sampling)
    }
    fn target_positions_run(&self) -> usize {
        // a counter: a thread that stopped has run nothing more (its error comes with the
        // next proposal)
        self.ask(|reply| Job::TargetPositions { reply }).unwrap_or(0)
    }
    /// Queued for the thread, which drafts until it is next asked for an answer or `steps`
    /// forwards have run; returns at once (`until` is the thread's own: its next question).
    fn draft_ahead(&mut self, history: &[u32], drafts: &[u32], steps: usize, _until: Option<&dyn Fn() -> bool>) -> Result<()> {
        self.send(Job::Ahead { history: history.to_vec(), drafts: drafts.to_vec(), steps })
    }
    fn runs_ahead(&self) -> bool {
        true
    }
    /// The drafter stays on its thread: nothing of it is lazy on this one.
    fn settle(&mut self) -> Result<()> {
        Ok(())
    }
    fn skipped(&mut self, history: &[u32], window: usize) {
        // a thread that stopped reports it at the next answer
        let _ = self.send(Job::Skipped { history: history.to_vec(), window });
    }
    /// Queued for the thread: its forwards run beside the target's plain steps.
    fn catch_up(&mut self, history: &[u32], window: usize, sampling: &SamplingConfig) -> Result<()> {
        self.send(Job::CatchUp { history: history.to_vec(), window, cfg: sampling.clone() })
    }
    fn measures_agreement(&self) -> bool {
        self.fixed.measures_agreement
    }
    /// Waits for the thread's queue (the catch-ups measured).
    fn agreement(&mut self) -> Result<Vec<Agreed>> {
        self.ask(|reply| Job::Agreement { reply })?
    }
    fn reserve(&mut self, positions: usize) {
        let _ = self.send(Job::Reserve(positions));
    }
    fn prefill(&mut self, history: &[u32]) -> Result<()> {
        self.ask(|reply| Job::Prefill { history: history.to_vec(), reply })?
    }
    fn feedback(&mut self, f: &Feedback<'_>) -> Result<()> {
        self.send(Job::Feedback { history: f.history.to_vec(), drafts: f.drafts.to_vec(), accepted: f.accepted, next: f.next })
    }
    fn weight_bytes(&self) -> Option<u64> {
        self.fixed.weight_bytes
    }
    fn vocab_size(&self) -> usize {
        self.fixed.vocab
    }
    fn default_depth(&self) -> usize {
        self.fixed.depth
    }
    fn max_depth(&self) -> Option<usize> {
        self.fixed.max_depth
    }
}

/// What is left of a drafter whose thread panicked: every proposal is a
/// [`ModelError::Worker`] error.
pub(crate) struct Lost;

impl Drafter for Lost {
    fn propose(&mut self, _history: &[u32], _k: usize, _sampling: &SamplingConfig) -> Result<Draft> {
        Err(ModelError::Worker("the drafter was lost: its thread panicked".into()))
    }
    fn prefill(&mut self, _history: &[u32]) -> Result<()> {
        Err(ModelError::Worker("the drafter was lost: its thread panicked".into()))
    }
    fn vocab_size(&self) -> usize {
        0
    }
    fn default_depth(&self) -> usize {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::Background;
    use crate::forward::probe::{call_everything, Probe};
    use std::sync::{Arc, Mutex};

    /// `Background` passes every call a drafter on its thread can take on to it, in order, and
    /// answers what the drafter says of itself as it does; a proposal on the target's cache is
    /// a plain proposal there (the target's cache stays on the caller's thread). A method added
    /// to the trait and not passed on would fail this test.
    #[test]
    fn every_call_reaches_the_drafter_on_its_thread() {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let mut bg = Background::spawn(Box::new(Probe { calls: calls.clone(), reads_target: false })).unwrap();
        let before: Vec<&str> = std::mem::take(&mut *calls.lock().unwrap());
        // asked once before it moves (its reading of the target's states checked first)
        for fact in ["runs_ahead", "wants_target_hidden", "target_taps", "vocab_size", "default_depth", "max_depth", "weight_bytes", "measures_agreement"] {
            assert!(before.contains(&fact), "{fact} not asked before the move: {before:?}");
        }
        // facts answered here; the target's cache stays on this thread: `propose_on` proposes
        assert_eq!(call_everything(&mut bg, false, true), 11);
        bg.into_inner().unwrap();
        let on_thread: Vec<&str> = std::mem::take(&mut *calls.lock().unwrap());
        assert_eq!(
            on_thread,
            ["propose", "propose", "target_positions_run", "draft_ahead", "skipped", "catch_up", "agreement", "reserve", "prefill", "feedback", "settle"]
        );
    }
}
