//! Naive host references shared by the tests.
#![allow(dead_code)]
use mlx_array::Array;

pub fn arr(rows: &[Vec<f32>]) -> Array {
    let v = rows[0].len();
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    Array::from_slice(&flat, &[rows.len(), v]).unwrap()
}

pub fn rows(a: &Array) -> Vec<Vec<f32>> {
    let v = a.dim(-1).unwrap();
    a.to_vec_f32().unwrap().chunks(v).map(|c| c.to_vec()).collect()
}

/// f64 log-softmax of one row.
pub fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
    x.iter().map(|&v| v as f64 - m - s.ln()).collect()
}

/// Kept-token mask of the naive top-p: sort descending, keep while the mass strictly above a
/// token is < p; then also keep ties of the last kept value. Returns (mask, ambiguous) where
/// `ambiguous` flags cases where a boundary mass lies within `eps` of p (float-order noise).
pub fn naive_top_p(lp: &[f64], p: f64, eps: f64) -> (Vec<bool>, bool) {
    let mut idx: Vec<usize> = (0..lp.len()).collect();
    idx.sort_by(|&a, &b| lp[b].partial_cmp(&lp[a]).unwrap());
    let mut above = 0.0;
    let mut last = f64::INFINITY;
    let mut ambiguous = false;
    for &i in &idx {
        if (above - p).abs() < eps {
            ambiguous = true;
        }
        if above < p {
            last = lp[i];
        }
        above += lp[i].exp();
    }
    (lp.iter().map(|&v| v >= last).collect(), ambiguous)
}

/// Naive penalties (mlx-lm order): bias, repetition, presence, frequency.
pub fn naive_penalties(x: &[f32], hist: &[u32], cfg: &sampling::SamplingConfig) -> Vec<f32> {
    let mut y = x.to_vec();
    for (&t, &b) in &cfg.logit_bias {
        y[t as usize] += b;
    }
    let win = |n: usize| &hist[hist.len().saturating_sub(n)..];
    if cfg.repetition_penalty != 1.0 {
        let mut seen = std::collections::BTreeSet::new();
        for &t in win(cfg.repetition_context_size) {
            seen.insert(t);
        }
        for t in seen {
            let v = y[t as usize];
            y[t as usize] = if v < 0.0 { v * cfg.repetition_penalty } else { v / cfg.repetition_penalty };
        }
    }
    let mut present = std::collections::BTreeSet::new();
    for &t in win(cfg.presence_context_size) {
        present.insert(t);
    }
    let mut counts = std::collections::BTreeMap::new();
    for &t in win(cfg.frequency_context_size) {
        *counts.entry(t).or_insert(0u32) += 1;
    }
    for (i, v) in y.iter_mut().enumerate() {
        let t = i as u32;
        let pres = if present.contains(&t) { cfg.presence_penalty } else { 0.0 };
        let freq = cfg.frequency_penalty * *counts.get(&t).unwrap_or(&0) as f32;
        *v -= pres + freq;
    }
    y
}
