//! Temperature and the truncation filters (top-k, top-p, min-p) on `[B, V]` log-probabilities.
//!
//! Every filter is computed on the tempered, untruncated distribution and the kept set is the
//! intersection of the three (mlx-lm applies top-p, min-p, top-k in that order on unnormalised
//! masked log-probs, which amounts to the same). Unlike mlx-lm, which filters the temperature-1
//! distribution and applies the temperature only in the final draw, the temperature comes
//! first here (the Hugging Face / vLLM order), so that "top_p keeps the smallest set whose mass
//! reaches p" holds for the distribution the token is actually drawn from.
use crate::config::SamplingConfig;
use crate::error::Result;
use mlx_array::{ops::where_, Array, DType};

fn neg_inf() -> Array {
    Array::scalar(f32::NEG_INFINITY)
}

/// `log_softmax(x)` along the last axis.
pub fn log_softmax(x: &Array) -> Result<Array> {
    Ok(x.sub(&x.logsumexp(&[-1], true)?)?)
}

/// Keep exactly `k` tokens per row (the `k` largest; ties at the k-th value are broken by
/// MLX's `argpartition`, i.e. arbitrarily but deterministically). Tokens already at `-inf`
/// count among the `k` when fewer than `k` are finite. `k == 0` or `k >= V` is a no-op.
pub fn top_k(logprobs: &Array, k: usize) -> Result<Array> {
    let v = logprobs.dim(-1)?;
    if k == 0 || k >= v {
        return Ok(logprobs.clone());
    }
    let order = logprobs.neg()?.argpartition(k as i32 - 1, -1)?;
    let drop = order.slice_axis(-1, k, v)?;
    Ok(logprobs.put_along_axis(&drop, &neg_inf(), -1)?)
}

/// Nucleus filter: a token is kept when the mass of the tokens strictly more likely than it
/// (in sorted order) is below `p * total`, i.e. the smallest most-likely prefix whose mass
/// reaches `p`; every token tied with the least likely kept one is kept too (the cut is a
/// threshold on the log-prob). `p >= 1` is a no-op. Same algorithm as mlx-lm's `apply_top_p`.
pub fn top_p(logprobs: &Array, p: f32) -> Result<Array> {
    if p >= 1.0 {
        return Ok(logprobs.clone());
    }
    let sorted = logprobs.sort(-1)?;
    let probs = sorted.exp()?;
    let mass_above = probs.cumsum(-1, true, false)?;
    let total = probs.sum(&[-1], true)?;
    let dropped = mass_above.ge(&total.mul_scalar(p)?)?.astype(DType::U32)?.sum(&[-1], true)?;
    let threshold = sorted.take_along_axis(&dropped, -1)?;
    Ok(where_(&logprobs.lt(&threshold)?, &neg_inf(), logprobs)?)
}

/// Drop tokens with `p < min_p * p_max` (in log space: `lp < lp_max + ln(min_p)`). `min_p == 0`
/// is a no-op; `min_p == 1` keeps the maximum and its ties.
pub fn min_p(logprobs: &Array, min_p: f32) -> Result<Array> {
    if min_p <= 0.0 {
        return Ok(logprobs.clone());
    }
    let thr = logprobs.max(&[-1], true)?.add_scalar(min_p.ln())?;
    Ok(where_(&logprobs.lt(&thr)?, &neg_inf(), logprobs)?)
}

/// The sampling distribution of non-greedy decoding, as normalised log-probs `[B, V]`:
/// `logits / temperature`, then top-p, min-p and top-k (kept set = intersection), renormalised.
/// Filtered tokens are `-inf`. `logits` are f32 and already penalised.
pub fn tempered_filtered(logits: &Array, cfg: &SamplingConfig) -> Result<Array> {
    let x = if cfg.temperature == 1.0 { logits.clone() } else { logits.mul_scalar(1.0 / cfg.temperature)? };
    let truncating = cfg.top_p < 1.0 || cfg.min_p > 0.0 || (cfg.top_k > 0 && (cfg.top_k as usize) < x.dim(-1)?);
    let mut lp = log_softmax(&x)?;
    if !truncating {
        return Ok(lp);
    }
    lp = top_p(&lp, cfg.top_p)?;
    lp = min_p(&lp, cfg.min_p)?;
    lp = top_k(&lp, cfg.top_k as usize)?;
    log_softmax(&lp)
}
