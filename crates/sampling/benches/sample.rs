//! One sampling step at the Qwen3 vocabulary (V = 151936, B = 1): greedy, and temperature 0.7
//! with top-p 0.9 and repetition (1.1, window 256), presence (0.5, 20) and frequency (0.3, 20)
//! penalties over a 256-token history. Same logits, history and settings as
//! `benches/mlx_lm_sampler.py` (figures in BENCHMARKS.md, "Sampling step").
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use mlx_array::Array;
use sampling::{Sampler, SamplingConfig};

const V: usize = 151936;

/// The logits of the python script: an LCG, top 24 bits of the state scaled to [-4, 4).
fn logits() -> Vec<f32> {
    let mut s: u64 = 0x5eed;
    (0..V)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f64 / (1u64 << 24) as f64 * 8.0 - 4.0) as f32
        })
        .collect()
}

fn history() -> Vec<u32> {
    (0..256u64).map(|i| ((i * 7919) % V as u64) as u32).collect()
}

fn bench(c: &mut Criterion) {
    let x = logits();
    let hist = history();
    let fresh = || {
        let a = Array::from_slice(&x, &[1, V]).unwrap();
        a.eval().unwrap();
        a
    };
    let penalised = SamplingConfig::default()
        .with_temperature(0.7)
        .with_top_p(0.9)
        .with_repetition_penalty(1.1)
        .with_repetition_context_size(256)
        .with_presence_penalty(0.5)
        .with_presence_context_size(20)
        .with_frequency_penalty(0.3)
        .with_frequency_context_size(20)
        .with_seed(0);
    let mut g = c.benchmark_group("sample_step_v151936");
    g.sample_size(50);
    for (name, cfg) in [("greedy", SamplingConfig::greedy().with_seed(0)), ("top_p_penalties", penalised)] {
        let mut s = Sampler::new(cfg).unwrap();
        g.bench_function(name, |b| {
            b.iter_batched(
                fresh,
                |a| {
                    let out = s.sample(&a, &[&hist]).unwrap();
                    out.eval().unwrap();
                    out
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
