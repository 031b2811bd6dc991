//! Fixtures and references shared by the speculative tests.
#![allow(dead_code)]
use mlx_array::Array;
use mlx_models::{
    generate, load_model, Cache, GenerateConfig, KvCacheMode, LoadOptions, Logits, Model,
    PagedConfig, SpeculativeStats, Speculator,
};
use mlx_speculative::SpeculativeDecoder;
use sampling::{Sampler, SamplingConfig};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures/tiny")
        .join(name)
}

pub fn load(name: &str, kv: KvCacheMode) -> Model {
    load_dir(&fixture(name), kv)
}

pub fn load_dir(dir: &Path, kv: KvCacheMode) -> Model {
    load_model(
        dir,
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

/// `n` tokens with `sampling` and no stop tokens.
pub fn gen_cfg(n: usize, sampling: SamplingConfig) -> GenerateConfig {
    GenerateConfig {
        max_new_tokens: n,
        sampling,
        stop_tokens: Some(vec![]),
        ..Default::default()
    }
}

/// Plain greedy decoding through `generate` (no stop tokens).
pub fn plain_greedy(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache();
    generate(m, &mut cache, prompt, gen_cfg(n, SamplingConfig::greedy()))
        .unwrap()
        .map(|t| t.unwrap().id)
        .collect()
}

/// `generate` with `spec` on a fresh cache: the tokens, the speculative counters and the cache
/// offset at the end.
pub fn run_spec(
    target: &Model,
    spec: &mut SpeculativeDecoder,
    prompt: &[u32],
    cfg: GenerateConfig,
) -> (Vec<u32>, SpeculativeStats, usize) {
    let mut cache = target.new_cache();
    let mut gen = generate(target, &mut cache, prompt, cfg)
        .unwrap()
        .with_speculator(spec);
    let toks: Vec<u32> = (&mut gen).map(|t| t.unwrap().id).collect();
    let stats = gen.performance().speculative.unwrap();
    drop(gen);
    (toks, stats, cache.offset())
}

/// [`run_spec`] greedy over `n` tokens, checked token for token against plain greedy decoding
/// (`want`) and for the cache it leaves; returns the counters.
pub fn check_identity(
    target: &Model,
    spec: &mut SpeculativeDecoder,
    prompt: &[u32],
    want: &[u32],
    label: &str,
) -> SpeculativeStats {
    let (got, st, offset) = run_spec(
        target,
        spec,
        prompt,
        gen_cfg(want.len(), SamplingConfig::greedy()),
    );
    assert_eq!(got, want, "{label}");
    assert_eq!(
        offset,
        prompt.len() + want.len(),
        "{label}: the cache holds the prompt and every token"
    );
    assert!(st.cycles > 0, "{label}: no speculative cycles");
    // every token after the first (the prefill's) comes from a cycle
    let from_cycles = st.tokens_per_cycle * st.cycles as f64;
    assert!((from_cycles - (want.len() - 1) as f64).abs() < 1e-6, "{label}: {from_cycles} tokens from {} cycles", st.cycles);
    eprintln!("{label}: {st:?}");
    st
}

/// [`check_identity`] with a drafter from `make` at each of `depths`: the positions the target
/// ran for each drafter beyond the verifier's (see `Drafter::target_positions_run`).
pub fn identity_at_depths(
    target: &Model,
    prompt: &[u32],
    want: &[u32],
    depths: &[Option<usize>],
    label: &str,
    make: impl Fn() -> Box<dyn mlx_speculative::Drafter>,
) -> Vec<usize> {
    depths
        .iter()
        .map(|&depth| {
            let mut spec = SpeculativeDecoder::new(make(), depth);
            check_identity(
                target,
                &mut spec,
                prompt,
                want,
                &format!("{label} depth {depth:?}"),
            );
            spec.drafter().target_positions_run()
        })
        .collect()
}

/// The sampler settings of the chi-square tests: `temperature`, top-k 6, repetition penalty
/// 1.5, presence penalty 0.5, seeded.
pub fn penalised(temperature: f32, seed: u64) -> SamplingConfig {
    SamplingConfig::default()
        .with_temperature(temperature)
        .with_top_k(6)
        .with_repetition_penalty(1.5)
        .with_presence_penalty(0.5)
        .with_seed(seed)
}

/// [`check_speculative_sampling`] at temperature 1 for drafters from `make` that disagree with
/// the target, whose first-token distribution is a fresh drafter's proposal after `history`.
pub fn check_disagreeing_drafter(
    label: &str,
    target: &Model,
    history: &[u32],
    seed: u64,
    n: usize,
    make: impl Fn() -> Box<dyn mlx_speculative::Drafter>,
) {
    let cfg = penalised(1.0, seed);
    let q0 = probs(&make().propose(history, 1, &cfg).unwrap().logprobs.unwrap());
    let spec = SpeculativeDecoder::new(make(), Some(3));
    check_speculative_sampling(label, target, spec, history, &cfg, n, &q0, false);
}

/// The tensors of a safetensors file, by name.
pub fn tensors(path: &Path) -> HashMap<String, Array> {
    mlx_array::io::load_safetensors(path, None)
        .unwrap()
        .into_iter()
        .collect()
}

/// max |a - b| / max |b|
pub fn rel(a: &Array, b: &Array) -> f32 {
    let (a, b) = (
        a.reshape(&[-1])
            .unwrap()
            .astype(mlx_array::DType::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        b.reshape(&[-1])
            .unwrap()
            .astype(mlx_array::DType::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
    );
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    d / b.iter().map(|y| y.abs()).fold(0f32, f32::max)
}

/// Integer ids of an i32 array.
pub fn ids(a: &Array) -> Vec<u32> {
    a.astype(mlx_array::DType::U32)
        .unwrap()
        .to_vec::<u32>()
        .unwrap()
}

/// A cache holding `target`'s run over all of `history` but its last token (where a
/// speculative cycle starts).
pub fn prefilled(target: &Model, history: &[u32]) -> Cache {
    let mut cache = target.new_cache();
    let before = &history[..history.len() - 1];
    target
        .forward(
            &Array::from_slice(before, &[1, before.len()]).unwrap(),
            &mut cache,
            Logits::None,
            false,
        )
        .unwrap();
    cache
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
    /// `n` token ids below `vocab`.
    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab) as u32).collect()
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

/// [`gapped_prompt`] for `n` steps and plain greedy decoding's `n` tokens after it: the
/// identity tests' prompt and expected output, over the same length.
pub fn gapped_greedy(m: &Model, rng: &mut Rng, len: usize, n: usize) -> (Vec<u32>, Vec<u32>) {
    let prompt = gapped_prompt(m, rng, len, n);
    let want = plain_greedy(m, &prompt, n);
    (prompt, want)
}

/// Upper 0.001 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty).
pub fn critical(df: usize) -> f64 {
    let d = df as f64;
    let h = 2.0 / (9.0 * d);
    d * (1.0 - h + 3.0902 * h.sqrt()).powi(3)
}

/// Pearson's statistic of `counts` against probabilities `probs` (bins with an expected count
/// below 5 pooled into one, tokens outside the support in the pool), and its degrees of freedom.
pub fn chi_square(
    counts: &BTreeMap<Vec<u32>, usize>,
    probs: &BTreeMap<Vec<u32>, f64>,
) -> (f64, usize) {
    let n: usize = counts.values().sum();
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut pool_obs, mut pool_exp) = (0.0, 0.0);
    for (k, &p) in probs {
        let e = p * n as f64;
        let o = *counts.get(k).unwrap_or(&0) as f64;
        if e < 5.0 {
            pool_obs += o;
            pool_exp += e;
        } else {
            stat += (o - e) * (o - e) / e;
            bins += 1;
        }
    }
    let outside: usize = counts
        .iter()
        .filter(|(k, _)| !probs.contains_key(*k))
        .map(|(_, &c)| c)
        .sum();
    pool_obs += outside as f64;
    if pool_exp > 0.0 {
        stat += (pool_obs - pool_exp) * (pool_obs - pool_exp) / pool_exp;
        bins += 1;
    } else if outside > 0 {
        return (f64::INFINITY, bins.max(2) - 1); // tokens outside the distribution's support
    }
    (stat, bins - 1)
}

/// Probabilities of normalised log-probs.
pub fn probs(lp: &Array) -> Vec<f64> {
    lp.reshape(&[-1])
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|&x| (x as f64).exp())
        .collect()
}

/// The single tokens with positive probability in `p`, as chi-square bins.
pub fn support(p: &[f64]) -> BTreeMap<Vec<u32>, f64> {
    p.iter()
        .enumerate()
        .filter(|(_, &x)| x > 0.0)
        .map(|(i, &x)| (vec![i as u32], x))
        .collect()
}

/// `m`'s processed next-token distribution after `h` under `sampler`.
pub fn dist_after(m: &Model, sampler: &Sampler, h: &[u32]) -> Vec<f64> {
    let mut c = m.new_cache();
    let l = m
        .forward(
            &Array::from_slice(h, &[1, h.len()]).unwrap(),
            &mut c,
            Logits::Last,
            false,
        )
        .unwrap()
        .logits
        .unwrap()
        .reshape(&[1, -1])
        .unwrap();
    probs(&sampler.distribution(&l, &[h]).unwrap())
}

/// Checks that speculative sampling with `spec` draws the two tokens after `history` from the
/// target's exact joint `p(t0) p(t1 | t0)` under `cfg` (chi-square at p = 0.001 over `n` cycles
/// from the same history: each cycle rolls the cache back), that the draft agrees with the
/// target as `agrees` says (every position accepted more than half the time, or the first less
/// than half), and, for a draft that disagrees, that the test has power: the draft's own
/// first-token distribution `draft_first` is rejected.
#[allow(clippy::too_many_arguments)]
pub fn check_speculative_sampling(
    label: &str,
    target: &Model,
    mut spec: SpeculativeDecoder,
    history: &[u32],
    cfg: &SamplingConfig,
    n: usize,
    draft_first: &[f64],
    agrees: bool,
) {
    let sampler = Sampler::new(cfg.clone()).unwrap();
    let mut joint = BTreeMap::new();
    for (t0, &a) in dist_after(target, &sampler, history)
        .iter()
        .enumerate()
        .filter(|(_, &a)| a > 0.0)
    {
        let h: Vec<u32> = history.iter().copied().chain([t0 as u32]).collect();
        for (t1, &b) in dist_after(target, &sampler, &h)
            .iter()
            .enumerate()
            .filter(|(_, &b)| b > 0.0)
        {
            joint.insert(vec![t0 as u32, t1 as u32], a * b);
        }
    }
    spec.start();
    let mut cache = prefilled(target, history);
    let mut sampler = Sampler::new(cfg.clone()).unwrap();
    let mut counts = BTreeMap::new();
    let clock = std::time::Instant::now();
    for _ in 0..n {
        let mut toks: Vec<u32> = spec
            .cycle(target, &mut cache, history, &mut sampler, 8)
            .unwrap()
            .iter()
            .map(|t| t.id)
            .collect();
        if toks.len() == 1 {
            let h: Vec<u32> = history.iter().chain(&toks).copied().collect();
            toks.push(spec.cycle(target, &mut cache, &h, &mut sampler, 8).unwrap()[0].id);
        }
        *counts.entry(toks[..2].to_vec()).or_insert(0) += 1;
    }
    let st = spec.stats();
    let (s, df) = chi_square(&counts, &joint);
    eprintln!(
        "{label}: joint of 2 tokens chi2 {s:.1}, df {df}, critical {:.1}; {n} samples in {:.1} s; {st:?}",
        critical(df),
        clock.elapsed().as_secs_f64()
    );
    if agrees {
        assert!(
            st.acceptance_by_position.iter().all(|&a| a > 0.5),
            "{label}: the draft mostly agrees: {st:?}"
        );
    } else {
        assert!(
            st.acceptance_by_position[0] < 0.5,
            "{label}: the draft must disagree often: {st:?}"
        );
    }
    assert!(
        s < critical(df),
        "{label}: chi2 {s} >= {} with {df} degrees of freedom",
        critical(df)
    );
    let first = counts.iter().fold(BTreeMap::new(), |mut m, (k, &c)| {
        *m.entry(vec![k[0]]).or_insert(0usize) += c;
        m
    });
    let (sq, dfq) = chi_square(&first, &support(draft_first));
    eprintln!("  against the draft's first-token distribution: chi2 {sq:.1}, df {dfq}");
    if !agrees {
        assert!(
            sq > critical(dfq),
            "{label}: the test has no power: the draft's distribution passes too"
        );
    }
}
