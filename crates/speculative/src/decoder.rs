//! [`SpeculativeDecoder`]: a [`Drafter`] and the verifier, as an [`mlx_models::Speculator`].
use crate::drafter::{reads_history, Drafter, Feedback, SeededKey};
use crate::tracked::{forward_tapped, row, Tracked};
use crate::verify::{greedy_picks, greedy_verdict, verify_greedy, verify_sampled, Verdict};
use mlx_models::{Cache, Logits, Model, ModelError, Result, SpeculativeStats, Speculator, Token};
use sampling::{Sampler, SamplingConfig};

/// Running counters of a generation.
#[derive(Debug, Clone, Default)]
struct Counters {
    cycles: usize,
    drafted: usize,
    accepted: usize,
    /// Per draft position: (drafted, accepted).
    by_position: Vec<(usize, usize)>,
}

impl Counters {
    /// One cycle: `drafted` proposals (0: a plain step), `accepted` of them kept.
    fn record(&mut self, drafted: usize, accepted: usize) {
        self.cycles += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        if self.by_position.len() < drafted {
            self.by_position.resize(drafted, (0, 0));
        }
        for (i, p) in self.by_position.iter_mut().enumerate().take(drafted) {
            p.0 += 1;
            p.1 += usize::from(i < accepted);
        }
    }

    fn stats(&self) -> SpeculativeStats {
        let per = |x: usize| {
            if self.cycles == 0 {
                0.0
            } else {
                x as f64 / self.cycles as f64
            }
        };
        SpeculativeStats {
            cycles: self.cycles,
            accepted_mean: per(self.accepted),
            tokens_per_cycle: per(self.accepted + self.cycles),
            acceptance_by_position: self
                .by_position
                .iter()
                .map(|&(d, a)| a as f64 / d.max(1) as f64)
                .collect(),
            depth_mean: per(self.drafted),
        }
    }
}

/// What the verifier reads of the target's logits `[n, V]`: at temperature 0 the penalised
/// logits (whose log-softmax is the greedy distribution: [`verify_greedy`] takes the argmax and
/// the log-prob there in one pass), else the processed distributions.
fn verifier_rows(sampler: &Sampler, logits: &mlx_array::Array, rows: &[&[u32]]) -> Result<mlx_array::Array> {
    if sampler.config().is_greedy() {
        sampler.penalised(logits, rows)
    } else {
        sampler.distribution(logits, rows)
    }
    .map_err(|e| ModelError::InvalidInput(e.to_string()))
}

/// How many tokens to draft per cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// The same number every cycle (0: plain decoding through the verifier).
    Fixed(usize),
    /// Chosen each cycle by [`crate::Adaptive`], from 0 (plain decoding) to the given maximum.
    Adaptive(usize),
}

/// How far a draft model drafts ahead while the target verifies ([`Drafter::draft_ahead`],
/// greedy sampling without penalties).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftAhead {
    /// This many draft forwards a cycle (0: off).
    Steps(usize),
    /// Draft forwards until the verify's result is ready, at most the cycle's depth + 1 (the
    /// guess of the target's token, then a whole next cycle of drafts): the host drafts for as
    /// long as the device verifies, whatever their relative speeds. Each forward run ahead is
    /// one the next cycle needs when the guesses hold, so on a device whose verify outlasts
    /// the host's work on it this only stops at the verdict.
    UntilVerified,
    /// The drafter on a thread of its own ([`crate::Background`]): from each proposal it
    /// drafts ahead, at most the cycle's depth + 1 forwards, until it is asked for the next
    /// proposal, while this thread builds and runs the verify forward. The two graphs are then
    /// built in parallel rather than one after the other.
    Background,
}

impl std::str::FromStr for DraftAhead {
    type Err = ModelError;

    /// A number of steps, `until-verified` or `background`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "until-verified" => Ok(DraftAhead::UntilVerified),
            "background" => Ok(DraftAhead::Background),
            n => n.parse().map(DraftAhead::Steps).map_err(|_| {
                ModelError::InvalidInput(format!("draft ahead: {n:?} is neither a number of forwards, until-verified nor background"))
            }),
        }
    }
}

impl std::fmt::Display for DraftAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DraftAhead::Steps(n) => write!(f, "{n}"),
            DraftAhead::UntilVerified => f.write_str("until-verified"),
            DraftAhead::Background => f.write_str("background"),
        }
    }
}

/// Speculative decoding with one drafter; give it to [`mlx_models::Generator::with_speculator`]
/// or [`mlx_models::ChatSession::set_speculator`].
pub struct SpeculativeDecoder {
    drafter: Slot,
    depth: Depth,
    ahead: DraftAhead,
    catch_up_window: Option<usize>,
    policy: Option<crate::Adaptive>,
    /// Whether the drafter's stored weights are at least those of the target in this
    /// directory (read once per target: the weight files' headers).
    outweighed: Option<(std::path::PathBuf, bool)>,
    target: Option<Tracked>,
    key: SeededKey,
    counters: Counters,
    /// A plain stretch ended with the drafter catching up on its own thread: its agreement
    /// ([`Drafter::agreement`]) goes to the policy before the next cycle.
    agreement_due: bool,
    /// An error of the drafter met where none can be returned ([`Speculator::plain_tokens`]),
    /// for the next cycle.
    deferred: Option<ModelError>,
    /// The target's sampler settings in this generation's plain stretches
    /// ([`Speculator::plain_sampled`]), passed to the drafter's catch-ups.
    sampled: Option<SamplingConfig>,
    /// At temperature > 0, with an agreement due after the stretch: the target's log-prob of
    /// each stretch token, by history index.
    target_logprobs: std::collections::BTreeMap<usize, f32>,
    /// The state of the draws that turn agreements at temperature > 0 into verdicts
    /// ([`SpeculativeDecoder::verdicts`]).
    coin: u64,
    /// Cycles [`SpeculativeDecoder::warm_up`] runs at the deepest depth.
    warm_up_cycles: usize,
}

impl SpeculativeDecoder {
    /// `depth`: proposals per cycle; `None` = the drafter's default.
    pub fn new(drafter: Box<dyn Drafter>, depth: Option<usize>) -> Self {
        let depth = depth.unwrap_or_else(|| drafter.default_depth());
        let depth = Depth::Fixed(
            drafter
                .max_depth()
                .map_or(depth, |m| depth.clamp(1, m.max(1))),
        );
        Self::with_depth(drafter, depth)
    }

    /// Adaptive depth ([`crate::Adaptive`]) up to `max` drafts per cycle (`None`: the drafter's
    /// default depth). A drafter whose stored weights are at least the target's
    /// ([`Drafter::weight_bytes`] against [`mlx_models::weights::checkpoint_bytes`]) is never
    /// asked: a draft step then reads at least what a target step does, so no acceptance
    /// makes speculating pay, and the exploring cycles alone would cost the draft's prefill of
    /// the prompt. Such a generation decodes plainly (one plain stretch).
    pub fn adaptive(drafter: Box<dyn Drafter>, max: Option<usize>) -> Self {
        let max = max.unwrap_or_else(|| drafter.default_depth()).max(1);
        let max = drafter.max_depth().map_or(max, |m| max.min(m.max(1)));
        Self::with_depth(drafter, Depth::Adaptive(max))
    }

    /// A decoder drafting `depth` with `drafter`, every other setting at its default.
    fn with_depth(drafter: Box<dyn Drafter>, depth: Depth) -> Self {
        SpeculativeDecoder {
            ahead: Self::draft_ahead_for(drafter.as_ref()),
            drafter: Slot::Here(drafter),
            depth,
            catch_up_window: Some(Self::CATCH_UP_WINDOW),
            policy: None,
            outweighed: None,
            target: None,
            key: SeededKey::new(2),
            counters: Counters::default(),
            agreement_due: false,
            deferred: None,
            sampled: None,
            target_logprobs: Default::default(),
            coin: Self::COIN_SEED,
            warm_up_cycles: Self::WARM_UP_CYCLES,
        }
    }

    /// [`SpeculativeDecoder::warm_up`]'s cycles at the deepest depth, after a prompt of
    /// [`SpeculativeDecoder::WARM_UP_PROMPT`] tokens (at least 1; default
    /// [`SpeculativeDecoder::WARM_UP_CYCLES`]).
    pub fn with_warm_up_cycles(mut self, cycles: usize) -> Self {
        self.warm_up_cycles = cycles.max(1);
        self
    }

    pub fn depth(&self) -> Depth {
        self.depth
    }

    /// Draft forwards run ahead while the target verifies ([`Drafter::draft_ahead`]; greedy
    /// sampling without penalties): on a GPU the host builds them while the device runs the
    /// verify forward, which otherwise leaves the host idle; the next cycle starts from them
    /// when the target accepts every draft and the drafter guessed its token.
    /// `DraftAhead::Steps(0)`: off. Any other value with a drafter that cannot run ahead
    /// ([`Drafter::runs_ahead`]: one that reads the target's states) is
    /// [`ModelError::UnsupportedOption`].
    pub fn with_draft_ahead(mut self, ahead: DraftAhead) -> Result<Self> {
        if ahead != DraftAhead::Steps(0) && !self.drafter.runs_ahead() {
            return Err(ModelError::UnsupportedOption(format!(
                "drafting ahead ({ahead}): only a plain draft model runs ahead; this drafter reads the target's states"
            )));
        }
        self.ahead = ahead;
        self.place()?;
        Ok(self)
    }

    /// Move the drafter to its own thread for [`DraftAhead::Background`], or back for the
    /// others (done at once by [`SpeculativeDecoder::with_draft_ahead`], at the first prefill
    /// or cycle for the default).
    fn place(&mut self) -> Result<()> {
        let want = self.ahead == DraftAhead::Background;
        if matches!(self.drafter, Slot::Thread(_)) == want {
            return Ok(());
        }
        // a drafter lost on the way (its thread panicked) leaves one that reports it
        let lost: Box<dyn Drafter> = Box::new(crate::background::Lost);
        self.drafter = match std::mem::replace(&mut self.drafter, Slot::Here(lost)) {
            Slot::Here(d) => match crate::Background::try_spawn(d) {
                Ok(b) => Slot::Thread(b),
                Err((e, d)) => {
                    self.drafter = Slot::Here(d);
                    return Err(e);
                }
            },
            Slot::Thread(b) => Slot::Here(b.into_inner()?),
        };
        Ok(())
    }

    /// [`SpeculativeDecoder::with_catch_up_window`]'s default: tokens of context a draft model
    /// keeps across a plain stretch of adaptive depth.
    pub const CATCH_UP_WINDOW: usize = 64;
    /// Tokens of a plain stretch between two catch-ups of a drafter on its own thread
    /// ([`Speculator::plain_progress`]).
    pub const CATCH_UP_EVERY: usize = 8;
    /// Tokens of a plain stretch still to come at its last catch-up
    /// ([`Speculator::plain_progress`]). The probe after the stretch then runs these and the
    /// newest token in its first draft forward: always that many rows, a shape
    /// [`SpeculativeDecoder::warm_up`] runs (on CUDA the first forward of a new number of rows
    /// costs libmlx one-time work: on H100s a probe's draft took 25-33 ms in a process's first
    /// generation, 7-9 ms in its second), and the last catch-up has that many target steps to
    /// finish in (the probe waits for it: 12-15 ms with one step against 7-9 ms with eight).
    pub const CATCH_UP_LEAD: usize = 3;

    /// After a plain stretch of adaptive depth, a drafter lacking more than `window` tokens
    /// starts over from the last `window` of the history instead of catching up over the whole
    /// stretch ([`Drafter::skipped`]): a probe's catching up is then bounded, where it would
    /// otherwise grow with the stretch (on the CPU a draft model's catching up costs a fifth of
    /// a target step per token and more, so a draft that keeps losing taxed every plain token by
    /// that). `None`: always catch up. Output is unchanged either way.
    pub fn with_catch_up_window(mut self, window: Option<usize>) -> Self {
        self.catch_up_window = window.filter(|&w| w > 0);
        self
    }

    /// [`SpeculativeDecoder::with_draft_ahead`]'s default for a drafter that runs ahead
    /// ([`Drafter::runs_ahead`]; none for others): on a GPU the drafter on a thread of its own
    /// (measured on CUDA against drafting until verified, whose cycles took a third longer,
    /// BENCHMARKS.md), none on the CPU, where the verify forward occupies the cores the drafts
    /// would run on.
    pub fn default_draft_ahead() -> DraftAhead {
        if mlx_array::default_device().is_ok_and(|d| d == mlx_array::Device::Gpu) {
            DraftAhead::Background
        } else {
            DraftAhead::Steps(0)
        }
    }

    fn draft_ahead_for(drafter: &dyn Drafter) -> DraftAhead {
        if drafter.runs_ahead() {
            Self::default_draft_ahead()
        } else {
            DraftAhead::Steps(0)
        }
    }

    pub fn draft_ahead(&self) -> DraftAhead {
        self.ahead
    }

    /// Default of [`SpeculativeDecoder::with_warm_up_cycles`]: the second cycle starts from
    /// the drafts the first ran ahead, as every later cycle of a generation does.
    pub const WARM_UP_CYCLES: usize = 2;
    /// The prompt length of [`SpeculativeDecoder::warm_up`]'s run at the deepest depth.
    pub const WARM_UP_PROMPT: usize = 16;

    /// Run greedy cycles at every depth this decoder may draft (its fixed depth; every depth
    /// up to the maximum when adaptive) on a throwaway cache of `target`, so that what a new
    /// shape costs the first time it runs is paid here rather than in the first cycles of a
    /// generation: on a GPU, cuBLAS algorithm selection, CUDA graph instantiation and kernel
    /// compilation for the verify forward of each depth's rows, the verifier's ops over them and
    /// the drafter's own steps (in a fresh process 55-75 ms in the first cycle of a generation on
    /// an H100, then more at each new depth). The deepest depth runs as a generation does: the
    /// drafter's prefill of a [`SpeculativeDecoder::WARM_UP_PROMPT`]-token prompt, then
    /// [`SpeculativeDecoder::with_warm_up_cycles`] cycles one after another (drafting ahead
    /// from one into the next); every other depth one cycle. With adaptive depth and the
    /// drafter on its own thread, also the first draft forward of a probe after a plain
    /// stretch ([`SpeculativeDecoder::CATCH_UP_LEAD`] + 1 rows), and, for a drafter that
    /// measures its agreement, the catch-ups of the opening stretch and of a whole
    /// [`SpeculativeDecoder::CATCH_UP_EVERY`] tokens. Leaves the decoder as
    /// [`Speculator::start`] does; the drafter keeps no state that a later generation does not
    /// replace. Sampling at temperature > 0 runs other verifier ops, which are not warmed.
    pub fn warm_up(&mut self, target: &Model) -> Result<()> {
        // a drafter adaptive depth leaves out needs no warming
        let left_out = self.leaves_out(target);
        let depths: Vec<usize> = match self.depth {
            Depth::Fixed(d) => vec![d],
            Depth::Adaptive(_) if left_out => Vec::new(),
            Depth::Adaptive(max) => (1..=max).collect(),
        };
        let deepest = depths.iter().copied().max().unwrap_or(0);
        let depth = self.depth;
        let mut sampler = Sampler::new(sampling::SamplingConfig::greedy())
            .map_err(|e| ModelError::InvalidInput(e.to_string()))?;
        // `prompt` into a fresh cache and (with `prefill`) the drafter's prefill, then `cycles`
        // cycles as the generator runs them (its invariant: the cache holds the history but its
        // last token)
        let mut run = |me: &mut Self, d: usize, prompt: &[u32], prefill: bool, cycles: usize| -> Result<()> {
            me.depth = Depth::Fixed(d);
            me.start();
            me.reserve(prompt.len() + 1 + cycles * (d + 1));
            let mut cache = target.new_cache();
            let out = target.forward(&crate::tracked::row(prompt)?, &mut cache, Logits::Last, false)?;
            cache.eval_with(&out.logits.iter().collect::<Vec<_>>())?;
            if prefill {
                <Self as Speculator>::prefill(me, target, prompt)?;
            }
            let mut history = prompt.to_vec();
            history.push(prompt[prompt.len() - 1]);
            for _ in 0..cycles {
                let toks = me.cycle(target, &mut cache, &history, &mut sampler, d + 1)?;
                history.extend(toks.iter().map(|t| t.id));
            }
            Ok(())
        };
        let prompt: Vec<u32> = (0..Self::WARM_UP_PROMPT as u32).map(|i| i % 2).collect();
        let cycles = self.warm_up_cycles;
        let result = depths
            .into_iter()
            .filter(|&d| d > 0)
            .try_for_each(|d| if d == deepest { run(self, d, &prompt, true, cycles) } else { run(self, d, &[0], true, 1) })
            .and_then(|()| {
                if !matches!(depth, Depth::Adaptive(_)) || left_out || !matches!(self.drafter, Slot::Thread(_)) {
                    return Ok(());
                }
                // a probe after a plain stretch with the drafter on its own thread: its first draft
                // forward runs the tokens after the last catch-up (a history the draft holds none of)
                run(self, 1, &[1; Self::CATCH_UP_LEAD], false, 1)?;
                if !self.drafter.measures_agreement() {
                    return Ok(());
                }
                // catch-ups with their guesses: the opening stretch's (the tokens before its lead)
                // and a whole spacing's
                let opening = crate::Adaptive::OPENING - Self::CATCH_UP_LEAD;
                let history = vec![2u32; 2 + opening + Self::CATCH_UP_EVERY];
                self.drafter.prefill(&history[..1])?;
                let greedy = SamplingConfig::greedy();
                self.drafter.catch_up(&history[..2 + opening], Self::CATCH_UP_WINDOW, &greedy)?;
                self.drafter.catch_up(&history, Self::CATCH_UP_WINDOW, &greedy)?;
                self.drafter.agreement().map(|_| ())
            });
        self.depth = depth;
        self.start();
        result
    }

    /// Whether adaptive depth reads the drafter's agreement after each plain stretch: a drafter
    /// on its own thread that measures it ([`Drafter::measures_agreement`]).
    fn reads_agreement(&self) -> bool {
        self.policy.is_some() && matches!(self.drafter, Slot::Thread(_)) && self.drafter.measures_agreement()
    }

    /// The seed of the draws in [`SpeculativeDecoder::verdicts`] (each generation starts from it).
    const COIN_SEED: u64 = 0x5eed_a9e5_d7af_7e01;

    /// The drafter's agreement over a stretch as the verdicts of proposals from each token
    /// ([`crate::Adaptive::observe_agreement`]). Greedy: whether the draft's greedy guess was
    /// the token. At temperature > 0, where the target's log-prob `log p(x)` of the sampled
    /// token and the draft's `log q(x)` are both known: accepted with probability
    /// `min(1, q(x) / p(x))`, whose mean over `x ~ p` is the probability that rejection
    /// sampling accepts a draft from there (`sum_y min(p(y), q(y))`; the greedy guess
    /// underestimates it); elsewhere the guess.
    fn verdicts(&mut self, agreed: &[crate::Agreed]) -> Vec<bool> {
        let sampled = self.sampled.as_ref().is_some_and(|c| !c.is_greedy());
        let mut out = Vec::with_capacity(agreed.len());
        for a in agreed {
            let v = match (sampled, a.logprob, self.target_logprobs.get(&a.position)) {
                (true, Some(q), Some(&p)) => {
                    let accept = f64::from(q - p).exp().min(1.0);
                    splitmix_unit(&mut self.coin) < accept
                }
                _ => a.guessed,
            };
            out.push(v);
        }
        self.target_logprobs.clear();
        out
    }

    /// Whether adaptive depth leaves the drafter out for `target` (see
    /// [`SpeculativeDecoder::adaptive`]).
    fn leaves_out(&mut self, target: &Model) -> bool {
        if !matches!(self.depth, Depth::Adaptive(_)) {
            return false;
        }
        match &self.outweighed {
            Some((dir, heavy)) if dir == target.dir() => *heavy,
            _ => {
                let t = mlx_models::weights::checkpoint_bytes(target.dir()).ok().flatten();
                let heavy = matches!((self.drafter.weight_bytes(), t), (Some(d), Some(t)) if d >= t);
                self.outweighed = Some((target.dir().to_path_buf(), heavy));
                heavy
            }
        }
    }

    /// The drafter ([`crate::Background`] while it drafts on a thread of its own).
    pub fn drafter(&self) -> &dyn Drafter {
        &*self.drafter
    }

    /// No drafts this cycle: one plain step through the target.
    fn plain_step(
        &mut self,
        model: &Model,
        cache: &mut Cache,
        history: &[u32],
        sampler: &Sampler,
    ) -> Result<Vec<Token>> {
        let last = history[history.len() - 1];
        // drafters that follow the target's states get this step's too
        let hidden = self.drafter.wants_target_hidden();
        let taps = self.drafter.target_taps().to_vec();
        let (out, tapped) =
            forward_tapped(model, cache, &row(&[last])?, Logits::Last, hidden, &taps)?;
        let logits = out
            .logits
            .ok_or_else(|| ModelError::Cache("target forward returned no logits".into()))?
            .reshape(&[1, -1])?;
        cache.async_eval_with(&[&logits])?;
        if let Some(t) = self.target.as_mut() {
            t.tokens.push(last);
        }
        let rows: [&[u32]; 1] = [history];
        let lp = verifier_rows(sampler, &logits, &rows)?;
        let cfg = sampler.config().clone();
        let v = if cfg.is_greedy() {
            verify_greedy(&lp, &[])?
        } else {
            verify_sampled(&lp, &lp.slice_axis(0, 0, 0)?, &[], self.key.get(&cfg)?)?
        };
        if hidden || !taps.is_empty() {
            self.drafter.feedback(&Feedback {
                history,
                drafts: &[],
                accepted: 0,
                next: v.tokens[0].id,
                hidden: out.hidden.as_ref(),
                taps: &tapped,
            })?;
        }
        Ok(v.tokens)
    }
}

impl Speculator for SpeculativeDecoder {
    /// With adaptive depth and a drafter that measures its agreement while it catches up on
    /// its own thread, the generation opens with a plain stretch ([`crate::Adaptive::with_opening`]):
    /// a draft that agrees with none of its tokens never drafts, where a speculative opening
    /// cycle would first wait for the draft's prefill of the prompt.
    fn start(&mut self) {
        self.target = None;
        let opens = self.ahead == DraftAhead::Background && self.drafter.measures_agreement();
        self.policy = match self.depth {
            Depth::Adaptive(max) if opens => Some(crate::Adaptive::new(max).with_opening()),
            Depth::Adaptive(max) => Some(crate::Adaptive::new(max)),
            Depth::Fixed(_) => None,
        };
        self.agreement_due = false;
        self.sampled = None;
        self.target_logprobs.clear();
        self.coin = Self::COIN_SEED;
        self.counters = Counters::default();
    }

    fn reserve(&mut self, positions: usize) {
        self.drafter.reserve(positions);
    }

    fn prefill(&mut self, model: &Model, history: &[u32]) -> Result<()> {
        self.place()?;
        // a drafter adaptive depth leaves out never drafts: nothing to run the prompt for
        if self.leaves_out(model) {
            return Ok(());
        }
        self.drafter.prefill(history)
    }

    fn cycle(
        &mut self,
        model: &Model,
        cache: &mut Cache,
        history: &[u32],
        sampler: &mut Sampler,
        max: usize,
    ) -> Result<Vec<Token>> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        let Some((&last, before)) = history.split_last() else {
            return Err(ModelError::InvalidInput(
                "a speculative cycle needs a non-empty history".into(),
            ));
        };
        if max == 0 {
            return Err(ModelError::InvalidInput(
                "a speculative cycle must produce at least one token".into(),
            ));
        }
        self.place()?;
        let cfg = sampler.config().clone();
        let vocab = model.info().vocab_size;
        if !cfg.is_greedy() && self.drafter.vocab_size() != vocab {
            return Err(ModelError::UnsupportedOption(format!(
                "sampling at temperature > 0 needs the draft's vocabulary ({}) to be the target's ({vocab})",
                self.drafter.vocab_size()
            )));
        }
        // The cache holds `before` (the generator's invariant when this tracking starts).
        let tracked = self
            .target
            .get_or_insert_with(|| Tracked::new(before.to_vec()));
        tracked.sync(model, cache, before, None)?;
        let clock = std::time::Instant::now();
        let left_out = self.leaves_out(model);
        let depth = match (&mut self.policy, self.depth) {
            _ if left_out => 0,
            (Some(p), _) => p.next_depth(),
            (None, Depth::Fixed(d)) => d,
            (None, Depth::Adaptive(d)) => d,
        };
        let k = depth.min(max - 1);
        let draft = if k == 0 {
            None
        } else {
            Some(self.drafter.propose_on(history, k, &cfg, cache)?)
        };
        let Some(draft) = draft.filter(|d| !d.tokens.is_empty()) else {
            let out = self.plain_step(model, cache, history, sampler)?;
            self.counters.record(0, 0);
            if let Some(p) = &mut self.policy {
                p.observe(0, 0, clock.elapsed().as_secs_f64());
            }
            return Ok(out);
        };
        let drafts = &draft.tokens;
        let k = drafts.len();
        // greedy drafts beyond the target's vocabulary are simply rejected
        let valid = drafts.iter().take_while(|&&d| (d as usize) < vocab).count();
        let drafts = &drafts[..valid];
        if drafts.is_empty() {
            self.counters.record(0, 0);
            return self.plain_step(model, cache, history, sampler);
        }
        // drafting ahead guesses greedy drafts without penalties, from a whole proposal
        let may_draft_ahead = cfg.is_greedy() && !reads_history(&cfg) && drafts.len() == k;
        if self.ahead == DraftAhead::Background && may_draft_ahead {
            // the thread drafts while this one builds the verify forward
            self.drafter.draft_ahead(history, drafts, k + 1, None)?;
        }
        let tracked = self.target.as_mut().expect("set above");
        tracked.snapshot(cache);
        let mut seq = Vec::with_capacity(drafts.len() + 1);
        seq.push(last);
        seq.extend_from_slice(drafts);
        let hidden = self.drafter.wants_target_hidden();
        let taps = self.drafter.target_taps().to_vec();
        let (out, tapped) = forward_tapped(model, cache, &row(&seq)?, Logits::All, hidden, &taps)?;
        let logits = out
            .logits
            .ok_or_else(|| ModelError::Cache("target forward returned no logits".into()))?;
        let logits = logits.reshape(&[seq.len() as i32, -1])?;
        cache.async_eval_with(&[&logits])?;
        tracked.tokens.extend_from_slice(&seq);
        // row i: the history plus the first i drafts (the penalties see them)
        let hists: Vec<Vec<u32>> = if reads_history(&cfg) {
            (0..seq.len())
                .map(|i| history.iter().chain(&drafts[..i]).copied().collect())
                .collect()
        } else {
            Vec::new()
        };
        let rows: Vec<&[u32]> = hists.iter().map(Vec::as_slice).collect();
        let lp = verifier_rows(sampler, &logits, &rows)?;
        let verdict: Verdict = if cfg.is_greedy() {
            let (best, picked) = greedy_picks(&lp, drafts)?;
            let ready = || best.is_available();
            let (steps, until): (usize, Option<&dyn Fn() -> bool>) = match self.ahead {
                DraftAhead::Steps(n) => (n, None),
                DraftAhead::UntilVerified => (k + 1, Some(&ready)),
                // already drafting, on its thread
                DraftAhead::Background => (0, None),
            };
            if steps > 0 && may_draft_ahead {
                mlx_array::async_eval(&[&best, &picked])?;
                self.drafter.draft_ahead(history, drafts, steps, until)?;
            }
            greedy_verdict(&best, &picked, drafts)?
        } else {
            let q = draft.logprobs.as_ref().ok_or_else(|| {
                ModelError::InvalidInput(
                    "the drafter gave no draft distribution at temperature > 0".into(),
                )
            })?;
            let q = q.slice_axis(0, 0, drafts.len())?;
            verify_sampled(&lp, &q, drafts, self.key.get(&cfg)?)?
        };
        let n = verdict.accepted;
        let tracked = self.target.as_mut().expect("set above");
        let keep: Vec<u32> = history.iter().chain(&drafts[..n]).copied().collect();
        tracked.sync(model, cache, &keep, None)?;
        let next = verdict.tokens[n].id;
        self.drafter.feedback(&Feedback {
            history,
            drafts,
            accepted: n,
            next,
            hidden: out.hidden.as_ref(),
            taps: &tapped,
        })?;
        self.counters.record(k, n);
        if let Some(p) = &mut self.policy {
            p.observe(k, n, clock.elapsed().as_secs_f64());
        }
        Ok(verdict.tokens)
    }

    fn settle(&mut self, model: &Model, cache: &mut Cache, history: &[u32]) -> Result<()> {
        let Some((_, before)) = history.split_last() else {
            return Ok(());
        };
        let tracked = self
            .target
            .get_or_insert_with(|| Tracked::new(before.to_vec()));
        tracked.sync(model, cache, history, None)?;
        cache.eval_with(&[])
    }

    fn stats(&self) -> SpeculativeStats {
        self.counters.stats()
    }

    /// With adaptive depth settled on plain decoding, the cycles until its next probe (all the
    /// rest for a drafter it leaves out), or its opening stretch; none for drafters that follow
    /// the target's hidden states (they need every step's). After a stretch during which the
    /// drafter caught up on its own thread, the policy first reads its agreement over the
    /// stretch ([`crate::Adaptive::observe_agreement`]).
    fn plain_tokens(&mut self, _history: &[u32]) -> usize {
        if self.drafter.wants_target_hidden() || !self.drafter.target_taps().is_empty() {
            return 0;
        }
        let opening = self.policy.as_ref().is_some_and(crate::Adaptive::opens);
        if self.target.is_none() && !opening {
            return 0;
        }
        if matches!(self.depth, Depth::Adaptive(_)) && matches!(self.outweighed, Some((_, true))) {
            return usize::MAX;
        }
        if std::mem::take(&mut self.agreement_due) {
            match self.drafter.agreement() {
                Ok(agreed) => {
                    let verdicts = self.verdicts(&agreed);
                    if let Some(p) = &mut self.policy {
                        p.observe_agreement(&verdicts);
                    }
                }
                // the next cycle reports it
                Err(e) => {
                    self.deferred = Some(e);
                    return 0;
                }
            }
        }
        self.policy.as_ref().map_or(0, crate::Adaptive::plain_run)
    }

    /// With the drafter on its own thread, every [`SpeculativeDecoder::CATCH_UP_EVERY`] tokens
    /// (at most half the window) of the stretch's last catch-up window (all of the stretch
    /// without one) are run into its context beside the target's steps ([`Drafter::catch_up`]),
    /// the last time with [`SpeculativeDecoder::CATCH_UP_LEAD`] tokens to come: the probe after
    /// the stretch then catches up over that many and the newest token, not the window.
    fn plain_progress(&mut self, history: &[u32], left: usize) -> Result<()> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        // every CATCH_UP_EVERY tokens (more often in a shorter window), the last with
        // CATCH_UP_LEAD tokens to come
        let every = self.catch_up_window.map_or(Self::CATCH_UP_EVERY, |w| Self::CATCH_UP_EVERY.min(w / 2).max(1));
        if !matches!(self.drafter, Slot::Thread(_)) || left % every != Self::CATCH_UP_LEAD % every {
            return Ok(());
        }
        // the part of the window the stretch has produced (a context starts over where the
        // stretch's end would start it)
        let window = match self.catch_up_window {
            Some(w) if left >= w => return Ok(()),
            Some(w) => w - left,
            None => usize::MAX,
        };
        let greedy = SamplingConfig::greedy();
        self.drafter.catch_up(history, window, self.sampled.as_ref().unwrap_or(&greedy))
    }

    fn plain_sampled(&mut self, history: &[u32], logprob: f32, sampling: &SamplingConfig) {
        if self.sampled.is_none() {
            self.sampled = Some(sampling.clone());
        }
        // weighed against the drafter's agreement after the stretch
        if self.reads_agreement() && !sampling.is_greedy() && !history.is_empty() {
            self.target_logprobs.insert(history.len() - 1, logprob);
        }
    }

    fn resume(&mut self, history: &[u32], n: usize, secs: f64) {
        let held = history[..history.len().saturating_sub(1)].to_vec();
        match self.target.as_mut() {
            Some(t) => t.reset(held),
            None => self.target = Some(Tracked::new(held)),
        }
        for _ in 0..n {
            self.counters.record(0, 0);
        }
        if let Some(w) = self.catch_up_window {
            self.drafter.skipped(history, w);
        }
        if let Some(p) = &mut self.policy {
            p.observe_plain(n, secs);
        }
        self.agreement_due = self.reads_agreement();
    }
}

/// Where the drafter runs: on the decoder's thread, or on one of its own
/// ([`DraftAhead::Background`]).
enum Slot {
    Here(Box<dyn Drafter>),
    Thread(crate::Background),
}

impl std::ops::Deref for Slot {
    type Target = dyn Drafter;

    fn deref(&self) -> &Self::Target {
        match self {
            Slot::Here(d) => d.as_ref(),
            Slot::Thread(b) => b,
        }
    }
}

impl std::ops::DerefMut for Slot {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match self {
            Slot::Here(d) => d.as_mut(),
            Slot::Thread(b) => b,
        }
    }
}

/// A uniform draw in `[0, 1)` from a SplitMix64 state (which advances).
fn splitmix_unit(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DraftModel;
    use mlx_models::{load_model, GenerateConfig, LoadOptions};

    fn tiny(name: &str) -> Model {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny").join(name);
        load_model(dir, &LoadOptions::default()).unwrap().into_lm().unwrap()
    }

    /// A decoder whose default is the draft's own thread (as on a GPU) moves the drafter there at
    /// its first prefill, not at construction, and decodes what the drafter on this thread does
    /// (the same verify steps: equal whatever the logits' near-ties).
    #[test]
    fn the_default_thread_is_taken_at_the_first_prefill() {
        let target = tiny("qwen3");
        let prompt = [5u32, 17, 230, 99, 4, 61, 8];
        let cfg = || GenerateConfig { max_new_tokens: 12, sampling: sampling::SamplingConfig::greedy(), ..Default::default() };
        let run = |spec: &mut SpeculativeDecoder| -> Vec<u32> {
            let mut cache = target.new_cache();
            let gen = mlx_models::generate(&target, &mut cache, &prompt, cfg()).unwrap().with_speculator(spec);
            gen.map(|t| t.unwrap().id).collect()
        };
        let mut here = SpeculativeDecoder::new(Box::new(DraftModel::new(tiny("qwen3"))), Some(3)).with_draft_ahead(DraftAhead::Steps(0)).unwrap();
        let want = run(&mut here);
        assert_eq!(want.len(), 12);
        let mut spec = SpeculativeDecoder::new(Box::new(DraftModel::new(tiny("qwen3"))), Some(3));
        spec.ahead = DraftAhead::Background;
        assert!(matches!(spec.drafter, Slot::Here(_)), "not moved at construction");
        assert_eq!(run(&mut spec), want);
        assert!(matches!(spec.drafter, Slot::Thread(_)), "moved at the first prefill");
    }

    /// The agreement's verdicts: greedy, the guesses; at temperature > 0 a draw accepted with
    /// probability `min(1, q(x) / p(x))` where both log-probs are known (always for q = p, never
    /// for a token the draft filtered out, half the time for q = p / 2: 4000 draws within 3%),
    /// the guess where the target's is not; the target's log-probs are used once.
    #[test]
    fn verdicts_weigh_the_drafts_log_probs_against_the_targets() {
        use crate::Agreed;
        let mut d = SpeculativeDecoder::new(Box::new(DraftModel::new(tiny("qwen3"))), Some(3));
        let agreed = |position: usize, guessed: bool, logprob: Option<f32>| Agreed { position, guessed, logprob };
        // greedy: the guesses, whatever the log-probs
        d.sampled = Some(SamplingConfig::greedy());
        d.target_logprobs.insert(1, -1.0);
        assert_eq!(d.verdicts(&[agreed(1, false, Some(-1.0)), agreed(2, true, None)]), [false, true]);
        assert!(d.target_logprobs.is_empty());
        let sampled = SamplingConfig { temperature: 1.0, ..SamplingConfig::greedy() };
        d.sampled = Some(sampled);
        for i in 0..3 {
            d.target_logprobs.insert(10 + i, -1.5);
        }
        let v = d.verdicts(&[agreed(10, false, Some(-1.5)), agreed(11, true, Some(f32::NEG_INFINITY)), agreed(12, false, Some(-0.2)), agreed(13, true, Some(-9.0))]);
        assert_eq!(v, [true, false, true, true], "q = p, q = 0, q > p, and no target log-prob (the guess)");
        let n = 4000;
        let mut accepted = 0;
        for i in 0..n {
            d.target_logprobs.insert(i, -1.0);
            accepted += usize::from(d.verdicts(&[agreed(i, false, Some(-1.0 - std::f32::consts::LN_2))])[0]);
        }
        let rate = accepted as f64 / n as f64;
        assert!((rate - 0.5).abs() < 0.03, "q = p / 2 accepted at {rate}");
    }
}
