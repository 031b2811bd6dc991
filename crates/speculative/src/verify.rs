//! The verifier's decision for one cycle, from the target's processed distributions.
//!
//! `target` is `[k + 1, V]` normalised log-probs: row `i` the distribution of the token after
//! `last, d_0 .. d_{i-1}` with every sampler setting applied (penalties over the history
//! including the drafts before `i`, temperature, filters); `-inf` marks filtered tokens.
//!
//! * Temperature 0: the longest prefix of drafts equal to the rows' argmax is kept, then the
//!   argmax of the next row: exactly the target's greedy output. Here `target` may be any
//!   logits whose log-softmax is that distribution (the sampler's penalised logits): only the
//!   argmax and the log-softmax at it are read ([`Array::greedy_pick`]).
//! * Temperature > 0 (Leviathan et al. 2023, Chen et al. 2023): draft `d_i`, drawn from the
//!   draft's processed distribution `q_i`, is accepted with probability
//!   `min(1, p_i(d_i) / q_i(d_i))`; at the first rejection the token is drawn from the residual
//!   `norm(max(p_i - q_i, 0))`; when all `k` are accepted, one more token is drawn from `p_k`.
//!   Every emitted token is then distributed exactly as under plain sampling from `p`.
use mlx_array::random::{categorical, uniform, Key};
use mlx_array::{ops::where_, Array, DType};
use mlx_models::{ModelError, Result, Token};

/// What the target made of one cycle's drafts.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Leading drafts accepted.
    pub accepted: usize,
    /// The tokens to emit: the accepted drafts, then the target's own token, each with its
    /// log-prob under the target's processed distribution.
    pub tokens: Vec<Token>,
}

fn check(target: &Array, drafts: &[u32]) -> Result<usize> {
    let s = target.shape();
    if s.len() != 2 || s[0] != drafts.len() + 1 {
        return Err(ModelError::InvalidInput(format!(
            "target distributions {s:?} for {} drafts (want [k + 1, V])",
            drafts.len()
        )));
    }
    if let Some(d) = drafts.iter().find(|&&d| d as usize >= s[1]) {
        return Err(ModelError::InvalidInput(format!(
            "draft token {d} outside the target's vocabulary of {}",
            s[1]
        )));
    }
    Ok(s[1])
}

/// Pick `ids[i]` from row `i` of `x` (`[n, V]`), as `[n]`.
fn pick(x: &Array, ids: &[u32]) -> Result<Array> {
    let idx = Array::from_slice(ids, &[ids.len(), 1])?;
    Ok(x.take_along_axis(&idx, -1)?.reshape(&[-1])?)
}

/// Temperature 0: the longest prefix of `drafts` the target's argmax agrees with; log-probs are
/// the log-softmax of `target`'s rows at the emitted tokens.
pub fn verify_greedy(target: &Array, drafts: &[u32]) -> Result<Verdict> {
    let (best, lp) = greedy_picks(target, drafts)?;
    greedy_verdict(&best, &lp, drafts)
}

/// The first half of [`verify_greedy`], not evaluated: each row's argmax (`[k + 1]` u32) and
/// the log-softmax there (`[k + 1]` f32).
pub fn greedy_picks(target: &Array, drafts: &[u32]) -> Result<(Array, Array)> {
    check(target, drafts)?;
    Ok(target.greedy_pick()?)
}

/// The second half of [`verify_greedy`]: the verdict from [`greedy_picks`]' arrays (evaluated
/// here).
pub fn greedy_verdict(best: &Array, lp: &Array, drafts: &[u32]) -> Result<Verdict> {
    let k = drafts.len();
    if best.shape() != [k + 1] || lp.shape() != [k + 1] {
        return Err(ModelError::InvalidInput(format!(
            "greedy picks {:?} / {:?} for {k} drafts (want [k + 1])",
            best.shape(),
            lp.shape()
        )));
    }
    mlx_array::eval(&[best, lp])?;
    let (best, lp) = (best.to_vec::<u32>()?, lp.to_vec::<f32>()?);
    let n = drafts.iter().zip(&best).take_while(|(d, b)| d == b).count();
    debug_assert!(n <= k);
    // an accepted draft is its row's argmax: the row's picked log-prob is the draft's
    Ok(Verdict {
        accepted: n,
        tokens: best[..=n]
            .iter()
            .zip(&lp)
            .map(|(&id, &logprob)| Token { id, logprob })
            .collect(),
    })
}

/// Temperature > 0: rejection sampling against the draft distributions `draft` (`[k, V]`
/// normalised log-probs each draft was drawn from). `key` is split for every draw.
pub fn verify_sampled(
    target: &Array,
    draft: &Array,
    drafts: &[u32],
    key: &mut Key,
) -> Result<Verdict> {
    let k = drafts.len();
    let v = check(target, drafts)?;
    if draft.shape() != [k, v] {
        return Err(ModelError::InvalidInput(format!(
            "draft distributions {:?} for {k} drafts over {v} tokens",
            draft.shape()
        )));
    }
    let mut draw = || -> Result<Key> {
        let (next, d) = key.split()?;
        *key = next;
        Ok(d)
    };
    let mut n = k;
    let mut p_d = Vec::new();
    if k > 0 {
        let p = pick(&target.slice_axis(0, 0, k)?, drafts)?;
        let q = pick(draft, drafts)?;
        let u = uniform(&[k], 0.0, 1.0, DType::F32, &draw()?)?;
        // accept d_i iff u_i < p_i(d_i) / q_i(d_i), i.e. log u_i < log p - log q
        let ok = u.log()?.lt(&p.sub(&q)?)?;
        mlx_array::eval(&[&p, &ok])?;
        p_d = p.to_vec::<f32>()?;
        let ok = ok.to_vec::<bool>()?;
        n = ok.iter().take_while(|&&a| a).count();
    }
    let row = target.slice_axis(0, n, n + 1)?;
    let from = if n < k {
        // residual max(p - q, 0), renormalised by the draw; p itself if it is all zero
        // (p == q: a rejection then has probability 0, so this only guards rounding)
        let res = row
            .exp()?
            .sub(&draft.slice_axis(0, n, n + 1)?.exp()?)?
            .maximum(&Array::scalar(0.0f32))?;
        let total = res.sum(&[-1], true)?;
        where_(&total.gt(&Array::scalar(0.0f32))?, &res.log()?, &row)?
    } else {
        row.clone()
    };
    let next = categorical(&from, -1, &draw()?)?
        .astype(DType::U32)?
        .reshape(&[1])?;
    let lp = row.reshape(&[-1])?.take(&next, 0)?;
    mlx_array::eval(&[&next, &lp])?;
    let (id, logprob) = (next.to_vec::<u32>()?[0], lp.to_vec::<f32>()?[0]);
    let mut tokens: Vec<Token> = drafts[..n]
        .iter()
        .zip(&p_d)
        .map(|(&id, &logprob)| Token { id, logprob })
        .collect();
    tokens.push(Token { id, logprob });
    Ok(Verdict {
        accepted: n,
        tokens,
    })
}
