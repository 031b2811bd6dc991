//! Opt-in stop guards against degenerate repetition, fed one generated token at a time.
use crate::config::SamplingConfig;
use crate::error::{Result, SamplingError};
use std::collections::VecDeque;

/// Why a [`StopGuard`] fired. Its finish reason is always `"repetition"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// `token` was produced `count` times in a row.
    ConsecutiveTokens { token: u32, count: usize },
    /// The last `size * repeats` tokens are one `size`-gram repeated `repeats` times.
    NgramRepeat { size: usize, repeats: usize },
}

impl StopReason {
    /// The finish reason to report: `"repetition"` (mlx-node's name).
    pub fn finish_reason(&self) -> &'static str {
        "repetition"
    }
}

/// Tracks one sequence's generated tokens and says when to stop.
///
/// * Consecutive guard (`max_consecutive_tokens = m >= 2`): fires when the same token has
///   been pushed `m` times in a row.
/// * N-gram guard (`max_ngram_repeats = r >= 2` and `ngram_size = N >= 2`): fires when, for
///   some pattern size `n` in `2..=N`, the last `n * r` tokens are one n-gram repeated `r`
///   times back to back ("A B A B A B" is the 2-gram "A B" three times). The smallest such
///   `n` is reported. A run of one token is a repeated n-gram too, so the n-gram guard also
///   stops long single-token runs.
///
/// A setting of 0 disables its guard (the seed default for all three). Each push costs
/// `O(N^2 r)` comparisons at most.
#[derive(Debug, Clone)]
pub struct StopGuard {
    max_consecutive: usize,
    repeats: usize,
    ngram: usize,
    recent: VecDeque<u32>,
    run: Option<(u32, usize)>,
}

impl StopGuard {
    /// The guards of a (validated) config.
    pub fn new(cfg: &SamplingConfig) -> Result<Self> {
        Self::with_limits(cfg.max_consecutive_tokens, cfg.max_ngram_repeats, cfg.ngram_size)
    }

    /// Explicit limits; each must be 0 (disabled) or `>= 2`.
    pub fn with_limits(max_consecutive_tokens: usize, max_ngram_repeats: usize, ngram_size: usize) -> Result<Self> {
        for (name, v) in [("max_consecutive_tokens", max_consecutive_tokens), ("max_ngram_repeats", max_ngram_repeats), ("ngram_size", ngram_size)] {
            if v == 1 {
                return Err(SamplingError::StopGuard(format!("{name} must be 0 (disabled) or >= 2, got 1")));
            }
        }
        Ok(StopGuard { max_consecutive: max_consecutive_tokens, repeats: max_ngram_repeats, ngram: ngram_size, recent: VecDeque::new(), run: None })
    }

    /// Whether any guard is on.
    pub fn is_enabled(&self) -> bool {
        self.max_consecutive > 0 || self.ngram_enabled()
    }

    fn ngram_enabled(&self) -> bool {
        self.repeats > 0 && self.ngram > 0
    }

    /// Forget the tokens seen so far.
    pub fn reset(&mut self) {
        self.recent.clear();
        self.run = None;
    }

    /// Record a generated token; `Some` means stop now with finish reason "repetition".
    pub fn push(&mut self, token: u32) -> Option<StopReason> {
        let count = match self.run {
            Some((t, c)) if t == token => c + 1,
            _ => 1,
        };
        self.run = Some((token, count));
        if self.max_consecutive > 0 && count >= self.max_consecutive {
            return Some(StopReason::ConsecutiveTokens { token, count });
        }
        if !self.ngram_enabled() {
            return None;
        }
        let cap = self.ngram * self.repeats;
        if self.recent.len() == cap {
            self.recent.pop_front();
        }
        self.recent.push_back(token);
        let len = self.recent.len();
        for n in 2..=self.ngram {
            let span = n * self.repeats;
            if span > len {
                break;
            }
            let start = len - span;
            if (start..len - n).all(|i| self.recent[i] == self.recent[i + n]) {
                return Some(StopReason::NgramRepeat { size: n, repeats: self.repeats });
            }
        }
        None
    }
}
