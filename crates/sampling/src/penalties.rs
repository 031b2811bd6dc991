//! Logit bias, repetition penalty, presence and frequency penalties, on `[B, V]` logits.
//!
//! The per-row windows are small (hundreds of tokens), so the host works out which token ids
//! each row touches and how; the device then gathers those logits, transforms them and
//! scatters them back in one `take_along_axis` / `put_along_axis` pair. The order is mlx-lm's
//! (`make_logits_processors`): bias, then repetition penalty, then presence, then frequency.
use crate::config::SamplingConfig;
use crate::error::{Result, SamplingError};
use mlx_array::{ops::where_, Array};
use std::collections::BTreeMap;

/// What happens to one token id of one row.
#[derive(Clone, Copy, Default)]
struct Touch {
    bias: f32,
    repeat: bool,
    present: bool,
    count: u32,
}

fn window(h: &[u32], n: usize) -> &[u32] {
    &h[h.len().saturating_sub(n)..]
}

/// The host-side plan: for each row, the touched ids and their parameters, padded to one width.
struct Plan {
    ids: Vec<i32>,
    bias: Vec<f32>,
    repeat: Vec<bool>,
    sub: Vec<f32>,
    width: usize,
    any_bias: bool,
    any_repeat: bool,
    any_sub: bool,
}

fn plan(cfg: &SamplingConfig, history: &[&[u32]], rows: usize, vocab: usize) -> Result<Option<Plan>> {
    let rep = cfg.repetition_penalty != 1.0;
    let pres = cfg.presence_penalty != 0.0;
    let freq = cfg.frequency_penalty != 0.0;
    let mut per_row: Vec<BTreeMap<u32, Touch>> = Vec::with_capacity(rows);
    for r in 0..rows {
        let h: &[u32] = history.get(r).copied().unwrap_or(&[]);
        let mut m: BTreeMap<u32, Touch> = BTreeMap::new();
        for (&t, &b) in &cfg.logit_bias {
            m.entry(t).or_default().bias += b;
        }
        if rep {
            for &t in window(h, cfg.repetition_context_size) {
                m.entry(t).or_default().repeat = true;
            }
        }
        if pres {
            for &t in window(h, cfg.presence_context_size) {
                m.entry(t).or_default().present = true;
            }
        }
        if freq {
            for &t in window(h, cfg.frequency_context_size) {
                m.entry(t).or_default().count += 1;
            }
        }
        if let Some(&t) = m.keys().next_back().filter(|&&t| t as usize >= vocab) {
            return Err(SamplingError::TokenOutOfRange { token: t, vocab });
        }
        per_row.push(m);
    }
    let width = per_row.iter().map(|m| m.len()).max().unwrap_or(0);
    if width == 0 {
        return Ok(None);
    }
    let n = rows * width;
    let mut p = Plan {
        ids: Vec::with_capacity(n),
        bias: Vec::with_capacity(n),
        repeat: Vec::with_capacity(n),
        sub: Vec::with_capacity(n),
        width,
        any_bias: false,
        any_repeat: false,
        any_sub: false,
    };
    for m in &per_row {
        // Pad with copies of the row's first entry: a duplicate index then writes the same value
        // twice. A row with no entries pads with token 0 and neutral parameters.
        let first = m.iter().next().map(|(&t, &x)| (t, x)).unwrap_or((0, Touch::default()));
        for (t, x) in m.iter().map(|(&t, &x)| (t, x)).chain(std::iter::repeat(first)).take(width) {
            let sub = cfg.presence_penalty * f32::from(u8::from(x.present)) + cfg.frequency_penalty * x.count as f32;
            p.any_bias |= x.bias != 0.0;
            p.any_repeat |= x.repeat;
            p.any_sub |= sub != 0.0;
            p.ids.push(t as i32);
            p.bias.push(x.bias);
            p.repeat.push(x.repeat);
            p.sub.push(sub);
        }
    }
    Ok(Some(p))
}

/// Apply logit bias and the three penalties to f32 logits `[B, V]`; `history[r]` is row `r`'s
/// token history (prompt and generated, oldest first); an empty `history` means no row has one.
pub fn apply_penalties(logits: &Array, history: &[&[u32]], cfg: &SamplingConfig) -> Result<Array> {
    let (rows, vocab) = rows_vocab(logits)?;
    if !history.is_empty() && history.len() != rows {
        return Err(SamplingError::Shape(format!("{} history rows for {rows} logit rows", history.len())));
    }
    let Some(p) = plan(cfg, history, rows, vocab)? else {
        return Ok(logits.clone());
    };
    let shape = [rows, p.width];
    let idx = Array::from_slice(&p.ids, &shape)?;
    let mut x = logits.take_along_axis(&idx, -1)?;
    if p.any_bias {
        x = x.add(&Array::from_slice(&p.bias, &shape)?)?;
    }
    if p.any_repeat {
        let pen = cfg.repetition_penalty;
        let neg = x.lt(&Array::scalar(0.0f32))?;
        let penalised = where_(&neg, &x.mul_scalar(pen)?, &x.div(&Array::scalar(pen))?)?;
        x = where_(&Array::from_slice(&p.repeat, &shape)?, &penalised, &x)?;
    }
    if p.any_sub {
        x = x.sub(&Array::from_slice(&p.sub, &shape)?)?;
    }
    Ok(logits.put_along_axis(&idx, &x, -1)?)
}

/// `(B, V)` of a 2-d logits array.
pub(crate) fn rows_vocab(logits: &Array) -> Result<(usize, usize)> {
    match logits.shape()[..] {
        [b, v] if b > 0 && v > 0 => Ok((b, v)),
        ref s => Err(SamplingError::Shape(format!("logits must be [batch, vocab] with both > 0, got {s:?}"))),
    }
}
