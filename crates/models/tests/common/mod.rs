//! Helpers shared by the parity tests: fixture paths, reference loading, tolerances.
#![allow(dead_code)]
use mlx_array::{Array, DType};
use mlx_models::{Cache, Logits, Model};
use std::collections::HashMap;
use std::path::PathBuf;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny").join(name)
}

pub fn reference(name: &str) -> HashMap<String, Array> {
    mlx_array::io::load_safetensors(fixture(name).join("reference.safetensors"), Some(DType::F32)).unwrap()
}

pub fn ids(a: &Array) -> Vec<u32> {
    a.astype(DType::I64).unwrap().to_vec::<i64>().unwrap().into_iter().map(|x| x as u32).collect()
}

/// max |a - b| / max |b|: the relative error the parity tests bound by 1e-3.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in row.iter().enumerate() {
        if *x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Prefill `prompt`, then `steps` greedy tokens through the cache; returns (tokens, per-step logits).
pub fn greedy_cached(model: &Model, cache: &mut Cache, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let t = Array::from_slice(prompt, &[1, prompt.len()]).unwrap();
    let mut logits = model.forward(&t, cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
    let (mut out, mut all) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let next = argmax(&logits);
        out.push(next);
        all.push(logits.clone());
        let t = Array::from_slice(&[next], &[1, 1]).unwrap();
        logits = model.forward(&t, cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
    }
    (out, all)
}

/// Full-sequence logits `[L, V]` without a cache carried over.
pub fn full_logits(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let t = Array::from_slice(tokens, &[1, tokens.len()]).unwrap();
    let l = model.forward(&t, &mut cache, Logits::All, false).unwrap().logits.unwrap();
    let v = *l.shape().last().unwrap();
    l.to_vec::<f32>().unwrap().chunks(v).map(|c| c.to_vec()).collect()
}
