//! Allocator ops/s, longest-prefix lookup on a 32k-token prompt, and K/V gather throughput for
//! a Qwen3-0.6B-sized layer (8 kv heads, head dim 128, f32).
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kv_paged::{Attention, BlockAllocator, ExtraKeys, KvCacheManager, KvConfig, KvLayout, KvPool, KvLayerKind, LayerSpec};
use mlx_array::DType;

fn alloc_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("allocator");
    g.throughput(Throughput::Elements(2 * 1024));
    g.bench_function("allocate+release 1024 blocks", |b| {
        let mut a = BlockAllocator::new(4096, 16, 0).unwrap();
        b.iter(|| {
            let ids: Vec<_> = (0..1024).map(|_| a.allocate().unwrap()).collect();
            for id in ids.into_iter().rev() {
                a.release(id).unwrap();
            }
        })
    });
    g.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    let prompt: Vec<u32> = (0..32_768u32).map(|i| i.wrapping_mul(2_654_435_761) % 151_936).collect();
    let mut g = c.benchmark_group("prefix");
    g.throughput(Throughput::Elements(prompt.len() as u64));
    // A cache that holds the whole prompt: begin finds 2047 cached blocks (all but the last).
    let mut m = KvCacheManager::with_groups(16, 0, &[(Attention::Full, 4096)]).unwrap();
    let s = m.begin(&prompt, ExtraKeys::none()).unwrap();
    m.step(s.seq, usize::MAX).unwrap();
    m.finish(s.seq).unwrap();
    g.bench_function("begin+finish 32k-token prompt, all cached", |b| {
        b.iter(|| {
            let s = m.begin(&prompt, ExtraKeys::none()).unwrap();
            assert_eq!(s.cached_tokens, 32_752);
            m.finish(s.seq).unwrap();
        })
    });
    g.bench_function("block_keys 32k tokens (hashing only)", |b| {
        b.iter(|| kv_paged::block_keys(&prompt, 16, 0, &ExtraKeys::none()))
    });
    g.finish();
}

fn gather(c: &mut Criterion) {
    let spec = LayerSpec { kind: KvLayerKind::Full, kv_heads: 8, head_dim: 128 };
    let mut g = c.benchmark_group("gather");
    for ctx in [1024usize, 8192] {
        let cfg = KvConfig { block_size: 16, budget_mb: 200.0, dtype_bytes: 4, ..Default::default() };
        let layout = KvLayout::new(vec![spec], cfg).unwrap();
        let mut m = KvCacheManager::new(&layout).unwrap();
        let mut pool = KvPool::new(&layout, DType::F32).unwrap();
        let s = m.begin(&(0..ctx as u32).collect::<Vec<_>>(), ExtraKeys::none()).unwrap();
        let step = m.step(s.seq, usize::MAX).unwrap();
        let batch = pool.batch(&[&step]).unwrap();
        let kv = mlx_array::Array::ones(&[1, 8, ctx, 128], DType::F32).unwrap();
        pool.write(0, &batch, &kv, &kv).unwrap();
        pool.eval().unwrap();
        // K and V, read once and written once each.
        let bytes = 2 * ctx * 8 * 128 * 4;
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(format!("read K+V ctx {ctx} (Qwen3-0.6B layer, f32)"), |b| {
            b.iter_batched(
                || (),
                |_| {
                    let (k, v) = pool.read(0, &batch).unwrap();
                    mlx_array::eval(&[&k, &v]).unwrap();
                },
                BatchSize::SmallInput,
            )
        });
        g.bench_function(format!("write 1 token + read K+V ctx {ctx}"), |b| {
            b.iter(|| {
                let one = mlx_array::Array::ones(&[1, 8, 1, 128], DType::F32).unwrap();
                let dec = kv_paged::Step { seq: step.seq, start: ctx - 1, len: 1, groups: vec![kv_paged::GroupStep {
                    slot_mapping: vec![*step.groups[0].kv_slots().last().unwrap()],
                    ..step.groups[0].clone()
                }] };
                let bb = pool.batch(&[&dec]).unwrap();
                pool.write(0, &bb, &one, &one).unwrap();
                let (k, v) = pool.read(0, &bb).unwrap();
                mlx_array::eval(&[&k, &v]).unwrap();
            })
        });
    }
    g.finish();
}

/// A 512-token prefill's rows into one Qwen3-0.6B-sized layer (f32): consecutive slots (one
/// run), and the same rows over every other block (32 runs of 16, a fragmented free list).
fn write_prefill(c: &mut Criterion) {
    let spec = LayerSpec { kind: KvLayerKind::Full, kv_heads: 8, head_dim: 128 };
    let cfg = KvConfig { block_size: 16, budget_mb: 200.0, dtype_bytes: 4, initial_blocks: None, ..Default::default() };
    let layout = KvLayout::new(vec![spec], cfg).unwrap();
    let mut pool = KvPool::new(&layout, DType::F32).unwrap();
    pool.eval().unwrap();
    let n = 512usize;
    let kv = mlx_array::Array::ones(&[1, 8, n, 128], DType::F32).unwrap();
    kv.eval().unwrap();
    let mut g = c.benchmark_group("write");
    g.throughput(Throughput::Bytes((2 * n * 8 * 128 * 4) as u64));
    let runs: Vec<u32> = (0..n as u32).collect();
    let fragmented: Vec<u32> = (0..n as u32).map(|i| (i / 16) * 32 + i % 16).collect();
    for (name, slots) in [("1 run", runs), ("32 runs", fragmented)] {
        g.bench_function(format!("512 rows, {name}"), |b| {
            b.iter(|| {
                pool.write_rows(0, &slots, &kv, &kv).unwrap();
                pool.eval().unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, alloc_free, prefix_lookup, gather, write_prefill);
criterion_main!(benches);
