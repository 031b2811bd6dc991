//! The NaN-gradient guard: an update whose gradients are not finite is skipped (the parameters
//! and the optimizer state stay as they were), counted, and once more than
//! `max_nan_gradients` updates have been skipped in a run, training stops with
//! [`TrainError::NanGradients`] so that the caller writes an emergency checkpoint of the last
//! finite parameters (mlx-node's `maxNanGradients`, default 100).
//!
//! ```
//! use mlx_training::guard::{NanGuard, Verdict};
//! let mut g = NanGuard::new(1);
//! assert_eq!(g.check(2.5, 0.7), Verdict::Apply);
//! assert_eq!(g.check(f32::NAN, 0.7), Verdict::Skip { skipped: 1 });
//! assert!(matches!(g.check(1.0, f32::INFINITY), Verdict::Stop { skipped: 2 }));
//! assert!(g.stop_error().is_err());
//! ```
use crate::error::{Result, TrainError};

/// mlx-node's default for `max_nan_gradients`.
pub const DEFAULT_MAX_NAN_GRADIENTS: u64 = 100;

/// What to do with an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Finite: apply it.
    Apply,
    /// Not finite: skip it; `skipped` updates skipped so far, this one included.
    Skip { skipped: u64 },
    /// Not finite, and more than the allowed number skipped: skip it and stop the run.
    Stop { skipped: u64 },
}

/// Counts skipped updates across a run (saved with checkpoints, so a resumed run keeps counting).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NanGuard {
    max_nan_gradients: u64,
    skipped: u64,
}

impl NanGuard {
    /// A guard that stops the run once more than `max_nan_gradients` updates were skipped
    /// (`0`: the first non-finite gradient stops it).
    pub fn new(max_nan_gradients: u64) -> Self {
        NanGuard { max_nan_gradients, skipped: 0 }
    }

    /// Continue a count (from a checkpoint).
    pub fn with_skipped(mut self, skipped: u64) -> Self {
        self.skipped = skipped;
        self
    }

    /// Judge an update by its loss and its gradients' global norm (the norm of gradients with a
    /// NaN or an infinity is not finite).
    pub fn check(&mut self, loss: f32, grad_norm: f32) -> Verdict {
        if loss.is_finite() && grad_norm.is_finite() {
            return Verdict::Apply;
        }
        self.skipped += 1;
        if self.skipped > self.max_nan_gradients {
            Verdict::Stop { skipped: self.skipped }
        } else {
            Verdict::Skip { skipped: self.skipped }
        }
    }

    /// Updates skipped so far.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    pub fn max_nan_gradients(&self) -> u64 {
        self.max_nan_gradients
    }

    /// `Err(TrainError::NanGradients)` once the run must stop, else `Ok(())`.
    pub fn stop_error(&self) -> Result<()> {
        if self.skipped > self.max_nan_gradients {
            return Err(TrainError::NanGradients { skipped: self.skipped, max: self.max_nan_gradients });
        }
        Ok(())
    }
}

impl Default for NanGuard {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_NAN_GRADIENTS)
    }
}
