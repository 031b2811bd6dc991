//! Fixtures and references shared by the speculative tests.
#![allow(dead_code)]
use mlx_array::Array;
use mlx_models::{
    generate, load_model, GenerateConfig, KvCacheMode, LoadOptions, Logits, Model, PagedConfig,
};
use std::path::PathBuf;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures/tiny")
        .join(name)
}

pub fn load(name: &str, kv: KvCacheMode) -> Model {
    load_model(
        fixture(name),
        &LoadOptions {
            kv_cache: kv,
            ..Default::default()
        },
    )
    .unwrap()
    .into_lm()
    .unwrap()
}

pub fn paged(block_size: usize) -> KvCacheMode {
    KvCacheMode::Paged(PagedConfig {
        block_size,
        ..Default::default()
    })
}

/// Plain greedy decoding through `generate` (no stop tokens).
pub fn plain_greedy(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache();
    let cfg = GenerateConfig {
        max_new_tokens: n,
        sampling: sampling::SamplingConfig::greedy(),
        stop_tokens: Some(vec![]),
        ..Default::default()
    };
    generate(m, &mut cache, prompt, cfg)
        .unwrap()
        .map(|t| t.unwrap().id)
        .collect()
}

/// The smallest top-1/top-2 logit gap over `n` greedy steps after `prompt` (one token at a time).
pub fn min_gap(m: &Model, prompt: &[u32], n: usize) -> f32 {
    let mut cache = m.new_cache();
    let mut input = prompt.to_vec();
    let mut gap = f32::INFINITY;
    for _ in 0..n {
        let t = Array::from_slice(&input, &[1, input.len()]).unwrap();
        let l = m
            .forward(&t, &mut cache, Logits::Last, false)
            .unwrap()
            .logits
            .unwrap()
            .reshape(&[-1])
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let mut idx: Vec<usize> = (0..l.len()).collect();
        idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
        gap = gap.min(l[idx[0]] - l[idx[1]]);
        input = vec![idx[0] as u32];
    }
    gap
}

/// A small deterministic generator (splitmix64).
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
}

/// A random prompt of `len` tokens in `3..vocab` whose plain greedy run over `n` tokens keeps
/// every top-1/top-2 gap above 1e-4 (the identity property's precondition); prompts that do not
/// are replaced, never shortened.
pub fn gapped_prompt(m: &Model, rng: &mut Rng, len: usize, n: usize) -> Vec<u32> {
    let vocab = m.info().vocab_size;
    for _ in 0..20 {
        let p: Vec<u32> = (0..len).map(|_| 3 + rng.below(vocab - 3) as u32).collect();
        if min_gap(m, &p, n) > 1e-4 {
            return p;
        }
    }
    panic!("no prompt of {len} tokens keeps the top-1/top-2 gap above 1e-4 for {n} steps");
}
