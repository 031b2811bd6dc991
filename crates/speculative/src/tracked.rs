//! A cache together with the tokens it holds: rolled back to any earlier prefix by trimming, or
//! by restoring a snapshot and re-running the tokens after it (recurrent state, rotating windows).
use mlx_array::Array;
use mlx_models::{Cache, CacheSnapshot, Logits, Model, ModelError, Result};

/// The tokens a cache holds, in order, and one snapshot of it.
pub(crate) struct Tracked {
    pub(crate) tokens: Vec<u32>,
    snap: Option<(CacheSnapshot, usize)>,
    /// Positions run through the model so far ([`Tracked::sync`], [`Tracked::fed`]).
    pub(crate) run: usize,
}

/// One forward call without the host-side id range check (ids are checked by the callers).
pub(crate) fn forward(
    model: &Model,
    cache: &mut Cache,
    toks: &Array,
    logits: Logits,
    hidden: bool,
) -> Result<mlx_models::ForwardOutput> {
    model.with_runtime(|rt| rt.forward(toks, cache, logits, hidden))
}

/// [`forward`] that also returns the residual stream after the layers in `taps` (none: a plain
/// forward).
pub(crate) fn forward_tapped(
    model: &Model,
    cache: &mut Cache,
    toks: &Array,
    logits: Logits,
    hidden: bool,
    taps: &[usize],
) -> Result<(mlx_models::ForwardOutput, Vec<Array>)> {
    if taps.is_empty() {
        return Ok((forward(model, cache, toks, logits, hidden)?, Vec::new()));
    }
    model.with_runtime(|rt| rt.forward_taps(toks, cache, logits, hidden, taps))
}

pub(crate) fn row(toks: &[u32]) -> Result<Array> {
    Ok(Array::from_slice(toks, &[1, toks.len()])?)
}

impl Tracked {
    pub(crate) fn new(tokens: Vec<u32>) -> Self {
        Tracked {
            tokens,
            snap: None,
            run: 0,
        }
    }

    /// The cache was fed outside [`Tracked::sync`] and now holds `tokens`; no snapshot reaches it.
    pub(crate) fn reset(&mut self, tokens: Vec<u32>) {
        self.tokens = tokens;
        self.snap = None;
    }

    /// Remember the cache's current state as a rollback point.
    pub(crate) fn snapshot(&mut self, cache: &Cache) {
        self.snap = Some((cache.snapshot(), self.tokens.len()));
    }

    /// Make `cache` hold exactly `want`: roll back to the longest common prefix (trim when every
    /// layer can, else restore the snapshot and re-run; with `fresh`, start over when neither
    /// reaches), then feed the rest. The cache's pending writes are queued before returning.
    pub(crate) fn sync(
        &mut self,
        model: &Model,
        cache: &mut Cache,
        want: &[u32],
        fresh: Option<&dyn Fn() -> Cache>,
    ) -> Result<()> {
        let held = self.rollback(cache, want, fresh)?;
        let rest = &want[held..];
        if !rest.is_empty() {
            forward(model, cache, &row(rest)?, Logits::None, false)?;
            cache.async_eval_with(&[])?;
            self.fed(rest);
        }
        Ok(())
    }

    /// The rollback of [`Tracked::sync`] alone: afterwards the cache holds a prefix of `want`,
    /// whose length is returned; the caller feeds the rest and reports it with [`Tracked::fed`].
    pub(crate) fn rollback(
        &mut self,
        cache: &mut Cache,
        want: &[u32],
        fresh: Option<&dyn Fn() -> Cache>,
    ) -> Result<usize> {
        let common = self.common_prefix(want);
        if common < self.tokens.len() {
            let drop = self.tokens.len() - common;
            if cache.can_trim(drop) {
                cache.trim(drop)?;
                self.tokens.truncate(common);
            } else if let Some((s, at)) = self.snap.as_ref().filter(|(_, at)| *at <= common) {
                cache.restore(s)?;
                self.tokens.truncate(*at);
            } else if let Some(f) = fresh {
                *cache = f();
                self.tokens.clear();
            } else {
                return Err(ModelError::Cache(format!("cannot roll back {drop} positions: the cache cannot be trimmed and no snapshot reaches back that far")));
            }
            if self
                .snap
                .as_ref()
                .is_some_and(|(_, at)| *at > self.tokens.len())
            {
                self.snap = None;
            }
        }
        Ok(self.tokens.len())
    }

    /// How many leading tokens of `want` the cache holds (before any rollback).
    pub(crate) fn common_prefix(&self, want: &[u32]) -> usize {
        self.tokens.iter().zip(want).take_while(|(a, b)| a == b).count()
    }

    /// `toks` were run through the model after the held tokens.
    pub(crate) fn fed(&mut self, toks: &[u32]) {
        self.run += toks.len();
        self.tokens.extend_from_slice(toks);
    }
}
