//! f32 matmul throughput (GFLOP/s, reported by criterion as "elem/s" = FLOP/s) at LLM shapes, and
//! matvec bandwidth (GB/s over the weight matrix) in f32 and bf16.
//!
//! `cargo bench -p mlx-array --bench matmul -- --warm-up-time 1 --measurement-time 3`
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mlx_array::random::{self, Key};
use mlx_array::{Array, DType};

fn input(shape: &[usize], dtype: DType, seed: u64) -> Array {
    let a = random::normal(shape, DType::F32, &Key::new(seed).unwrap()).unwrap().astype(dtype).unwrap();
    a.eval().unwrap();
    a
}

fn matmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("matmul_f32");
    g.sample_size(10);
    for &(m, k, n) in &[(128, 1024, 3072), (512, 1024, 1024), (1024, 1024, 1024), (2048, 2048, 2048)] {
        let (a, b) = (input(&[m, k], DType::F32, 1), input(&[k, n], DType::F32, 2));
        g.throughput(Throughput::Elements(2 * (m * k * n) as u64));
        g.bench_function(BenchmarkId::from_parameter(format!("{m}x{k}x{n}")), |bch| {
            bch.iter(|| a.matmul(&b).unwrap().eval().unwrap())
        });
    }
    g.finish();
}

fn matvec(c: &mut Criterion) {
    let mut g = c.benchmark_group("matvec");
    g.sample_size(20);
    for &dtype in &[DType::F32, DType::BF16] {
        for &(k, n) in &[(1024, 3072), (4096, 4096)] {
            let (x, w) = (input(&[1, k], dtype, 3), input(&[k, n], dtype, 4));
            g.throughput(Throughput::BytesDecimal((k * n * dtype.size()) as u64));
            g.bench_function(BenchmarkId::new(dtype.to_string(), format!("1x{k}x{n}")), |bch| {
                bch.iter(|| x.matmul(&w).unwrap().eval().unwrap())
            });
        }
    }
    g.finish();
}

criterion_group!(benches, matmul, matvec);
criterion_main!(benches);
