//! Adaptive draft depth: an EMA hill-climb over expected tokens per second, with plain decoding
//! (depth 0) as one of the choices, so speculation turns itself off when it loses.
//!
//! Per depth `d` the policy keeps an EMA of the wall time of a cycle at that depth (`d = 0`: a
//! plain target step; faster cycles weigh more, [`Adaptive::ALPHA_DOWN`]), and per draft
//! position `i` an estimate `a_i` of the probability that draft `i` is accepted given that drafts
//! `0..i` were (the mean of the first verdicts and a prior 0.5, [`Adaptive::ACCEPT_PRIOR_WEIGHT`],
//! then an EMA). A cycle at depth `d` is then expected to give
//! `1 + E(d)` tokens, `E(d) = sum_{i<d} prod_{j<=i} a_j`, at `(1 + E(d)) / t(d)` tokens per second.
//!
//! States, in order: **explore** (up to [`Adaptive::EXPLORE`] cycles: the first drafts
//! [`Adaptive::FIRST_DEPTH`] tokens, the next ones the maximum depth to measure acceptance at
//! every position, and exploring stops at a cycle that accepts nothing, so a useless draft costs
//! one short cycle; the first cycle at each depth is not timed, since its verify forward is the
//! first of a new shape and pays one-time costs such as kernel compilation or, on CUDA, cuBLAS
//! algorithm selection and graph instantiation), **calibrate** (one plain step: the
//! break-even reference), then **climb**: each cycle moves to the best of plain
//! decoding, `depth - 1`, `depth`, `depth + 1` and the maximum depth (a neighbour never measured
//! is tried once while speculation is ahead), where
//! speculating must beat plain decoding by [`Adaptive::MARGIN`] (the expected-value gate; a
//! cycle's time is taken as at least a plain step's); a neighbour is **probed** again every
//! [`Adaptive::PROBE`] cycles or more, so that stale estimates (plain decoding's included) are
//! refreshed, and while the first draft is accepted at least [`Adaptive::FAR_PROBE_ACCEPT`] of
//! the time, every other probe from below `max - 1` goes to the maximum depth (a cycle's fixed
//! cost, such as a verify forward of several rows, can make shallow depths lose to plain
//! decoding while deep ones win: a climb from plain decoding alone would never get there);
//! unless a depth may win (its expected rate within [`Adaptive::CLOSE`] of the best, or drafts
//! that are being accepted timed only once at it), the gap between probes of it grows until a
//! probe's measured time is at most [`Adaptive::PROBE_BUDGET`] of the cycles between it and the next one (a verify forward that
//! costs several plain steps, as multi-row forwards do on some GPUs, is probed that much more
//! rarely); settled on plain decoding, the gap is further divided by the first draft's
//! acceptance EMA (floored at [`Adaptive::MIN_PROBE_ACCEPT`]), so a draft that keeps failing is
//! probed ever more rarely. Depth 0 with a useless draft therefore costs at most that share of
//! the time, plus the opening cycle and a draft model's catching up over the tokens it skipped.
//! That catching up is a cost of the stretch, not of the probed depth: the first cycle after a
//! stretch is not taken as a cycle time (when its drafts were accepted the depth runs once more
//! at once, to be timed), and its time beyond the depth's estimate places the next probe at
//! least so far that the catching up is [`Adaptive::PROBE_BUDGET`] of the plain steps in
//! between once every depth has been timed, whatever the depth (a close call included: until
//! then a depth never timed may be the one that wins; a draft model's catching up grows with
//! the stretch, so without it probing a close call every [`Adaptive::PROBE`] cycles taxes every
//! plain token by the draft's cost per caught-up token). The decoder bounds each catching up
//! by a window ([`crate::SpeculativeDecoder::with_catch_up_window`]), so the gaps stop growing.
//!
//! A drafter that catches up during plain stretches on a thread of its own measures its
//! agreement with the stretch's tokens for free ([`crate::Drafter::agreement`]: whether its
//! greedy guess after each token was the next one; at temperature > 0 a draw accepted with
//! probability `min(1, q(x) / p(x))` from the draft's and the target's log-probs of the sampled
//! token, whose mean is rejection sampling's acceptance), and the decoder hands it over after each
//! stretch ([`Adaptive::observe_agreement`]): it counts as verdicts of cycles at the maximum
//! depth, and a stretch over which no depth could have given [`Adaptive::MARGIN`] tokens a
//! cycle skips the probe due after it. Such a generation also opens with a plain stretch
//! ([`Adaptive::with_opening`], the calibration step) instead of the first cycle: a draft that
//! agrees with none of its tokens never drafts, and one that agrees explores at the maximum
//! depth at once.

/// The adaptive depth policy of one generation.
#[derive(Debug, Clone)]
pub struct Adaptive {
    max: usize,
    depth: usize,
    time: Vec<Option<f64>>,
    accept: Vec<f64>,
    cycles: usize,
    probe_up: bool,
    /// The cycle of the next probe.
    next_probe: usize,
    /// The depth probed by the last cycle handed out, until its time is observed.
    probing: Option<usize>,
    /// Whether the next probe from below `max - 1` goes to the maximum depth.
    probe_far: bool,
    /// Still exploring: no explore cycle has accepted nothing.
    exploring: bool,
    /// Per depth: the cycles observed at it, and those of them timed (at a speculative depth
    /// not the first, nor one right after a plain stretch).
    runs: Vec<usize>,
    timed: Vec<usize>,
    /// Per draft position: the cycles that drafted it (and saw a verdict on it).
    judged: Vec<usize>,
    /// The first draft's acceptance as an EMA from 0.5 (slower than `accept[0]` at first): the
    /// spacing of probes from plain decoding ([`Adaptive::acceptance_scale`]).
    first_ema: f64,
    /// A plain stretch ran since the last speculative cycle: the next one includes a draft
    /// model's catching up over the stretch's tokens.
    after_stretch: bool,
    /// A depth to run again at once: a probe right after a stretch whose drafts were accepted,
    /// so that the depth gets a cycle time without the catching up.
    again: Option<usize>,
    /// Fewest cycles until the next probe for the last stretch's catching up
    /// ([`Adaptive::PROBE_BUDGET`] of the plain steps in between), until that probe is placed.
    catch_gap: usize,
    /// The generation opens with a plain stretch whose agreement decides exploring
    /// ([`Adaptive::with_opening`]).
    opening: bool,
    /// Exploring cycles so far.
    explored: usize,
}

impl Adaptive {
    /// EMA weight of a new observation.
    pub const ALPHA: f64 = 0.25;
    /// EMA weight of a cycle time below the estimate. Timing noise is one-sided (a cycle is
    /// slowed by one-time costs, other work or a sleeping thread, never sped up), so a faster
    /// cycle is better evidence of the true cost than a slower one: estimates come down fast and
    /// go up at [`Adaptive::ALPHA`].
    pub const ALPHA_DOWN: f64 = 0.75;
    /// Speculation must promise this many times plain decoding's tokens per second.
    pub const MARGIN: f64 = 1.05;
    /// Fewest cycles between probes of a neighbouring depth.
    pub const PROBE: usize = 16;
    /// Most of the time a probe may take, as a share of the cycles until the next probe.
    pub const PROBE_BUDGET: f64 = 1.0 / 32.0;
    /// Most cycles exploring before the calibration step (the first one's time is not counted).
    pub const EXPLORE: usize = 3;
    /// Drafts of the first cycle (at most the maximum depth).
    pub const FIRST_DEPTH: usize = 1;
    /// The floor of the first draft's acceptance in the spacing of probes: probes from plain
    /// decoding are at most 1 / this times further apart.
    pub const MIN_PROBE_ACCEPT: f64 = 0.05;
    /// The weight, in cycles, of the 0.5 every acceptance estimate starts from: the first
    /// verdicts at a position move its estimate by 1 / (n + this) (the mean of the verdicts and
    /// the prior), later ones by [`Adaptive::ALPHA`]. A draft accepted 3 times out of 3 is
    /// estimated at 0.93, not 0.72 as an EMA from 0.5 would say: deep cycles, which only pay
    /// when nearly every draft is accepted, are not held back for a dozen cycles.
    pub const ACCEPT_PRIOR_WEIGHT: f64 = 0.5;
    /// A probed depth whose expected rate is at least this share of the best one's is probed
    /// again after [`Adaptive::PROBE`] cycles, whatever its cost.
    pub const CLOSE: f64 = 0.75;
    /// Far probes (to the maximum depth) only while the first draft's acceptance (an EMA from
    /// 0.5) is at least this: one cycle that accepts nothing stops them until drafts agree again.
    pub const FAR_PROBE_ACCEPT: f64 = 0.4;
    /// Cycles of the opening plain stretch ([`Adaptive::with_opening`]).
    pub const OPENING: usize = 8;

    pub fn new(max: usize) -> Self {
        let max = max.max(1);
        Adaptive {
            max,
            depth: max,
            time: vec![None; max + 1],
            accept: vec![0.5; max],
            cycles: 0,
            probe_up: false,
            next_probe: Self::PROBE,
            probing: None,
            probe_far: true,
            exploring: true,
            runs: vec![0; max + 1],
            timed: vec![0; max + 1],
            judged: vec![0; max],
            first_ema: 0.5,
            after_stretch: false,
            again: None,
            catch_gap: 0,
            opening: false,
            explored: 0,
        }
    }

    /// Open with a plain stretch of [`Adaptive::OPENING`] cycles instead of a speculative
    /// cycle, for a drafter that measures its agreement with the target's tokens while the
    /// stretch runs (a draft model catching up on a thread of its own,
    /// [`crate::Drafter::agreement`]): [`Adaptive::observe_agreement`] then decides whether
    /// exploring is worth its cycles. The stretch is the calibration step.
    pub fn with_opening(mut self) -> Self {
        self.opening = true;
        self
    }

    /// The depth the policy currently settles on (probes aside).
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Expected accepted drafts of a cycle at depth `d`.
    pub fn expected_accepted(&self, d: usize) -> f64 {
        let (mut p, mut e) = (1.0, 0.0);
        for a in self.accept.iter().take(d) {
            p *= a;
            e += p;
        }
        e
    }

    /// Expected tokens per second at depth `d`, once measured. A speculative cycle runs the
    /// target at least once, so its time is taken as at least a plain step's (timing noise never
    /// makes a draft that gives nothing look faster than plain decoding).
    pub fn rate(&self, d: usize) -> Option<f64> {
        let t = self.time.get(d).copied().flatten()?;
        let floor = if d > 0 {
            self.time[0].unwrap_or(0.0)
        } else {
            0.0
        };
        Some((1.0 + self.expected_accepted(d)) / t.max(floor).max(1e-9))
    }

    fn score(&self, d: usize) -> f64 {
        let r = self.rate(d).unwrap_or(0.0);
        if d == 0 {
            r * Self::MARGIN
        } else {
            r
        }
    }

    /// The depth of the next cycle.
    pub fn next_depth(&mut self) -> usize {
        self.cycles += 1;
        if self.exploring {
            self.explored += 1;
            // after an opening stretch whose drafts agreed, the first cycle goes deep at once
            if self.explored == 1 && !self.opening {
                return Self::FIRST_DEPTH.min(self.max);
            }
            if self.explored <= Self::EXPLORE {
                return self.max;
            }
        }
        self.exploring = false;
        if self.time[0].is_none() {
            return 0;
        }
        if let Some(d) = self.again.take() {
            self.probing = Some(d);
            return d;
        }
        let (lo, hi) = (self.depth.saturating_sub(1), (self.depth + 1).min(self.max));
        if self.cycles >= self.next_probe {
            let far_useful = self.depth + 1 < self.max && self.accept[0] >= Self::FAR_PROBE_ACCEPT;
            let far = far_useful && self.probe_far;
            if far_useful {
                self.probe_far = !self.probe_far;
            }
            let n = if far {
                self.max
            } else {
                self.probe_up = !self.probe_up;
                if (self.probe_up && hi != self.depth) || lo == self.depth {
                    hi
                } else {
                    lo
                }
            };
            // placed again once the probe's time is known (`observe`)
            self.next_probe = self.cycles + Self::PROBE;
            self.probing = Some(n);
            return n;
        }
        let best = self.best();
        if best == 0 {
            self.depth = 0;
            return 0;
        }
        if let Some(d) = [lo, hi].into_iter().find(|&d| self.time[d].is_none()) {
            return d;
        }
        self.depth = best;
        best
    }

    /// The best measured of plain decoding and the current depth's neighbourhood.
    fn best(&self) -> usize {
        self.best_around(self.depth)
    }

    fn best_around(&self, depth: usize) -> usize {
        let (lo, hi) = (depth.saturating_sub(1), (depth + 1).min(self.max));
        [0, lo, self.depth, hi, self.max]
            .into_iter()
            .filter(|&d| self.time[d].is_some())
            .fold(0, |b, d| if self.score(d) > self.score(b) { d } else { b })
    }

    /// Whether the next cycles are the opening stretch ([`Adaptive::with_opening`]).
    pub fn opens(&self) -> bool {
        self.opening && self.cycles == 0
    }

    /// How many of the next cycles are plain steps for sure: past exploring and calibrating, with
    /// plain decoding the best measured choice, the cycles before the next probe. A caller may run them as one plain stretch and report it with
    /// [`Adaptive::observe_plain`].
    pub fn plain_run(&self) -> usize {
        if self.opens() {
            return Self::OPENING;
        }
        if self.exploring || self.again.is_some() || self.time[0].is_none() || self.best() != 0 || self.best_around(0) != 0 {
            return 0;
        }
        self.next_probe.saturating_sub(self.cycles + 1)
    }

    /// `n` plain steps ran as one stretch in `secs`: as `n` cycles at depth 0.
    pub fn observe_plain(&mut self, n: usize, secs: f64) {
        if n == 0 {
            return;
        }
        self.cycles += n;
        self.depth = 0;
        self.observe(0, 0, secs / n as f64);
        self.after_stretch = true;
    }

    /// Cycles until the probe after one at depth `d`: [`Adaptive::PROBE`], or, unless `d` may win
    /// (see the module docs), more when a cycle at `d` is measured to cost more than
    /// [`Adaptive::PROBE_BUDGET`] of that many cycles at the current depth; settled on plain
    /// decoding, divided by the first draft's acceptance ([`Adaptive::probe_scale`]).
    fn probe_gap(&self, d: usize, secs: f64) -> usize {
        // a depth that may win is probed at the shortest gap: one timed cycle of drafts that are
        // being accepted is no estimate yet (it may carry the rest of a new shape's set-up), and
        // a depth within CLOSE of the best is a close call
        let agreeing = self.accept[0] >= Self::FAR_PROBE_ACCEPT;
        let close = self.score(d) >= Self::CLOSE * self.score(self.best());
        // the probe's cost: this one's time (with any catching up) or the depth's estimate
        let tp = self.time[d].map_or(secs, |t| t.max(secs));
        let gap = match self.time[self.depth] {
            _ if close || (agreeing && self.timed[d] < 2) => Self::PROBE,
            Some(tc) if tc > 0.0 => Self::PROBE.max((tp / (Self::PROBE_BUDGET * tc)).ceil() as usize),
            _ => Self::PROBE,
        };
        (gap as f64 * self.probe_scale()).ceil() as usize
    }

    /// How much further apart probes from plain decoding are: 1 / the first draft's acceptance
    /// estimate (floored at [`Adaptive::MIN_PROBE_ACCEPT`]); 1 away from plain decoding. A probe can
    /// only pay off if drafts are accepted, so a draft that keeps failing is asked ever more rarely.
    fn probe_scale(&self) -> f64 {
        if self.depth == 0 {
            self.acceptance_scale()
        } else {
            1.0
        }
    }

    /// 1 / the first draft's acceptance, floored at [`Adaptive::MIN_PROBE_ACCEPT`]: its EMA from
    /// 0.5, which one early miss moves less than the estimate the rates use, since a probe's
    /// draft model catches up over every token it skipped and a later first probe costs more.
    fn acceptance_scale(&self) -> f64 {
        1.0 / self.first_ema.max(Self::MIN_PROBE_ACCEPT)
    }

    /// Verdicts on the first `judged` draft positions of a cycle, `accepted` of them kept (a
    /// miss at position `accepted` when it is judged).
    fn judge(&mut self, judged: usize, accepted: usize) {
        for i in 0..judged.min(self.max) {
            let hit = if i < accepted { 1.0 } else { 0.0 };
            self.judged[i] += 1;
            let alpha = Self::ALPHA.max(1.0 / (self.judged[i] as f64 + Self::ACCEPT_PRIOR_WEIGHT));
            self.accept[i] += alpha * (hit - self.accept[i]);
            if i == 0 {
                self.first_ema += Self::ALPHA * (hit - self.first_ema);
            }
        }
    }

    /// The drafter's agreement over the plain stretch that just ended
    /// ([`crate::Drafter::agreement`] as the decoder weighs it: for a run of history tokens,
    /// whether a draft from each would have been accepted), asked before the next cycle. It is
    /// read as the verdicts of
    /// cycles at the maximum depth drafting from those tokens one after another (each from the
    /// token after the last one's verdict), which update the acceptance estimates. When those
    /// cycles would have given fewer than [`Adaptive::MARGIN`] tokens each, no depth could
    /// have beaten plain decoding over the stretch whatever its cycle time (a cycle costs at
    /// least a plain step: [`Adaptive::rate`]): a probe due now is not run, and the next one
    /// comes as a probe from plain decoding's would (spaced by the first draft's acceptance);
    /// after the opening stretch ([`Adaptive::with_opening`]) exploring is skipped. Empty:
    /// nothing learned.
    pub fn observe_agreement(&mut self, agreed: &[bool]) {
        if agreed.is_empty() {
            return;
        }
        let (mut at, mut cycles, mut tokens) = (0, 0usize, 0usize);
        while at < agreed.len() {
            let run = agreed[at..].iter().take(self.max).take_while(|&&a| a).count();
            // a run reaching the end of what was measured has no verdict on the position after it
            let judged = if run < self.max && at + run < agreed.len() { run + 1 } else { run };
            self.judge(judged, run);
            cycles += 1;
            tokens += run + 1;
            at += run + 1;
        }
        if tokens as f64 >= Self::MARGIN * cycles as f64 {
            return;
        }
        self.exploring = false;
        self.depth = 0;
        self.next_probe = self.cycles + 1 + (Self::PROBE as f64 * self.acceptance_scale()).ceil() as usize;
    }

    /// A cycle at depth `d` took `secs` and `accepted` of its drafts were accepted.
    pub fn observe(&mut self, d: usize, accepted: usize, secs: f64) {
        let ema = |old: Option<f64>, x: f64| {
            Some(old.map_or(x, |o| o + if x < o { Self::ALPHA_DOWN } else { Self::ALPHA } * (x - o)))
        };
        // the first cycle at a speculative depth runs a new verify shape: one-time costs; the
        // first after a plain stretch includes a draft model's catching up over it (a cost of
        // the stretch, not of the depth: it spaces the next probe, below, but is no cycle time)
        let first = d > 0 && self.runs.get(d) == Some(&0);
        let catch_up = d > 0 && std::mem::take(&mut self.after_stretch);
        if let Some(r) = self.runs.get_mut(d) {
            *r += 1;
        }
        if !first && !catch_up {
            if let Some(t) = self.time.get_mut(d) {
                *t = ema(*t, secs);
                self.timed[d] += 1;
            }
        }
        self.judge(d.min(accepted + 1), accepted);
        // once every depth has been timed, a probe's catching up over the stretch before it is
        // budgeted whatever the depth (the estimates then say where speculation stands; probes
        // only refresh them): the next stretch, as long, costs as much again
        if catch_up && self.timed[1..].iter().all(|&n| n > 0) {
            let own = self.time[d].or(self.time[0]).unwrap_or(0.0);
            let step = self.time[0].unwrap_or(0.0).max(1e-9);
            self.catch_gap = ((secs - own).max(0.0) / (Self::PROBE_BUDGET * step)).ceil() as usize;
        }
        // placed with the probe's own verdict counted
        if self.probing.take() == Some(d) {
            self.next_probe = self.cycles + self.probe_gap(d, secs).max(self.catch_gap);
        }
        // a probe whose time was all catching up, with drafts accepted: once more at once
        if catch_up && accepted > 0 {
            self.again = Some(d);
        }
        if self.again.is_none() {
            self.catch_gap = 0;
        }
        if self.exploring && d > 0 && accepted == 0 {
            self.exploring = false;
            // the first probe of a draft that has just failed waits longer (as probe_scale)
            self.next_probe = self.cycles + (Self::PROBE as f64 * self.acceptance_scale()).ceil() as usize;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated pair: a cycle at depth d costs `base + d * per_draft`, each draft is accepted
    /// with probability `p` (deterministically, as a fraction).
    fn settle(p: f64, base: f64, per_draft: f64, plain: f64) -> (usize, f64) {
        let mut a = Adaptive::new(6);
        let mut total_depth = 0;
        let n = 400;
        for _ in 0..n {
            let d = a.next_depth();
            total_depth += d;
            let t = if d == 0 {
                plain
            } else {
                base + d as f64 * per_draft
            };
            // expected accepted count rounded: p^1 + ... as the run length of a geometric draw
            let accepted = (0..d).take_while(|i| p.powi(*i as i32 + 1) >= 0.5).count();
            a.observe(d, accepted, t);
        }
        (a.depth(), total_depth as f64 / n as f64)
    }

    #[test]
    fn useless_drafts_turn_speculation_off() {
        let (d, mean) = settle(0.0, 1.05, 0.1, 1.0);
        assert_eq!(d, 0);
        assert!(mean < 0.3, "mean depth {mean}");
    }

    #[test]
    fn good_cheap_drafts_go_deep_and_costly_ones_stay_shallow() {
        let (d, _) = settle(0.97, 1.05, 0.02, 1.0);
        assert!(d >= 5, "depth {d}");
        // every draft costs as much as a plain step: speculation cannot pay
        let (d, _) = settle(0.97, 1.05, 1.0, 1.0);
        assert!(d <= 1, "depth {d}");
    }

    /// Plain decoding's time with this policy against plain decoding alone, for a useless draft
    /// whose cycles cost `base + d * per_draft` plain steps.
    fn useless_overhead(base: f64, per_draft: f64, n: usize) -> f64 {
        let mut a = Adaptive::new(5);
        let mut total = 0.0;
        for _ in 0..n {
            let d = a.next_depth();
            let t = if d == 0 { 1.0 } else { base + d as f64 * per_draft };
            total += t;
            a.observe(d, 0, t);
        }
        total / n as f64
    }

    #[test]
    fn costly_probes_are_spaced_out() {
        // a verify forward that costs 6 plain steps (+ 0.8 a draft), as multi-row forwards do on
        // some GPUs: beyond the opening cycles, probing stays within the budget
        let short = useless_overhead(6.0, 0.8, 128);
        let long = useless_overhead(6.0, 0.8, 4096);
        assert!(long < 1.0 + 2.0 * Adaptive::PROBE_BUDGET, "overhead {long}");
        assert!(short > long, "the opening cycles dominate short runs: {short} vs {long}");
        // cheap probes keep the minimum gap
        let cheap = useless_overhead(1.05, 0.1, 4096);
        assert!(cheap < 1.0 + 2.0 * Adaptive::PROBE_BUDGET, "overhead {cheap}");
    }

    #[test]
    fn a_plain_run_lasts_until_the_next_probe() {
        let mut a = Adaptive::new(3);
        // the first cycle drafts FIRST_DEPTH tokens; accepting none ends exploring; then
        // calibrating with a plain step: no plain run yet
        assert_eq!(a.plain_run(), 0);
        assert_eq!(a.next_depth(), Adaptive::FIRST_DEPTH);
        a.observe(Adaptive::FIRST_DEPTH, 0, 40.0);
        assert_eq!(a.plain_run(), 0);
        assert_eq!(a.next_depth(), 0);
        a.observe(0, 0, 1.0);
        // the first probe of a draft that accepted nothing waits PROBE / 0.375 cycles (the first
        // draft's acceptance EMA after one miss), not PROBE, nor PROBE / (1/6) as the estimate the
        // rates use would say
        let n = a.plain_run();
        assert!(n > Adaptive::PROBE && n <= (Adaptive::PROBE as f64 / 0.375).ceil() as usize, "plain run {n}");
        a.observe_plain(n, n as f64);
        assert_eq!(a.plain_run(), 0, "the next cycle is a probe");
        assert_eq!(a.next_depth(), 1, "nothing accepted yet: the probe goes to the neighbour");
        a.observe(1, 0, 4.0);
        // a probe costing 4 plain steps: the next run is at least 4 / PROBE_BUDGET cycles away
        let n = a.plain_run();
        assert!(n as f64 >= 4.0 / Adaptive::PROBE_BUDGET - 2.0, "plain run {n}");
    }

    /// Settled on plain decoding with drafts that agree (deep cycles measured slow while cold):
    /// the next probe goes to the maximum depth, the one after to the neighbour.
    #[test]
    fn agreeing_drafts_get_far_probes() {
        let mut a = Adaptive::new(4);
        assert_eq!(a.next_depth(), Adaptive::FIRST_DEPTH);
        a.observe(Adaptive::FIRST_DEPTH, Adaptive::FIRST_DEPTH, 50.0);
        for _ in 1..Adaptive::EXPLORE {
            assert_eq!(a.next_depth(), 4);
            a.observe(4, 4, 20.0);
        }
        assert_eq!(a.next_depth(), 0);
        a.observe(0, 0, 1.0);
        let n = a.plain_run();
        assert!(n > 0, "plain decoding wins for now");
        a.observe_plain(n, n as f64);
        assert_eq!(a.next_depth(), 4, "far probe");
        a.observe(4, 4, 20.0);
        assert_eq!(a.plain_run(), 0);
        assert_eq!(a.next_depth(), 4, "after a stretch, once more to be timed");
        a.observe(4, 4, 20.0);
        let n = a.plain_run();
        a.observe_plain(n, n as f64);
        assert_eq!(a.next_depth(), 1, "then the neighbour");
    }

    /// 400 cycles of a GPU-like pair with every draft accepted: any speculative cycle pays a
    /// verify forward of 1.8 plain steps plus `per_draft` a draft (0.15: one or two drafts lose to
    /// plain decoding and six win); cycle `c` at depth `d` is `slow(c, d)` times slower. The
    /// settled depth and the mean depth.
    fn gpu_like_at(per_draft: f64, mut slow: impl FnMut(usize, usize) -> f64) -> (usize, f64) {
        let mut a = Adaptive::new(6);
        let (mut total_depth, n) = (0, 400);
        for c in 0..n {
            let d = a.next_depth();
            total_depth += d;
            let t = if d == 0 { 1.0 } else { 1.8 + per_draft * d as f64 };
            a.observe(d, d, t * slow(c, d));
        }
        (a.depth(), total_depth as f64 / n as f64)
    }

    fn gpu_like(slow: impl FnMut(usize, usize) -> f64) -> (usize, f64) {
        gpu_like_at(0.15, slow)
    }

    /// Deep cycles that pay only when nearly every draft is accepted (six drafts cost 4.8 plain
    /// steps: 7 tokens at 1.46 times plain decoding's rate, while 6 at 80% acceptance each would
    /// lose): three all-accepted opening cycles are enough to go deep at once. From acceptance
    /// EMAs starting at 0.5 (0.72 after three verdicts) plain decoding looked better and the
    /// costly probes were spaced hundreds of cycles apart.
    #[test]
    fn all_accepted_openings_are_trusted() {
        let mut seen = [false; 7];
        let (depth, mean) = gpu_like_at(0.5, |_, d| if d > 0 && !std::mem::replace(&mut seen[d], true) { 30.0 } else { 1.0 });
        assert!(depth >= 5, "depth {depth}");
        assert!(mean > 4.0, "mean depth {mean}");
    }

    /// The GPU-like pair with its first cycle 30 times slower (a first forward of a new shape
    /// compiles kernels).
    #[test]
    fn deep_drafts_win_where_shallow_ones_lose() {
        let (depth, mean) = gpu_like(|c, _| if c == 0 { 30.0 } else { 1.0 });
        // depth 6: 7 tokens in 2.7 plain steps; depth 1: 2 tokens in 1.95
        assert!(depth >= 5, "depth {depth}");
        assert!(mean > 4.0, "mean depth {mean}");
    }

    /// The GPU-like pair with the first cycle at every depth 30
    /// times slower (each depth's verify forward is a new shape; on CUDA, MLX's cuBLAS set-up
    /// and graph instantiation; a plain step's shape has run before): the deep depth is still
    /// found and kept.
    #[test]
    fn first_cycles_at_each_depth_pay_one_time_costs() {
        let mut seen = [false; 7];
        let (depth, mean) = gpu_like(|_, d| if d > 0 && !std::mem::replace(&mut seen[d], true) { 30.0 } else { 1.0 });
        assert!(depth >= 5, "depth {depth}");
        assert!(mean > 4.0, "mean depth {mean}");
    }

    /// The GPU-like pair with the first cycle at every depth 30 times slower and the second 3
    /// times (a draft model's first forward of several tokens comes in the second cycle): one
    /// slow timing of the deep depth makes plain decoding look better at first, but the deep
    /// depth is probed again soon, its estimate comes down at the first fast cycle, and it is
    /// kept.
    #[test]
    fn one_slow_timing_does_not_settle_on_plain_decoding() {
        let mut runs = [0usize; 7];
        let (depth, mean) = gpu_like(|_, d| {
            runs[d] += 1;
            match (d, runs[d]) {
                (0, _) => 1.0,
                (_, 1) => 30.0,
                (_, 2) => 3.0,
                _ => 1.0,
            }
        });
        assert!(depth >= 5, "depth {depth}");
        assert!(mean > 4.0, "mean depth {mean}");
    }

    #[test]
    fn exploring_goes_to_the_maximum_while_drafts_are_accepted() {
        let mut a = Adaptive::new(6);
        assert_eq!(a.next_depth(), Adaptive::FIRST_DEPTH);
        a.observe(Adaptive::FIRST_DEPTH, 2, 100.0);
        for _ in 1..Adaptive::EXPLORE {
            assert_eq!(a.next_depth(), 6);
            a.observe(6, 6, 3.0);
        }
        assert_eq!(a.next_depth(), 0, "calibration");
        a.observe(0, 0, 1.0);
        // 7 tokens in 3 steps against 1 in 1: stays deep (trying the unmeasured neighbour 5),
        // the cold first cycle forgotten
        let d = a.next_depth();
        assert!(d >= 5, "depth {d}");
    }

    /// `tokens` tokens generated as the generator does (plain runs as stretches of plain steps
    /// costing 1 each) with a policy up to `max`: speculative cycle `c` (from 1) at depth `d`
    /// after `behind` plain steps accepts `accepted(c, d)` drafts and costs `cost(d, behind)`.
    /// The settled depth and the share of tokens from speculative cycles.
    fn generated(
        max: usize,
        tokens: usize,
        mut accepted: impl FnMut(usize, usize) -> usize,
        mut cost: impl FnMut(usize, usize) -> f64,
    ) -> (usize, f64) {
        let mut a = Adaptive::new(max);
        let (mut done, mut spec, mut behind, mut cycle) = (0usize, 0usize, 0usize, 0usize);
        while done < tokens {
            let n = a.plain_run();
            if n > 0 {
                a.observe_plain(n, n as f64);
                (done, behind) = (done + n, behind + n);
                continue;
            }
            let d = a.next_depth();
            if d == 0 {
                a.observe(0, 0, 1.0);
                (done, behind) = (done + 1, behind + 1);
                continue;
            }
            cycle += 1;
            let k = accepted(cycle, d);
            a.observe(d, k, cost(d, std::mem::take(&mut behind)));
            done += k + 1;
            spec += k + 1;
        }
        (a.depth(), spec as f64 / done as f64)
    }

    /// The H100 pair of BENCHMARKS.md (`gpu_pair.py`: every draft accepted), in plain steps of
    /// 8.68 ms: a cycle at depth `d` takes 2.4 + 0.48 d of them (25 ms at depth 1, 50 at 7), the
    /// first at each depth 6 times that (new shapes), and the first after plain steps `catch_up`
    /// more per step (the draft model catching up over them: cuDNN built a graph for each new
    /// length). 256 tokens: depth 7 gives 8 tokens in 5.8 steps, so speculation stays on.
    #[test]
    fn gpu_pair_as_measured_stays_deep() {
        for catch_up in [0.0, 0.35, 1.0] {
            let mut seen = [false; 8];
            let (depth, share) = generated(7, 256, |_, d| d, |d, behind| {
                let t = 2.4 + 0.48 * d as f64;
                let t = if std::mem::replace(&mut seen[d], true) { t } else { 6.0 * t };
                t + catch_up * behind as f64
            });
            assert!(depth >= 5, "catching up {catch_up} a step: depth {depth}");
            assert!(share > 0.8, "catching up {catch_up} a step: {share} of the tokens speculative");
        }
    }

    /// The CPU pair of BENCHMARKS.md (`deep` target, SmolLM2 draft; every draft accepted but the
    /// very first): a cycle at depth `d` costs 2.2 + 0.45 d plain steps (depth 6: 7 tokens in 4.9
    /// steps), the first after plain steps 0.3 more per step (catching up). The opening miss
    /// settles on plain decoding; a probe after a stretch, all catching up, must not leave the
    /// deep depth untimed for good.
    #[test]
    fn probes_after_stretches_get_timed() {
        let accepted = |c: usize, d: usize| if c == 1 { 0 } else { d };
        let (depth, share) = generated(6, 512, accepted, |d, behind| 2.2 + 0.45 * d as f64 + 0.3 * behind as f64);
        assert!(share > 0.5, "{share} of the tokens speculative, settled at depth {depth}");
    }

    /// Time per token against plain decoding's for a pair as `generated` runs it, with each
    /// draft position accepted (given the ones before) with probability `accept[i]` (a fixed
    /// pseudo-random sequence) and a probe's catching up over at most `window` skipped tokens.
    fn close_call_cost(tokens: usize, window: usize) -> f64 {
        // the CPU SmolLM2 pair of BENCHMARKS.md (f32 target, its 4-bit g64 draft, chat prompt),
        // in plain steps of 23 ms: a cycle at depth d takes 1.1 + 0.5 d (37 ms at depth 1, 60 at
        // 3), catching up 0.18 a skipped token (4.1 ms); accepted 0.63 / 0.42 / 0.28 by position
        let accept = [0.63, 0.42 / 0.63, 0.28 / 0.42];
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut draw = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut a = Adaptive::new(3);
        let (mut done, mut behind, mut time) = (0usize, 0usize, 0.0);
        while done < tokens {
            let n = a.plain_run().min(tokens - done);
            if n > 0 {
                a.observe_plain(n, n as f64);
                (done, behind, time) = (done + n, behind + n, time + n as f64);
                continue;
            }
            let d = a.next_depth();
            let t = if d == 0 { 1.0 } else { 1.1 + 0.5 * d as f64 + 0.18 * std::mem::take(&mut behind).min(window) as f64 };
            let k = if d == 0 { 0 } else { (0..d).take_while(|&i| draw() < accept[i]).count() };
            if d == 0 {
                behind += 1;
            }
            a.observe(d, k, t);
            (done, time) = (done + k + 1, time + t);
        }
        time / done as f64
    }

    /// A draft that wins nowhere by much (depth 1 breaks even, deeper loses): probing it must
    /// not tax plain decoding by its catching up. Without the catching up budgeted, a close call
    /// is probed every PROBE cycles and each probe catches up over the whole stretch before it
    /// (1.16 plain steps a token over 4096 tokens, 1.14 over 256); budgeted but unbounded, the
    /// gaps and the catching up grow together (1.11); bounded by a window of 64, 1.02.
    #[test]
    fn a_close_call_costs_little_once_settled() {
        let windowed = close_call_cost(4096, 64);
        assert!(windowed < 1.0 + 2.0 * Adaptive::PROBE_BUDGET, "time per token {windowed}");
        let unbounded = close_call_cost(4096, usize::MAX);
        assert!(unbounded > windowed + 0.05, "time per token {unbounded} without a window, {windowed} with");
        let short = close_call_cost(256, 64);
        assert!(short < 1.10, "time per token {short} over 256 tokens");
    }

    /// An opening stretch ([`Adaptive::with_opening`]) whose tokens the draft agreed with goes
    /// to the maximum depth at once (the stretch was the calibration step); one it agreed with
    /// nowhere settles on plain decoding without a speculative cycle.
    #[test]
    fn the_opening_stretch_decides_exploring() {
        let mut a = Adaptive::new(4).with_opening();
        assert!(a.opens());
        assert_eq!(a.plain_run(), Adaptive::OPENING);
        a.observe_plain(Adaptive::OPENING, Adaptive::OPENING as f64);
        assert!(!a.opens());
        a.observe_agreement(&[true, true, true, false, true]);
        assert_eq!(a.plain_run(), 0);
        assert_eq!(a.next_depth(), 4, "exploring at the maximum depth");
        a.observe(4, 4, 3.0);
        assert_eq!(a.next_depth(), 4);
        // the same opening agreed with nowhere
        let mut a = Adaptive::new(4).with_opening();
        a.observe_plain(Adaptive::OPENING, Adaptive::OPENING as f64);
        a.observe_agreement(&[false; 5]);
        // five misses: the first draft's acceptance EMA is 0.5 * 0.75^5
        let n = a.plain_run();
        assert_eq!(n, (Adaptive::PROBE as f64 / (0.5 * 0.75f64.powi(5))).ceil() as usize);
        // without an opening, nothing is measured before the first cycle
        let mut a = Adaptive::new(4);
        assert_eq!(a.plain_run(), 0);
        a.observe_agreement(&[]);
        assert_eq!(a.next_depth(), Adaptive::FIRST_DEPTH);
    }

    /// A draft whose agreement over each stretch is nil is never asked to draft: each probe due
    /// is skipped, and the gaps grow to the floor of the first draft's acceptance
    /// ([`Adaptive::MIN_PROBE_ACCEPT`]); once it agrees over a stretch, the next cycle probes.
    /// Agreement whose cycles give [`Adaptive::MARGIN`] tokens or more is no reason to skip.
    #[test]
    fn stretches_without_agreement_skip_their_probes() {
        let mut a = Adaptive::new(6).with_opening();
        let mut done = 0;
        for _ in 0..8 {
            let n = a.plain_run();
            assert!(n > 0, "after {done} tokens");
            a.observe_plain(n, n as f64);
            done += n;
            a.observe_agreement(&vec![false; n.min(60)]);
        }
        assert_eq!(a.plain_run(), (Adaptive::PROBE as f64 / Adaptive::MIN_PROBE_ACCEPT).ceil() as usize, "after {done} tokens");
        let n = a.plain_run();
        a.observe_plain(n, n as f64);
        // one agreement in 20 tokens: 19 cycles for 20 tokens, 1.05 a cycle
        let mut agreed = vec![false; 20];
        agreed[7] = true;
        a.observe_agreement(&agreed);
        assert_eq!(a.plain_run(), 0, "not hopeless: the probe runs");
        assert!(a.next_depth() > 0);
        // a draft that misses the opening but agrees later: probed after that stretch
        let mut a = Adaptive::new(6).with_opening();
        a.observe_plain(Adaptive::OPENING, Adaptive::OPENING as f64);
        a.observe_agreement(&[false; 5]);
        let n = a.plain_run();
        a.observe_plain(n, n as f64);
        a.observe_agreement(&[true; 30]);
        assert_eq!(a.plain_run(), 0);
        assert!(a.next_depth() > 0);
    }

    /// Agreement is read as cycles at the maximum depth: a run of agreements is that many
    /// accepted drafts and the miss after it, a run cut by the end of what was measured no miss.
    #[test]
    fn agreement_reads_as_cycles_at_the_maximum_depth() {
        let mut a = Adaptive::new(3);
        // cycles: T T T (3 accepted, the maximum: no verdict on a 4th; the target's token skips
        // the next position), F (0 accepted), T F (1), T T (2, cut by the end)
        a.observe_agreement(&[true, true, true, true, false, true, false, true, true]);
        assert_eq!(a.judged, vec![4, 3, 1]);
        // position 0: 3 hits of 4 verdicts
        let mut b = Adaptive::new(3);
        for (judged, accepted) in [(3, 3), (1, 0), (2, 1), (2, 2)] {
            b.judge(judged, accepted);
        }
        assert_eq!(a.accept, b.accept);
    }

    #[test]
    fn expected_accepted_is_the_prefix_product_sum() {
        let mut a = Adaptive::new(3);
        a.accept = vec![0.5, 0.5, 1.0];
        assert!((a.expected_accepted(3) - (0.5 + 0.25 + 0.25)).abs() < 1e-12);
        assert_eq!(a.expected_accepted(0), 0.0);
    }
}
