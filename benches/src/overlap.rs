//! `spec_trace --overlap SECONDS`: whether the draft's forwards and the target's verify forward
//! run side by side when each has a thread (and so an MLX stream) of its own, as
//! `DraftAhead::Background` runs them, and if not, whether the host or the device makes them
//! take turns.
//!
//! Two worker threads each own their work and their model:
//! - the draft's thread proposes `depth` greedy drafts from a fixed history (`DraftModel::propose`:
//!   `depth` one-row forwards, each queued as soon as it is built, and the drafts read back);
//! - the target's thread runs either an M-row verify forward (every row's logits and the cache
//!   evaluated, then the rows trimmed away), or one of two loads calibrated here to take about
//!   the verify's time alone: a chain of a few large matrix products (device work, few graph
//!   nodes) or a chain of thousands of one-element adds (host work per node, little device
//!   work).
//!
//! Each work is timed alone, then the draft's work and each target work repeat side by side for
//! SECONDS, both starting together. For each pair the report gives each side's median time
//! against its own alone, and their combined pace `alone_a / together_a + alone_b /
//! together_b`: 2 when they run side by side without slowing each other, 1 when they take turns
//! on one resource. Drafts that overlap the large products but not the adds are held up on the
//! host (a lock both threads' evaluations take); the other way round, on the device.
use mlx_array::random::{normal, Key};
use mlx_array::{Array, DType};
use mlx_models::{LoadOptions, Logits};
use mlx_speculative::{DraftModel, Drafter};
use sampling::SamplingConfig;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Res<T> = Result<T, String>;

/// One timed piece of work; the worker thread that built it runs it.
type Work = Box<dyn FnMut() -> Res<()>>;

/// What the measurement asks for.
pub struct OverlapArgs {
    pub target: String,
    pub draft: String,
    pub opts: LoadOptions,
    pub prompt: usize,
    /// Drafts per proposal (one-row forwards of the draft).
    pub depth: usize,
    /// Rows of the verify forward.
    pub rows: usize,
    /// Seconds each pair runs side by side.
    pub window: f64,
}

/// A thread owning its works: runs the one asked for, from a shared start, until a deadline.
struct Worker {
    jobs: Option<Sender<(usize, Arc<Barrier>, Duration)>>,
    times: Receiver<Res<Vec<f64>>>,
    names: Vec<String>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// A thread whose works `build` makes there (arrays and models stay on the thread that made
    /// them); their names in order.
    fn spawn(build: impl FnOnce() -> Res<Vec<(String, Work)>> + Send + 'static) -> Res<Worker> {
        let (jobs_tx, jobs) = channel::<(usize, Arc<Barrier>, Duration)>();
        let (times_tx, times) = channel();
        let (names_tx, names_rx) = channel();
        let thread = std::thread::Builder::new()
            .name("overlap-worker".into())
            .spawn(move || {
                let mut works = match build() {
                    Ok(w) => w,
                    Err(e) => {
                        let _ = names_tx.send(Err(e));
                        return;
                    }
                };
                let _ = names_tx.send(Ok(works.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>()));
                while let Ok((i, start, window)) = jobs.recv() {
                    start.wait();
                    let _ = times_tx.send(repeat(&mut works[i].1, window));
                }
            })
            .map_err(|e| format!("cannot start a worker thread: {e}"))?;
        let names = names_rx.recv().map_err(|_| "a worker thread stopped while loading".to_string())??;
        Ok(Worker { jobs: Some(jobs_tx), times, names, thread: Some(thread) })
    }

    fn index(&self, name: &str) -> Res<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| format!("no work named {name}"))
    }

    fn start(&self, work: usize, start: &Arc<Barrier>, window: Duration) -> Res<()> {
        self.jobs.as_ref().and_then(|j| j.send((work, start.clone(), window)).ok()).ok_or_else(|| "a worker thread stopped".to_string())
    }

    fn finish(&self) -> Res<Vec<f64>> {
        self.times.recv().map_err(|_| "a worker thread stopped".to_string())?
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `work` repeated until `window` has passed (at least 4 times): each call's ms, the first left
/// out.
fn repeat(work: &mut Work, window: Duration) -> Res<Vec<f64>> {
    let end = Instant::now() + window;
    let mut times = Vec::new();
    while times.len() < 4 || Instant::now() < end {
        let t = Instant::now();
        work()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.remove(0);
    Ok(times)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}


fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The draft's work: `depth` greedy drafts after a fixed history of `prompt` ids.
fn draft_work(dir: String, opts: LoadOptions, prompt: usize, depth: usize) -> Res<Vec<(String, Work)>> {
    let model = mlx_models::load_model(&dir, &opts).map_err(err)?.into_lm().map_err(err)?;
    let history = super::shared::prompt_ids(prompt, model.info().vocab_size);
    let mut drafter = DraftModel::new(model);
    drafter.prefill(&history[..prompt - 1]).map_err(err)?;
    let greedy = SamplingConfig::greedy();
    let work: Work = Box::new(move || {
        let d = drafter.propose(&history, depth, &greedy).map_err(err)?;
        if d.tokens.len() == depth { Ok(()) } else { Err(format!("the draft proposed {} of {depth} tokens", d.tokens.len())) }
    });
    Ok(vec![("draft".into(), work)])
}

/// The target's works: the verify forward and the two loads calibrated to its time alone.
fn target_work(dir: String, opts: LoadOptions, prompt: usize, rows: usize) -> Res<Vec<(String, Work)>> {
    let dtype = opts.dtype.unwrap_or(DType::F32);
    let model = mlx_models::load_model(&dir, &opts).map_err(err)?.into_lm().map_err(err)?;
    let ids = super::shared::prompt_ids(prompt + rows, model.info().vocab_size);
    let mut cache = model.new_cache();
    let pre = model
        .with_runtime(|rt| rt.forward(&Array::from_slice(&ids[..prompt], &[1, prompt])?, &mut cache, Logits::Last, false))
        .map_err(err)?;
    cache.eval_with(&pre.logits.iter().collect::<Vec<_>>()).map_err(err)?;
    let input = Array::from_slice(&ids[prompt..], &[1, rows]).map_err(err)?;
    let mut verify: Work = Box::new(move || {
        let out = model.with_runtime(|rt| rt.forward(&input, &mut cache, Logits::All, false)).map_err(err)?;
        let logits = out.logits.ok_or("the verify forward returned no logits")?;
        cache.eval_with(&[&logits]).map_err(err)?;
        cache.trim(rows).map_err(err)
    });
    let alone = super::shared::median_ms(1, 5, &mut verify)?;

    // large products: the largest square size one product of which takes at most a quarter
    // of the verify, as many of them as take about its time
    let key = Key::new(11).map_err(err)?;
    let mut chosen = None;
    for s in [256usize, 512, 1024, 2048, 4096, 8192] {
        let (x, w) = (normal(&[s, s], dtype, &key).map_err(err)?, normal(&[s, s], dtype, &key).map_err(err)?.mul_scalar(1.0 / (s as f32).sqrt()).map_err(err)?);
        mlx_array::eval(&[&x, &w]).map_err(err)?;
        let one = super::shared::median_ms(1, 3, || x.matmul(&w).and_then(|y| y.eval()).map_err(err))?;
        if chosen.is_some() && one > alone / 4.0 {
            break;
        }
        chosen = Some((s, x, w, one));
    }
    let (s, x, w, one) = chosen.ok_or("no product size")?;
    let n = ((alone / one).round() as usize).max(1);
    let products: Work = Box::new(move || {
        let mut y = x.clone();
        for _ in 0..n {
            y = y.matmul(&w).map_err(err)?;
        }
        y.eval().map_err(err)
    });

    // one-element adds: as many as take about the verify's time
    let one_add = Array::from_slice(&[1f32], &[1]).map_err(err)?;
    let chain = move |n: usize| -> Res<()> {
        let mut y = one_add.clone();
        for _ in 0..n {
            y = y.add_scalar(1.0).map_err(err)?;
        }
        y.eval().map_err(err)
    };
    let per = super::shared::median_ms(1, 3, || chain(2000))? / 2000.0;
    let m = ((alone / per).round() as usize).max(1);
    let adds: Work = Box::new(move || chain(m));
    Ok(vec![
        (format!("verify ({rows} rows)"), verify),
        (format!("products ({n} of {s}x{s})"), products),
        (format!("adds ({m} one-element adds)"), adds),
    ])
}

/// Run the measurement and print its report.
pub fn run(a: OverlapArgs) -> Res<()> {
    if a.prompt < 2 || a.depth == 0 || a.rows == 0 || a.window.is_nan() || a.window <= 0.0 {
        return Err("--overlap needs a positive window, --depth and --prompt of at least 2".into());
    }
    let window = Duration::from_secs_f64(a.window);
    let (opts, draft, prompt, depth) = (a.opts.clone(), a.draft.clone(), a.prompt, a.depth);
    let drafts = Worker::spawn(move || draft_work(draft, opts, prompt, depth))?;
    let (opts, target, rows) = (a.opts.clone(), a.target.clone(), a.rows);
    let targets = Worker::spawn(move || target_work(target, opts, prompt, rows))?;
    let d = drafts.index("draft")?;
    let alone = |w: &Worker, i: usize| -> Res<f64> {
        let start = Arc::new(Barrier::new(1));
        w.start(i, &start, window / 2)?;
        w.finish().map(median)
    };
    let draft_alone = alone(&drafts, d)?;
    println!("overlap: alone, draft ({depth} one-row forwards) {draft_alone:.2} ms");
    let mut alones = Vec::new();
    for (i, name) in targets.names.iter().enumerate() {
        let ms = alone(&targets, i)?;
        println!("overlap: alone, {name} {ms:.2} ms");
        alones.push(ms);
    }
    for (i, name) in targets.names.iter().enumerate() {
        let start = Arc::new(Barrier::new(2));
        drafts.start(d, &start, window)?;
        targets.start(i, &start, window)?;
        let (dt, tt) = (median(drafts.finish()?), median(targets.finish()?));
        let (sd, st) = (dt / draft_alone, tt / alones[i]);
        println!(
            "overlap: draft with {name}: draft {dt:.2} ms ({sd:.2}x alone), {name} {tt:.2} ms ({st:.2}x alone), combined pace {:.2} (2: side by side, 1: in turns)",
            1.0 / sd + 1.0 / st
        );
    }
    Ok(())
}
