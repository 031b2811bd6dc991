//! [`MtpDrafter`]: drafts from the target's own multi-token-prediction head (Qwen3.5).
use crate::drafter::{Draft, Drafter, Drawer, Feedback, SeededKey};
use crate::tracked::row;
use mlx_array::{ops::concatenate, Array};
use mlx_models::{Cache, Logits, Model, ModelError, Result};
use sampling::SamplingConfig;

/// Drafts with the target's MTP head ([`mlx_models::ModelRuntime::mtp_forward`]): the first
/// draft from the target's hidden state at the newest verified position and the newest token,
/// each deeper one from the head's own output and the previous draft (vLLM's MTP proposer).
///
/// The head's K/V cache holds one entry per target position, built from the target's hidden
/// states: those of each verify step come with the verdict; those of a history the drafter has
/// not followed (the prompt, a new chat turn) are computed by running the target over it once
/// more. Draft entries beyond the verified positions are trimmed at the next cycle.
pub struct MtpDrafter {
    target: Model,
    cache: Cache,
    /// The history the drafter follows: pairs for positions `0..verified` are in the cache, the
    /// target hidden states of positions `verified..known.len() - 1` are in `pending`.
    known: Vec<u32>,
    verified: usize,
    pending: Option<Array>,
    /// Draft entries after the verified ones (trimmed before the next cycle).
    drafted: usize,
    run: usize,
    key: SeededKey,
    depth: usize,
    /// Positions to size the MTP cache's flat storage for ([`Drafter::reserve`]).
    reserve: usize,
}

impl MtpDrafter {
    /// Drafts per cycle by default.
    pub const DEFAULT_DEPTH: usize = 3;

    /// A drafter over `target`'s MTP head; refused when it has none (or not exactly one MTP layer).
    pub fn new(target: Model) -> Result<Self> {
        let layers = target.with_runtime(|rt| rt.mtp_layers());
        if layers != 1 {
            return Err(ModelError::UnsupportedOption(format!(
                "MTP drafting needs a model with one MTP layer; {} has {layers}{}",
                target.dir().display(),
                if target.has_mtp_weights() {
                    " usable (its MTP tensors did not build: see the load notes)"
                } else {
                    ""
                }
            )));
        }
        let spec = target
            .with_runtime(|rt| rt.mtp_cache_spec())
            .ok_or_else(|| ModelError::UnsupportedOption("no MTP cache layout".into()))?;
        Ok(MtpDrafter {
            cache: Cache::new(&spec),
            target,
            known: Vec::new(),
            verified: 0,
            pending: None,
            drafted: 0,
            run: 0,
            key: SeededKey::new(3),
            depth: Self::DEFAULT_DEPTH,
            reserve: 0,
        })
    }

    /// Start over on `history`: the target's hidden states over all of it but the last token.
    fn resync(&mut self, history: &[u32]) -> Result<()> {
        let spec = self
            .target
            .with_runtime(|rt| rt.mtp_cache_spec())
            .ok_or_else(|| ModelError::UnsupportedOption("no MTP cache layout".into()))?;
        self.cache = Cache::new(&spec);
        self.cache.reserve(self.reserve)?;
        (self.verified, self.drafted, self.pending) = (0, 0, None);
        self.known = history.to_vec();
        if history.len() > 1 {
            let mut c = Cache::new(&self.target.with_runtime(|rt| rt.cache_spec()));
            let before = &history[..history.len() - 1];
            let out = self
                .target
                .with_runtime(|rt| rt.forward(&row(before)?, &mut c, Logits::None, true))?;
            self.run += before.len();
            self.pending = out.hidden;
        }
        Ok(())
    }

    fn step(&mut self, tokens: &Array, hidden: &Array) -> Result<(Array, Array)> {
        let (logits, h) = self
            .target
            .with_runtime(|rt| rt.mtp_forward(tokens, hidden, &mut self.cache, 0))?;
        let l = logits.dim(1)?;
        Ok((
            logits.slice_axis(1, l - 1, l)?.reshape(&[1, -1])?,
            h.slice_axis(1, l - 1, l)?,
        ))
    }
}

impl Drafter for MtpDrafter {
    fn reserve(&mut self, positions: usize) {
        self.reserve = positions;
    }

    fn propose(&mut self, history: &[u32], k: usize, cfg: &SamplingConfig) -> Result<Draft> {
        if k == 0 || history.len() < 2 {
            return Ok(Draft::empty());
        }
        if self.known != history {
            self.resync(history)?;
        }
        if self.drafted > 0 {
            self.cache.trim(self.drafted)?;
            self.drafted = 0;
        }
        let Some(pending) = self.pending.take() else {
            return Err(ModelError::Cache(
                "MTP drafter has no target hidden states to draft from (internal error)".into(),
            ));
        };
        let m = pending.dim(1)?;
        let n = history.len();
        if self.verified + m + 1 != n {
            return Err(ModelError::Cache(format!(
                "MTP drafter out of step: {} verified + {m} pending for a history of {n}",
                self.verified
            )));
        }
        let toks = &history[self.verified + 1..];
        let (mut logits, mut h) = self.step(&row(toks)?, &pending)?;
        self.verified += m;
        let mut drawer = Drawer::new(cfg, history, k)?;
        for i in 0..k {
            let t = drawer.draw(&logits, &mut self.key)?;
            if i + 1 < k {
                (logits, h) = self.step(&t.reshape(&[1, 1])?, &h)?;
                self.drafted += 1;
            }
        }
        drawer.finish(&[])
    }

    fn feedback(&mut self, f: &Feedback<'_>) -> Result<()> {
        let Some(hidden) = f.hidden else {
            return Err(ModelError::Cache(
                "MTP drafting needs the target's hidden states (internal error)".into(),
            ));
        };
        if self.known != f.history {
            // a step the drafter did not follow: start over at the next proposal
            (self.known, self.pending) = (Vec::new(), None);
            return Ok(());
        }
        // the target's hidden states at `last` and the accepted drafts pair with the accepted
        // drafts and the target's own token (after those of steps not drafted from yet)
        let new = hidden.slice_axis(1, 0, f.accepted + 1)?;
        self.pending = Some(match self.pending.take() {
            Some(p) => concatenate(&[&p, &new], 1)?,
            None => new,
        });
        self.known = f.next_history();
        Ok(())
    }

    fn wants_target_hidden(&self) -> bool {
        true
    }

    fn target_positions_run(&self) -> usize {
        self.run
    }

    fn vocab_size(&self) -> usize {
        self.target.info().vocab_size
    }

    fn default_depth(&self) -> usize {
        self.depth
    }
}
