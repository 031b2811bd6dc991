//! [`AssistantDrafter`]: Google's Gemma 4 assistant drafts (`gemma4_assistant` checkpoints).
use crate::drafter::{Draft, Drafter, Drawer, Feedback, SeededKey};
use crate::tracked::{forward, row, Tracked};
use mlx_array::{ops::concatenate, Array};
use mlx_models::families::gemma4::Gemma4Assistant;
use mlx_models::{Cache, Logits, Model, ModelError, Result};
use sampling::SamplingConfig;

/// One layer's keys and values.
type KvPair = (Array, Array);

/// Drafts with a `gemma4_assistant` network for a Gemma 4 target, as transformers'
/// `SinglePositionMultiTokenCandidateGenerator`: for a history `t_0..t_{n-1}` whose last token
/// the target has not seen, every draft step runs at position `n - 1` over the target's K/V of
/// positions `0..n-2` (its last own-K/V sliding and full layers); the first step's input is
/// [target embedding of `t_{n-1}`, the target's final-normed hidden state at `n - 2`], each later
/// one [target embedding of the previous draft, the assistant's projected hidden state].
///
/// In speculative decoding with a flat target cache the K/V are the verifier's own (its cache
/// holds positions `0..n-2` when a cycle starts) and the hidden state comes with the verdict of
/// the cycle before (the verify step's row of the last accepted token), so the target runs no
/// extra forward; only a history the drafter did not follow (the prompt, a new turn) is run
/// through the target once more for its hidden state. That holds while the verifier's sliding
/// layer holds every position the assistant attends over (the last `sliding_window`): past the
/// window, after a multi-token step the rotating cache keeps `sliding_window - 1`. Then, with a
/// paged target cache, and for [`Drafter::propose`] without a target cache, the K/V and hidden
/// state come from a flat cache of the drafter's own, kept in step with the history by running
/// the target over the tokens it has not seen.
pub struct AssistantDrafter {
    target: Model,
    net: Gemma4Assistant,
    cache: Cache,
    tracked: Tracked,
    /// The history the drafter follows and the target's hidden state at its last-but-one
    /// position (`[1, 1, H]`), from the verdicts.
    hidden: Option<(Vec<u32>, Array)>,
    run: usize,
    key: SeededKey,
    depth: usize,
}

impl AssistantDrafter {
    /// Drafts per cycle by default.
    pub const DEFAULT_DEPTH: usize = 3;
    /// The most drafts per cycle (deeper requests are clamped to it).
    pub const MAX_DEPTH: usize = 8;

    /// A drafter for `target` (a Gemma 4 model whose hidden size and vocabulary the assistant
    /// was built for).
    pub fn new(target: Model, net: Gemma4Assistant) -> Result<Self> {
        let facts = target.with_runtime(|rt| {
            rt.as_gemma4()
                .map(|g| (g.config().hidden_size, g.assistant_kv_layers()))
        });
        let Some((hidden, layers)) = facts else {
            return Err(ModelError::UnsupportedOption(format!(
                "a gemma4_assistant draft needs a Gemma 4 target; {} is {}",
                target.dir().display(),
                target.info().model_type
            )));
        };
        layers?;
        if hidden != net.backbone_hidden_size() {
            return Err(ModelError::UnsupportedOption(format!(
                "the assistant was built for a target of hidden size {}; {} has {hidden}",
                net.backbone_hidden_size(),
                target.dir().display()
            )));
        }
        let vocab = target.info().vocab_size;
        if net.config().vocab_size != vocab {
            return Err(ModelError::UnsupportedOption(format!(
                "the assistant's vocabulary ({}) is not the target's ({vocab})",
                net.config().vocab_size
            )));
        }
        let cache = Cache::new(&target.with_runtime(|rt| rt.cache_spec()));
        Ok(AssistantDrafter {
            target,
            net,
            cache,
            tracked: Tracked::new(Vec::new()),
            hidden: None,
            run: 0,
            key: SeededKey::new(5),
            depth: Self::DEFAULT_DEPTH,
        })
    }

    fn embed(&self, tokens: &Array) -> Result<Array> {
        self.target.with_runtime(|rt| {
            rt.as_gemma4()
                .ok_or_else(|| ModelError::Cache("the assistant's target is not Gemma 4".into()))?
                .embed_scaled(tokens)
        })
    }

    /// Check `history` and clamp `k`: `None` when there is nothing to draft.
    fn check(&self, history: &[u32], k: usize) -> Result<Option<usize>> {
        let k = k.min(Self::MAX_DEPTH);
        if k == 0 || history.len() < 2 {
            return Ok(None);
        }
        let vocab = self.target.info().vocab_size;
        if let Some(&t) = history.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!(
                "token {t} is outside the target's vocabulary of {vocab}"
            )));
        }
        Ok(Some(k))
    }

    /// The target's K/V and its hidden state at position `n - 2` from the drafter's own flat
    /// cache, brought to `history[..n-1]`.
    fn own_inputs(&mut self, history: &[u32]) -> Result<(Array, KvPair, KvPair)> {
        let n = history.len();
        // the target's cache over t_0..t_{n-3}, then t_{n-2} for its hidden state
        let target = self.target.clone();
        let fresh = || Cache::new(&target.with_runtime(|rt| rt.cache_spec()));
        self.tracked.sync(
            &self.target,
            &mut self.cache,
            &history[..n - 2],
            Some(&fresh),
        )?;
        self.run += 1;
        self.tracked.snapshot(&self.cache);
        let out = forward(
            &self.target,
            &mut self.cache,
            &row(&history[n - 2..n - 1])?,
            Logits::None,
            true,
        )?;
        self.tracked.tokens.push(history[n - 2]);
        let hidden = out
            .hidden
            .ok_or_else(|| ModelError::Cache("target forward returned no hidden state".into()))?;
        let (sliding, full) = Self::kv_of(&self.target, &mut self.cache)?;
        Ok((hidden, sliding, full))
    }

    fn kv_of(target: &Model, cache: &mut Cache) -> Result<(KvPair, KvPair)> {
        target.with_runtime(|rt| {
            rt.as_gemma4()
                .ok_or_else(|| ModelError::Cache("the assistant's target is not Gemma 4".into()))?
                .assistant_kv(cache)
        })
    }

    /// Draft up to `k` tokens after `history` from the target's hidden state at `n - 2` and its
    /// K/V; with `raw`, also the assistant's f32 logits of every step (`[k, V]`).
    #[allow(clippy::too_many_arguments)]
    fn draft_from(
        &mut self,
        history: &[u32],
        k: usize,
        cfg: &SamplingConfig,
        raw: bool,
        mut hidden: Array,
        sliding: &KvPair,
        full: &KvPair,
    ) -> Result<(Draft, Option<Array>)> {
        let n = history.len();
        let mut drawer = Drawer::new(cfg, history, k)?;
        let mut raws = Vec::with_capacity(k);
        let mut cur = row(&history[n - 1..])?;
        for _ in 0..k {
            let x = concatenate(&[&self.embed(&cur)?, &hidden], 2)?;
            let (logits, h) = self.net.step(&x, n - 1, sliding, full)?;
            let logits = logits.reshape(&[1, -1])?;
            cur = drawer.draw(&logits, &mut self.key)?.reshape(&[1, 1])?;
            hidden = h;
            if raw {
                raws.push(logits);
            }
        }
        let raws = if raw {
            Some(concatenate(&raws.iter().collect::<Vec<_>>(), 0)?)
        } else {
            None
        };
        Ok((drawer.finish(&raws.iter().collect::<Vec<_>>())?, raws))
    }

    /// Draft up to `k` tokens after `history` with the drafter's own target cache.
    fn draft(
        &mut self,
        history: &[u32],
        k: usize,
        cfg: &SamplingConfig,
        raw: bool,
    ) -> Result<(Draft, Option<Array>)> {
        let Some(k) = self.check(history, k)? else {
            return Ok((Draft::empty(), None));
        };
        let (hidden, sliding, full) = self.own_inputs(history)?;
        self.draft_from(history, k, cfg, raw, hidden, &sliding, &full)
    }

    /// Draft up to `k` tokens after `history` reading the K/V of the verifier's flat `cache`
    /// (which holds `history[..n-1]`); with `raw`, also the logits.
    fn draft_on(
        &mut self,
        history: &[u32],
        k: usize,
        cfg: &SamplingConfig,
        raw: bool,
        cache: &mut Cache,
    ) -> Result<(Draft, Option<Array>)> {
        let Some(k) = self.check(history, k)? else {
            return Ok((Draft::empty(), None));
        };
        let n = history.len();
        if cache.offset() != n - 1 {
            return Err(ModelError::Cache(format!(
                "the verifier's cache holds {} positions for a history of {n}",
                cache.offset()
            )));
        }
        let (sliding, full) = Self::kv_of(&self.target, cache)?;
        // After a multi-token step a rotating cache holds the last `window - 1` positions; the
        // assistant attends over `window` of them: then the drafter's own cache serves
        let window = self
            .target
            .with_runtime(|rt| rt.as_gemma4().map(|g| g.config().sliding_window))
            .unwrap_or(0);
        if sliding.0.dim(2)? < window.min(n - 1) {
            self.hidden = None;
            return self.draft(history, k, cfg, raw);
        }
        let hidden = match self.hidden.take() {
            Some((h, x)) if h == history => x,
            _ => {
                // a history the drafter did not follow: the target's hidden state at n - 2
                let mut c = Cache::new(&self.target.with_runtime(|rt| rt.cache_spec()));
                let out = forward(
                    &self.target,
                    &mut c,
                    &row(&history[..n - 1])?,
                    Logits::None,
                    true,
                )?;
                self.run += n - 1;
                let h = out.hidden.ok_or_else(|| {
                    ModelError::Cache("target forward returned no hidden state".into())
                })?;
                h.slice_axis(1, n - 2, n - 1)?
            }
        };
        self.draft_from(history, k, cfg, raw, hidden, &sliding, &full)
    }

    /// Greedy drafts after `history` and the assistant's f32 logits of each step (`[k, V]`,
    /// `k` clamped to [`AssistantDrafter::MAX_DEPTH`]); empty for `k == 0` or a history shorter
    /// than two tokens. With `target_cache` (a flat cache holding the target's run over all of
    /// `history` but its last token) the K/V are read from it, as in speculative decoding;
    /// otherwise from the drafter's own cache.
    pub fn draft_logits(
        &mut self,
        history: &[u32],
        k: usize,
        target_cache: Option<&mut Cache>,
    ) -> Result<(Vec<u32>, Option<Array>)> {
        let greedy = SamplingConfig::greedy();
        let (d, raw) = match target_cache {
            Some(c) => self.draft_on(history, k, &greedy, true, c)?,
            None => self.draft(history, k, &greedy, true)?,
        };
        Ok((d.tokens, raw))
    }
}

impl Drafter for AssistantDrafter {
    fn propose(&mut self, history: &[u32], k: usize, cfg: &SamplingConfig) -> Result<Draft> {
        Ok(self.draft(history, k, cfg, false)?.0)
    }

    fn propose_on(
        &mut self,
        history: &[u32],
        k: usize,
        cfg: &SamplingConfig,
        cache: &mut Cache,
    ) -> Result<Draft> {
        if cache.is_paged() {
            return self.propose(history, k, cfg);
        }
        Ok(self.draft_on(history, k, cfg, false, cache)?.0)
    }

    fn feedback(&mut self, f: &Feedback<'_>) -> Result<()> {
        // the hidden state of the last accepted position pairs with the next history
        self.hidden = match f.hidden {
            Some(h) => Some((
                f.next_history(),
                h.slice_axis(1, f.accepted, f.accepted + 1)?,
            )),
            None => None,
        };
        Ok(())
    }

    fn wants_target_hidden(&self) -> bool {
        true
    }

    fn target_positions_run(&self) -> usize {
        self.run + self.tracked.run
    }

    fn vocab_size(&self) -> usize {
        self.target.info().vocab_size
    }

    fn default_depth(&self) -> usize {
        self.depth
    }

    fn max_depth(&self) -> Option<usize> {
        Some(Self::MAX_DEPTH)
    }
}
