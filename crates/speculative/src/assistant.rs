//! [`AssistantDrafter`]: Google's Gemma 4 assistant drafts (`gemma4_assistant` checkpoints).
use crate::drafter::{draw, reads_history, sampler_for, Draft, Drafter, SeededKey};
use crate::tracked::{forward, row, Tracked};
use mlx_array::{ops::concatenate, Array};
use mlx_models::families::gemma4::Gemma4Assistant;
use mlx_models::{Cache, Logits, Model, ModelError, Result};
use sampling::SamplingConfig;

/// Drafts with a `gemma4_assistant` network for a Gemma 4 target, as transformers'
/// `SinglePositionMultiTokenCandidateGenerator`: for a history `t_0..t_{n-1}` whose last token
/// the target has not seen, every draft step runs at position `n - 1` over the target's K/V of
/// positions `0..n-2` (its last own-K/V sliding and full layers); the first step's input is
/// [target embedding of `t_{n-1}`, the target's final-normed hidden state at `n - 2`], each later
/// one [target embedding of the previous draft, the assistant's projected hidden state].
///
/// The target's K/V and hidden state come from a flat cache of the drafter's own, kept in step
/// with the history by running the target over the tokens it has not seen (the verifier's cache,
/// flat or paged, is not read), so each cycle costs the target one more forward over the
/// accepted tokens.
pub struct AssistantDrafter {
    target: Model,
    net: Gemma4Assistant,
    cache: Cache,
    tracked: Tracked,
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

    /// Draft up to `k` tokens after `history`; with `raw`, also the assistant's f32 logits of
    /// every step (`[k, V]`).
    fn draft(
        &mut self,
        history: &[u32],
        k: usize,
        cfg: &SamplingConfig,
        raw: bool,
    ) -> Result<(Draft, Option<Array>)> {
        let n = history.len();
        let k = k.min(Self::MAX_DEPTH);
        if k == 0 || n < 2 {
            return Ok((
                Draft {
                    tokens: Vec::new(),
                    logprobs: None,
                },
                None,
            ));
        }
        let vocab = self.target.info().vocab_size;
        if let Some(&t) = history.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!(
                "token {t} is outside the target's vocabulary of {vocab}"
            )));
        }
        // the target's cache over t_0..t_{n-3}, then t_{n-2} for its hidden state
        let target = self.target.clone();
        let fresh = || Cache::new(&target.with_runtime(|rt| rt.cache_spec()));
        self.tracked.sync(
            &self.target,
            &mut self.cache,
            &history[..n - 2],
            Some(&fresh),
        )?;
        self.tracked.snapshot(&self.cache);
        let out = forward(
            &self.target,
            &mut self.cache,
            &row(&history[n - 2..n - 1])?,
            Logits::None,
            true,
        )?;
        self.tracked.tokens.push(history[n - 2]);
        let mut hidden = out
            .hidden
            .ok_or_else(|| ModelError::Cache("target forward returned no hidden state".into()))?;
        let cache = &mut self.cache;
        let (sliding, full) = self.target.with_runtime(|rt| {
            rt.as_gemma4()
                .ok_or_else(|| ModelError::Cache("the assistant's target is not Gemma 4".into()))?
                .assistant_kv(cache)
        })?;
        let sampler = sampler_for(cfg)?;
        let (greedy, host) = (cfg.is_greedy(), reads_history(cfg));
        let mut hist: Vec<u32> = if host { history.to_vec() } else { Vec::new() };
        let (mut toks, mut lps, mut raws) = (
            Vec::with_capacity(k),
            Vec::with_capacity(k),
            Vec::with_capacity(k),
        );
        let mut cur = row(&history[n - 1..])?;
        for _ in 0..k {
            let x = concatenate(&[&self.embed(&cur)?, &hidden], 2)?;
            let (logits, h) = self.net.step(&x, n - 1, &sliding, &full)?;
            let logits = logits.reshape(&[1, -1])?;
            let (t, lp) = draw(&sampler, &logits, &mut hist, host, greedy, &mut self.key, cfg)?;
            cur = t.reshape(&[1, 1])?;
            hidden = h;
            toks.push(t);
            if !greedy {
                lps.push(lp);
            }
            if raw {
                raws.push(logits);
            }
        }
        let tokens = concatenate(&toks.iter().collect::<Vec<_>>(), 0)?;
        let logprobs = if greedy {
            None
        } else {
            Some(concatenate(&lps.iter().collect::<Vec<_>>(), 0)?)
        };
        let raws = if raw {
            Some(concatenate(&raws.iter().collect::<Vec<_>>(), 0)?)
        } else {
            None
        };
        let mut outs = vec![&tokens];
        outs.extend(logprobs.iter());
        outs.extend(raws.iter());
        mlx_array::eval(&outs)?;
        Ok((
            Draft {
                tokens: tokens.to_vec::<u32>()?,
                logprobs,
            },
            raws,
        ))
    }

    /// Greedy drafts after `history` and the assistant's f32 logits of each step (`[k, V]`,
    /// `k` clamped to [`AssistantDrafter::MAX_DEPTH`]); empty for `k == 0` or a history shorter
    /// than two tokens.
    pub fn draft_logits(&mut self, history: &[u32], k: usize) -> Result<(Vec<u32>, Option<Array>)> {
        let (d, raw) = self.draft(
            history,
            k,
            &SamplingConfig {
                temperature: 0.0,
                ..SamplingConfig::default()
            },
            true,
        )?;
        Ok((d.tokens, raw))
    }
}

impl Drafter for AssistantDrafter {
    fn propose(&mut self, history: &[u32], k: usize, cfg: &SamplingConfig) -> Result<Draft> {
        Ok(self.draft(history, k, cfg, false)?.0)
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
