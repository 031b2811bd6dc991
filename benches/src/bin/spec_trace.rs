//! Where a speculative generation's time goes, cycle by cycle: greedy decoding of `--new` tokens
//! with a draft model at a fixed or adaptive depth, repeated `--runs` times in one process (the
//! first run pays one-time costs of new shapes), printing each cycle's history length, drafts,
//! accepted drafts, the drafter's time (its `propose`, evaluated; drafting ahead runs later in
//! the cycle, outside it) and the whole cycle's time (and after a plain stretch the catch-ups
//! a drafter on its own thread ran during it, with their time there),
//! each plain stretch of adaptive depth, and per run the totals by kind and the fastest,
//! quartile, median and slowest speculative cycle (steadier than the rate where the host's
//! speed drifts):
//!
//! ```text
//! spec_trace --model TARGET --draft DRAFT [--depth 7] [--adaptive] [--new 256] [--runs 2]
//!            [--prompt 32] [--dtype bf16] [--kv flat] [--quiet] [--warm-up [--warm-up-cycles N]] [--draft-ahead N|until-verified]
//!            [--plain] [--chat TEXT] [--prompt-step N] [--temperature T [--seed S]]
//! ```
//!
//! `--prompt-step N` lengthens each run's prompt by N ids over the run before (run r prompts with
//! `--prompt` + r N ids): with N past the first run's last position, no later run repeats a
//! history length of an earlier one, so what a later run saves over the first is not a cache of
//! shapes seen before.
//!
//! `--chat TEXT` prompts with TEXT as a user message in the target's chat template (natural
//! text) instead of `--prompt` ids.
//!
//! `--temperature T` samples every run at T (seeded by `--seed`). With the draft model on its
//! own thread, each agreement line then gives, beside the greedy guesses, the mean of
//! `min(1, q(x) / p(x))` over the caught-up tokens (the draft's and the target's log-probs of
//! each sampled token): the acceptance estimate adaptive depth draws its verdicts from, to
//! hold against the cycles' acceptance by position printed after each run.
//!
//! `--plain` runs a plain greedy generation of the same prompt before each speculative one, in
//! the same process, and prints the ratio of their decode rates and whether the tokens agree:
//! the steady-state comparison (from the second run on, neither pays first-use costs).
//!
//! `--overlap SECONDS` runs no generation: it measures whether the draft's forwards and the
//! target's verify forward of `--depth` + 1 rows run side by side on threads of their own (as
//! `DraftAhead::Background` runs them), against two loads that tell the host from the device
//! (`benches/src/overlap.rs`).
use mlx_models::{generate, Cache, GenerateConfig, Model, Result as MResult, SpeculativeStats, Speculator, Token};
use mlx_speculative::{Draft, Drafter, SpeculativeDecoder};
use sampling::{Sampler, SamplingConfig};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[path = "../shared.rs"]
mod shared;

#[path = "../overlap.rs"]
mod overlap;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Cycle-by-cycle timing of speculative decoding.
#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    m: shared::ModelArgs,
    /// Draft checkpoint (any causal LM sharing the target's vocabulary).
    #[arg(long)]
    draft: String,
    /// Drafts per cycle (the most, with --adaptive).
    #[arg(long, default_value_t = 7)]
    depth: usize,
    /// Adaptive depth up to --depth.
    #[arg(long)]
    adaptive: bool,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 256)]
    new: usize,
    /// Generations in this process.
    #[arg(long, default_value_t = 2)]
    runs: usize,
    /// Only the per-run totals.
    #[arg(long)]
    quiet: bool,
    /// Draft forwards run ahead while the target verifies: a number, `until-verified` or `background`
    /// (default: the library's, `SpeculativeDecoder::default_draft_ahead`).
    #[arg(long)]
    draft_ahead: Option<mlx_speculative::DraftAhead>,
    /// Warm the decoder up first (`SpeculativeDecoder::warm_up`; its time is printed).
    #[arg(long)]
    warm_up: bool,
    /// Cycles of the warm-up at the deepest depth (`SpeculativeDecoder::with_warm_up_cycles`;
    /// default the library's). Needs --warm-up.
    #[arg(long, requires = "warm_up", value_parser = clap::value_parser!(u32).range(1..))]
    warm_up_cycles: Option<u32>,
    /// Before each speculative run, a plain greedy run of the same prompt (ratio and token
    /// agreement printed).
    #[arg(long)]
    plain: bool,
    /// Prompt with this user message in the target's chat template instead of --prompt ids.
    #[arg(long)]
    chat: Option<String>,
    /// Each run's prompt is this many ids longer than the run before's (not with --chat).
    #[arg(long, default_value_t = 0)]
    prompt_step: usize,
    /// Sampling temperature of every run (0: greedy). Above 0 the runs are seeded by --seed,
    /// and the plain run's tokens are not expected to be the speculative run's.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sampler seed of every run (default 0; only with --temperature above 0).
    #[arg(long)]
    seed: Option<u64>,
    /// Instead of generations: time the draft's proposals of --depth tokens and the target's
    /// verify forward of --depth + 1 rows, each alone and side by side on threads of their own
    /// for this many seconds (and against a device-heavy and a host-heavy load).
    #[arg(long, conflicts_with_all = ["adaptive", "draft_ahead", "warm_up", "plain", "chat", "prompt_step", "runs", "new", "quiet", "temperature", "seed"])]
    overlap: Option<f64>,
}

/// The drafter's time of its last proposal, shared with the tracer.
type Clock = Arc<Mutex<Option<f64>>>;

/// Catch-ups during plain stretches since the last cycle: calls and the drafter's seconds in
/// them (on its own thread: building and queueing the forwards).
type CatchUps = Arc<Mutex<(usize, f64)>>;

/// The drafter's last agreement report ([`Drafter::agreement`]) and the seconds the caller
/// waited for it.
type Agreement = Arc<Mutex<Option<(Vec<mlx_speculative::Agreed>, f64)>>>;

/// A drafter that times each proposal and each catch-up.
struct TimedDrafter {
    inner: Box<dyn Drafter>,
    last: Clock,
    catch_ups: CatchUps,
    agreement: Agreement,
}

impl Drafter for TimedDrafter {
    mlx_speculative::forward_drafter!(inner; except propose, propose_on, catch_up, agreement);
    fn propose(&mut self, history: &[u32], k: usize, sampling: &SamplingConfig) -> MResult<Draft> {
        let t = Instant::now();
        let d = self.inner.propose(history, k, sampling)?;
        *self.last.lock().expect("clock") = Some(t.elapsed().as_secs_f64());
        Ok(d)
    }
    fn propose_on(&mut self, history: &[u32], k: usize, sampling: &SamplingConfig, cache: &mut Cache) -> MResult<Draft> {
        let t = Instant::now();
        let d = self.inner.propose_on(history, k, sampling, cache)?;
        *self.last.lock().expect("clock") = Some(t.elapsed().as_secs_f64());
        Ok(d)
    }
    fn catch_up(&mut self, history: &[u32], window: usize, sampling: &SamplingConfig) -> MResult<()> {
        let t = Instant::now();
        self.inner.catch_up(history, window, sampling)?;
        let mut c = self.catch_ups.lock().expect("catch-ups");
        *c = (c.0 + 1, c.1 + t.elapsed().as_secs_f64());
        Ok(())
    }
    fn agreement(&mut self) -> MResult<Vec<mlx_speculative::Agreed>> {
        let t = Instant::now();
        let agreed = self.inner.agreement()?;
        *self.agreement.lock().expect("agreement") = Some((agreed.clone(), t.elapsed().as_secs_f64()));
        Ok(agreed)
    }
}

/// Totals of one run: (count, seconds, tokens) per kind.
#[derive(Default)]
struct Totals {
    spec: (usize, f64, usize),
    plain_cycles: (usize, f64, usize),
    stretches: (usize, f64, usize),
    draft_secs: f64,
    /// Seconds of each speculative cycle, in order.
    spec_secs: Vec<f64>,
}

/// A speculator that reports every call of the one it wraps.
struct Tracer<'a> {
    inner: &'a mut SpeculativeDecoder,
    clock: Clock,
    catch_ups: CatchUps,
    agreement: Agreement,
    quiet: bool,
    totals: Totals,
    /// The target's log-prob of each plain-stretch token, by history index.
    sampled: std::collections::BTreeMap<usize, f32>,
}

impl Speculator for Tracer<'_> {
    fn start(&mut self) {
        self.totals = Totals::default();
        self.sampled.clear();
        self.inner.start()
    }
    fn cycle(&mut self, model: &Model, cache: &mut Cache, history: &[u32], sampler: &mut Sampler, max: usize) -> MResult<Vec<Token>> {
        let before = self.inner.stats();
        *self.clock.lock().expect("clock") = None;
        let t = Instant::now();
        let out = self.inner.cycle(model, cache, history, sampler, max)?;
        let secs = t.elapsed().as_secs_f64();
        let after = self.inner.stats();
        let drafts = (after.depth_mean * after.cycles as f64 - before.depth_mean * before.cycles as f64).round() as usize;
        let draft = self.clock.lock().expect("clock").take().unwrap_or(0.0);
        let slot = if drafts > 0 { &mut self.totals.spec } else { &mut self.totals.plain_cycles };
        *slot = (slot.0 + 1, slot.1 + secs, slot.2 + out.len());
        if drafts > 0 {
            self.totals.spec_secs.push(secs);
        }
        self.totals.draft_secs += draft;
        // a proposal waits for the drafter's earlier jobs: every catch-up before it is counted
        let (calls, caught) = std::mem::take(&mut *self.catch_ups.lock().expect("catch-ups"));
        if !self.quiet {
            let after = if calls > 0 { format!(" (after {calls} catch-ups taking {:.2} ms on the drafter's thread)", caught * 1e3) } else { String::new() };
            println!("cycle at {}: {drafts} drafts, {} tokens, draft {:.2} ms, cycle {:.2} ms{after}", history.len(), out.len(), draft * 1e3, secs * 1e3);
        }
        Ok(out)
    }
    fn settle(&mut self, model: &Model, cache: &mut Cache, history: &[u32]) -> MResult<()> {
        self.inner.settle(model, cache, history)
    }
    fn reserve(&mut self, positions: usize) {
        self.inner.reserve(positions)
    }
    fn prefill(&mut self, model: &Model, history: &[u32]) -> MResult<()> {
        let t = Instant::now();
        self.inner.prefill(model, history)?;
        if !self.quiet {
            println!("draft prefill of {} tokens queued in {:.2} ms", history.len(), t.elapsed().as_secs_f64() * 1e3);
        }
        Ok(())
    }
    fn stats(&self) -> SpeculativeStats {
        self.inner.stats()
    }
    fn plain_tokens(&mut self, history: &[u32]) -> usize {
        let n = self.inner.plain_tokens(history);
        if let Some((agreed, secs)) = self.agreement.lock().expect("agreement").take().filter(|_| !self.quiet) {
            let guessed = agreed.iter().filter(|a| a.guessed).count();
            // at temperature > 0: the mean of min(1, q(x) / p(x)) over the tokens whose both
            // log-probs are known, the estimate of a first draft's acceptance the decoder draws from
            let weighed: Vec<f64> = agreed
                .iter()
                .filter_map(|a| Some(f64::from(a.logprob? - *self.sampled.get(&a.position)?).exp().min(1.0)))
                .collect();
            let weighed = match weighed.len() {
                0 => String::new(),
                m => format!("; min(1, q/p) mean {:.3} over {m}", weighed.iter().sum::<f64>() / m as f64),
            };
            println!("agreement at {}: {guessed} of {} caught-up tokens guessed{weighed} (waited {:.2} ms); next stretch {n} tokens", history.len(), agreed.len(), secs * 1e3);
        }
        n
    }
    fn plain_sampled(&mut self, history: &[u32], logprob: f32, sampling: &SamplingConfig) {
        if !history.is_empty() {
            self.sampled.insert(history.len() - 1, logprob);
        }
        self.inner.plain_sampled(history, logprob, sampling)
    }
    fn plain_progress(&mut self, history: &[u32], left: usize) -> MResult<()> {
        self.inner.plain_progress(history, left)
    }
    fn resume(&mut self, history: &[u32], n: usize, secs: f64) {
        let s = &mut self.totals.stretches;
        *s = (s.0 + 1, s.1 + secs, s.2 + n);
        if !self.quiet {
            println!("plain stretch to {}: {n} tokens in {:.2} ms", history.len(), secs * 1e3);
        }
        self.inner.resume(history, n, secs)
    }
}

fn main() -> Res<()> {
    let cli = <Cli as clap::Parser>::parse();
    if cli.depth == 0 || cli.new < 2 || cli.m.prompt == 0 {
        return Err("--depth and --prompt must be positive and --new at least 2".into());
    }
    if cli.seed.is_some() && cli.temperature == 0.0 {
        return Err("--seed seeds sampling: it needs --temperature above 0".into());
    }
    if cli.chat.is_some() && cli.prompt_step > 0 {
        return Err("--prompt-step lengthens --prompt ids, not a --chat prompt".into());
    }
    let (opts, _) = cli.m.load_options()?;
    if let Some(window) = cli.overlap {
        let args = overlap::OverlapArgs { target: cli.m.model.clone(), draft: cli.draft.clone(), opts, prompt: cli.m.prompt, depth: cli.depth, rows: cli.depth + 1, window };
        println!("device {:?}", mlx_array::default_device()?);
        return Ok(overlap::run(args)?);
    }
    let target = mlx_models::load_model(&cli.m.model, &opts)?.into_lm()?;
    let (clock, catch_ups, agreement): (Clock, CatchUps, Agreement) = Default::default();
    let inner = mlx_speculative::load_drafter_for(std::path::Path::new(&cli.draft), &opts, &target)?;
    let drafter = Box::new(TimedDrafter { inner, last: clock.clone(), catch_ups: catch_ups.clone(), agreement: agreement.clone() });
    let mut dec = if cli.adaptive { SpeculativeDecoder::adaptive(drafter, Some(cli.depth)) } else { SpeculativeDecoder::new(drafter, Some(cli.depth)) };
    if let Some(n) = cli.draft_ahead {
        dec = dec.with_draft_ahead(n)?;
    }
    if let Some(n) = cli.warm_up_cycles {
        dec = dec.with_warm_up_cycles(n as usize);
    }
    // a chat prompt is rendered once: every run takes it as it is (no --prompt-step)
    let chat = match &cli.chat {
        Some(text) => {
            let format = mlx_models::chat::ChatFormat::from_dir(std::path::Path::new(&cli.m.model))?;
            Some(format.render(&[mlx_models::chat::ChatMessage::user(text.as_str())], &Default::default())?.ids)
        }
        None => None,
    };
    let prompt_of = |run: usize| match &chat {
        Some(ids) => ids.clone(),
        None => shared::prompt_ids(cli.m.prompt + run * cli.prompt_step, target.info().vocab_size),
    };
    if cli.warm_up {
        let t = Instant::now();
        dec.warm_up(&target)?;
        println!("warm-up: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
        // the warm-up's catch-ups and what they measured are no generation's
        agreement.lock().expect("agreement").take();
        *catch_ups.lock().expect("catch-ups") = (0, 0.0);
    }
    println!("device {:?}, depth {} ({}), draft ahead {}, {} new tokens", mlx_array::default_device()?, cli.depth, if cli.adaptive { "adaptive" } else { "fixed" }, dec.draft_ahead(), cli.new);
    for run in 0..cli.runs {
        let prompt = prompt_of(run);
        if cli.prompt_step > 0 {
            println!("prompt of run {run}: {} ids", prompt.len());
        }
        let sampling = SamplingConfig { temperature: cli.temperature, seed: Some(cli.seed.unwrap_or(0)), ..SamplingConfig::greedy() };
        let cfg = GenerateConfig { max_new_tokens: cli.new, sampling, ..Default::default() };
        let plain = if cli.plain {
            let mut cache = target.new_cache();
            let mut gen = generate(&target, &mut cache, &prompt, cfg.clone())?;
            let toks = gen.by_ref().map(|t| t.map(|t| t.id)).collect::<MResult<Vec<u32>>>()?;
            let rate = gen.performance().decode_tokens_per_sec;
            println!("plain run {run}: {} tokens, decode {rate:.1} tok/s", toks.len());
            Some((toks, rate))
        } else {
            None
        };
        let mut cache = target.new_cache();
        let mut ids = Vec::new();
        let mut tracer = Tracer { inner: &mut dec, clock: clock.clone(), catch_ups: catch_ups.clone(), agreement: agreement.clone(), quiet: cli.quiet, totals: Totals::default(), sampled: Default::default() };
        let t = Instant::now();
        let mut gen = generate(&target, &mut cache, &prompt, cfg)?.with_speculator(&mut tracer);
        let mut n = 0;
        for tok in gen.by_ref() {
            ids.push(tok?.id);
            n += 1;
        }
        let perf = gen.performance();
        drop(gen);
        let secs = t.elapsed().as_secs_f64();
        let st = tracer.stats();
        let Totals { spec, plain_cycles, stretches, draft_secs, mut spec_secs } = tracer.totals;
        println!(
            "run {run}: {n} tokens in {secs:.3} s, decode {:.1} tok/s; speculative cycles {} ({:.1} ms, {} tokens; drafter {:.1} ms), plain cycles {} ({:.1} ms, {} tokens), plain stretches {} ({:.1} ms, {} tokens)",
            perf.decode_tokens_per_sec,
            spec.0, spec.1 * 1e3, spec.2, draft_secs * 1e3,
            plain_cycles.0, plain_cycles.1 * 1e3, plain_cycles.2,
            stretches.0, stretches.1 * 1e3, stretches.2,
        );
        if !spec_secs.is_empty() {
            // a host whose speed drifts moves the median; the fastest cycles show what the code costs
            spec_secs.sort_by(f64::total_cmp);
            let at = |q: f64| spec_secs[((spec_secs.len() - 1) as f64 * q).round() as usize] * 1e3;
            println!("run {run} speculative cycle times: fastest {:.2} ms, quartile {:.2}, median {:.2}, slowest {:.2} ({:.2} tokens a cycle)", at(0.0), at(0.25), at(0.5), at(1.0), spec.2 as f64 / spec.0 as f64);
            let by: Vec<String> = st.acceptance_by_position.iter().map(|a| format!("{a:.3}")).collect();
            println!("run {run} acceptance by position [{}], {:.2} drafts accepted a cycle", by.join(", "), st.accepted_mean);
        }
        if let Some((toks, rate)) = plain {
            let same = toks.iter().zip(&ids).take_while(|(a, b)| a == b).count();
            println!("run {run} against plain: {:.2}x, tokens {}", perf.decode_tokens_per_sec / rate, if same == toks.len() && toks.len() == ids.len() { "identical".to_string() } else { format!("agree for {same} of {}", toks.len()) });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `TimedDrafter` passes every call on: what the drafter says of itself, and the catch-ups
    /// and agreement of a draft model on its own thread (a wrapper that let one fall to the
    /// trait's default would switch that behaviour off in the traces without a word).
    #[test]
    fn the_timed_drafter_passes_every_call_on() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/models/tests/fixtures/tiny/qwen3");
        let model = mlx_models::load_model(&dir, &Default::default()).unwrap().into_lm().unwrap();
        let inner = mlx_speculative::DraftModel::new(model);
        let facts = |d: &dyn Drafter| (d.runs_ahead(), d.measures_agreement(), d.weight_bytes(), d.vocab_size(), d.default_depth(), d.max_depth(), d.wants_target_hidden(), d.target_taps().to_vec());
        let want = facts(&inner);
        let (last, catch_ups, agreement): (Clock, CatchUps, Agreement) = Default::default();
        let mut timed = TimedDrafter { inner: Box::new(inner), last: last.clone(), catch_ups: catch_ups.clone(), agreement: agreement.clone() };
        assert_eq!(facts(&timed), want);
        let history: Vec<u32> = (1..30).collect();
        timed.prefill(&history[..10]).unwrap();
        timed.catch_up(&history[..20], 64, &SamplingConfig::greedy()).unwrap();
        assert_eq!(catch_ups.lock().unwrap().0, 1);
        assert_eq!(timed.agreement().unwrap().len(), 9, "the catch-up's tokens, measured by the draft model");
        assert_eq!(agreement.lock().unwrap().as_ref().map(|(a, _)| a.len()), Some(9));
        let draft = timed.propose(&history, 3, &SamplingConfig::greedy()).unwrap();
        assert_eq!(draft.tokens.len(), 3);
        assert!(last.lock().unwrap().is_some());
    }
}
