//! Attention over K/V read back from the pool equals attention over the same K/V kept
//! contiguous: random data, several block sizes, lengths that are not block multiples, chunked
//! prefill then decode, full + sliding-window + KV-shared layers, batches with padding masks,
//! prefix hits and fork copy-on-write.
use kv_paged::{ExtraKeys, KvCacheManager, KvConfig, KvLayout, KvPool, KvLayerKind, LayerSpec, Step};
use mlx_array::{Array, AttentionMask, DType};

const WINDOW: usize = 6;
const HQ: usize = 4;

struct Rng(u64);
impl Rng {
    fn data(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }
    fn array(&mut self, shape: &[usize]) -> Array {
        Array::from_slice(&self.data(shape.iter().product()), shape).unwrap()
    }
}

fn layers() -> Vec<LayerSpec> {
    vec![
        LayerSpec { kind: KvLayerKind::Full, kv_heads: 2, head_dim: 8 },
        LayerSpec { kind: KvLayerKind::Sliding { window: WINDOW }, kv_heads: 1, head_dim: 16 },
        LayerSpec { kind: KvLayerKind::Shared { anchor: 0 }, kv_heads: 2, head_dim: 8 },
    ]
}

/// Storage starts at 2 blocks per group and grows as steps need more (see `setup_with`).
fn setup(block_size: usize) -> (KvLayout, KvCacheManager, KvPool) {
    setup_with(block_size, Some(2))
}

fn setup_with(block_size: usize, initial_blocks: Option<usize>) -> (KvLayout, KvCacheManager, KvPool) {
    let cfg = KvConfig { block_size, budget_mb: 10.0, dtype_bytes: 4, max_seqs: 4, max_step_tokens: 8, rollback_tokens: 2, initial_blocks };
    let layout = KvLayout::new(layers(), cfg).unwrap().with_blocks(&[64 / block_size + 40, 40]).unwrap();
    let m = KvCacheManager::new(&layout).unwrap();
    let pool = KvPool::new(&layout, DType::F32).unwrap();
    (layout, m, pool)
}

/// Contiguous per-layer K and V of a sequence: `[1, kv_heads, len, head_dim]`.
fn contiguous(rng: &mut Rng, len: usize) -> Vec<(Array, Array)> {
    layers().iter().map(|l| (rng.array(&[1, l.kv_heads, len, l.head_dim]), rng.array(&[1, l.kv_heads, len, l.head_dim]))).collect()
}

fn close(a: &Array, b: &Array, what: &str) {
    assert_eq!(a.shape(), b.shape(), "{what}");
    let (x, y) = (a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap());
    let err = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max);
    assert!(err < 1e-5, "{what}: max abs error {err}");
}

/// Write the step's K/V for the own layers, then compare every layer's attention with the
/// contiguous reference.
fn write_and_check(pool: &mut KvPool, step: &Step, kv: &[(Array, Array)], rng: &mut Rng, what: &str) {
    let batch = pool.batch(&[step]).unwrap();
    let (s, e) = (step.start, step.start + step.len);
    for (layer, (k, v)) in kv.iter().enumerate() {
        if layer != 2 {
            pool.write(layer, &batch, &k.slice_axis(2, s, e).unwrap(), &v.slice_axis(2, s, e).unwrap()).unwrap();
        } else {
            assert!(pool.write(layer, &batch, k, v).is_err(), "shared layers do not write");
        }
    }
    pool.eval().unwrap();
    for layer in 0..kv.len() {
        // The shared layer reads its anchor's K/V.
        let (k, v) = &kv[if layer == 2 { 0 } else { layer }];
        let hd = layers()[layer].head_dim;
        let q = rng.array(&[1, HQ, step.len, hd]);
        let (pk, pv) = pool.read(layer, &batch).unwrap();
        let (rk, rv) = (k.slice_axis(2, 0, e).unwrap(), v.slice_axis(2, 0, e).unwrap());
        let (got, want) = if layer == 1 {
            (q.sdpa(&pk, &pv, 0.3, AttentionMask::SlidingWindow(WINDOW)), q.sdpa(&rk, &rv, 0.3, AttentionMask::SlidingWindow(WINDOW)))
        } else {
            (q.sdpa(&pk, &pv, 0.3, AttentionMask::Causal), q.sdpa(&rk, &rv, 0.3, AttentionMask::Causal))
        };
        close(&got.unwrap(), &want.unwrap(), &format!("{what} layer {layer} step at {s}+{}", step.len));
        if layer == 1 {
            assert!(pk.dim(2).unwrap() <= WINDOW - 1 + step.len, "sliding reads only the window");
        }
        // Any span of the keys read() returns, as positions: read_span gives the same rows.
        let kv_start = e - pk.dim(2).unwrap();
        for (a, b) in [(kv_start, e), (kv_start, s), (s, e), ((kv_start + e) / 2, e)] {
            let (sk, sv) = pool.read_span(layer, &batch, a, b).unwrap();
            close(&sk, &k.slice_axis(2, a, b).unwrap(), &format!("{what} layer {layer} read_span {a}..{b} keys"));
            close(&sv, &v.slice_axis(2, a, b).unwrap(), &format!("{what} layer {layer} read_span {a}..{b} values"));
        }
        assert!(pool.read_span(layer, &batch, kv_start, e + 1).is_err(), "span past the last key");
        if kv_start > 0 {
            assert!(pool.read_span(layer, &batch, kv_start - 1, e).is_err(), "span before the window");
        }
    }
}

/// Storage grown block by block or allocated up front: the same reads.
#[test]
fn paged_attention_matches_contiguous() {
    for (bs, len, initial) in [1usize, 3, 4, 16].into_iter().flat_map(|bs| [1usize, 5, 17, 37].map(|l| (bs, l))).flat_map(|(b, l)| [(b, l, Some(2)), (b, l, None)]) {
        {
            let mut rng = Rng(bs as u64 * 1000 + len as u64);
            let (layout, mut m, mut pool) = setup_with(bs, initial);
            let tokens: Vec<u32> = (0..len as u32).collect();
            let kv = contiguous(&mut rng, len);
            let prompt = (len / 2).max(1);
            let b = m.begin(&tokens[..prompt], ExtraKeys::none()).unwrap();
            // Chunked prefill (chunks of 7), then decode one token at a time.
            while m.num_scheduled(b.seq).unwrap() < prompt {
                let step = m.step(b.seq, 7).unwrap();
                write_and_check(&mut pool, &step, &kv, &mut rng, &format!("bs {bs} len {len} prefill"));
            }
            for t in prompt..len {
                m.append(b.seq, &tokens[t..t + 1]).unwrap();
                let step = m.step(b.seq, 1).unwrap();
                write_and_check(&mut pool, &step, &kv, &mut rng, &format!("bs {bs} len {len} decode"));
            }
            let full = layout.groups[0].num_blocks;
            let need = len.div_ceil(bs);
            let cap = pool.capacity(0).unwrap();
            match initial {
                None => assert_eq!(cap, full),
                Some(i) => assert!(cap >= need && cap <= (2 * need).max(i).min(full), "bs {bs} len {len}: capacity {cap} for {need} blocks"),
            }
            m.finish(b.seq).unwrap();
        }
    }
}

#[test]
fn prefix_hit_and_fork_read_the_same_kv() {
    for bs in [3usize, 4] {
        let mut rng = Rng(7 + bs as u64);
        let (_, mut m, mut pool) = setup(bs);
        let len = 23;
        let tokens: Vec<u32> = (0..len as u32).map(|i| i * 7 % 11).collect();
        let kv = contiguous(&mut rng, len);
        let a = m.begin(&tokens, ExtraKeys::none()).unwrap();
        let step = m.step(a.seq, 8).unwrap();
        write_and_check(&mut pool, &step, &kv, &mut rng, "a");
        let step = m.step(a.seq, 100).unwrap();
        write_and_check(&mut pool, &step, &kv, &mut rng, "a");
        // Fork with a partial last block: the copy-on-write must carry its K/V.
        let (c, copies) = m.fork(a.seq).unwrap();
        assert_eq!(copies.len(), 2, "one copy per group (23 is not a multiple of {bs})");
        pool.copy_blocks(&copies).unwrap();
        m.finish(a.seq).unwrap();
        // Same prompt again: the cached prefix's K/V are read back unchanged.
        let b = m.begin(&tokens, ExtraKeys::none()).unwrap();
        assert_eq!(b.cached_tokens, (len - 1) / bs * bs);
        let step = m.step(b.seq, 100).unwrap();
        write_and_check(&mut pool, &step, &kv, &mut rng, "prefix hit");
        // The fork continues with the same next token and sees the parent's K/V.
        let mut kv2 = contiguous(&mut rng, len + 1);
        for (l, (k, v)) in kv2.iter_mut().enumerate() {
            let tail = |x: &Array| x.slice_axis(2, len, len + 1).unwrap();
            *k = mlx_array::ops::concatenate(&[&kv[l].0, &tail(k)], 2).unwrap();
            *v = mlx_array::ops::concatenate(&[&kv[l].1, &tail(v)], 2).unwrap();
        }
        m.append(c, &[5]).unwrap();
        let step = m.step(c, 1).unwrap();
        write_and_check(&mut pool, &step, &kv2, &mut rng, "fork");
    }
}

#[test]
fn batched_decode_with_padding_mask() {
    let bs = 4;
    let mut rng = Rng(99);
    let (_, mut m, mut pool) = setup(bs);
    let lens = [9usize, 14, 3];
    let kvs: Vec<_> = lens.iter().map(|&l| contiguous(&mut rng, l + 1)).collect();
    let mut steps = Vec::new();
    for (i, &l) in lens.iter().enumerate() {
        let toks: Vec<u32> = (0..l as u32).map(|t| t + 100 * i as u32).collect();
        let b = m.begin(&toks, ExtraKeys::none()).unwrap();
        let step = m.step(b.seq, 100).unwrap();
        write_and_check(&mut pool, &step, &kvs[i], &mut rng, "prefill");
        m.append(b.seq, &[1]).unwrap();
        steps.push(m.step(b.seq, 1).unwrap());
    }
    let refs: Vec<&Step> = steps.iter().collect();
    let batch = pool.batch(&refs).unwrap();
    for layer in [0usize, 1] {
        let cat = |f: fn(&(Array, Array)) -> &Array, i: usize| f(&kvs[i][layer]).slice_axis(2, lens[i], lens[i] + 1).unwrap();
        let ks: Vec<Array> = (0..3).map(|i| cat(|p| &p.0, i)).collect();
        let vs: Vec<Array> = (0..3).map(|i| cat(|p| &p.1, i)).collect();
        let k = mlx_array::ops::concatenate(&ks.iter().collect::<Vec<_>>(), 0).unwrap();
        let v = mlx_array::ops::concatenate(&vs.iter().collect::<Vec<_>>(), 0).unwrap();
        pool.write(layer, &batch, &k, &v).unwrap();
    }
    for (layer, group) in [0usize, 1, 0].into_iter().enumerate() {
        let hd = layers()[layer].head_dim;
        let q = rng.array(&[3, HQ, 1, hd]);
        let (pk, pv) = pool.read(layer, &batch).unwrap();
        let mask = batch.mask(group).unwrap();
        let got = q.sdpa(&pk, &pv, 0.3, AttentionMask::Array(&mask)).unwrap();
        for i in 0..3 {
            let e = lens[i] + 1;
            let src = if layer == 2 { 0 } else { layer };
            let (rk, rv) = (kvs[i][src].0.slice_axis(2, 0, e).unwrap(), kvs[i][src].1.slice_axis(2, 0, e).unwrap());
            let qi = q.slice_axis(0, i, i + 1).unwrap();
            let mk = if layer == 1 { AttentionMask::SlidingWindow(WINDOW) } else { AttentionMask::Causal };
            let want = qi.sdpa(&rk, &rv, 0.3, mk).unwrap();
            close(&got.slice_axis(0, i, i + 1).unwrap(), &want, &format!("batched layer {layer} seq {i}"));
        }
    }
}

#[test]
fn bad_input_is_an_error() {
    let (_, mut m, mut pool) = setup(4);
    let b = m.begin(&[1, 2, 3], ExtraKeys::none()).unwrap();
    let step = m.step(b.seq, 10).unwrap();
    let batch = pool.batch(&[&step]).unwrap();
    let wrong = Array::zeros(&[1, 2, 4, 8], DType::F32).unwrap();
    assert!(pool.write(0, &batch, &wrong, &wrong).is_err(), "4 tokens for 3 slots");
    assert!(pool.write(7, &batch, &wrong, &wrong).is_err(), "no layer 7");
    assert!(pool.read(7, &batch).is_err());
    assert!(pool.read_span(7, &batch, 0, 1).is_err());
    assert!(pool.read_span(0, &batch, 2, 1).is_err(), "reversed span");
    assert!(pool.batch(&[]).is_err());
}

/// A step whose block table does not cover its keys, or names a block beyond the storage, is
/// refused with an error instead of reading out of range.
#[test]
fn batch_refuses_steps_with_bad_block_tables() {
    let (_, mut m, mut pool) = setup(4);
    let s = m.begin(&(0..10).collect::<Vec<u32>>(), ExtraKeys::none()).unwrap();
    let step = m.step(s.seq, 10).unwrap();
    assert!(pool.batch(&[&step]).is_ok());
    let mut short = step.clone();
    short.groups[0].block_table.pop();
    assert!(pool.batch(&[&short]).is_err(), "a block table one block short");
    let mut far = step.clone();
    far.groups[0].block_table[0] = 1_000_000;
    assert!(pool.batch(&[&far]).is_err(), "a block beyond any storage");
    let mut other = step;
    other.groups[0].block_size = 8;
    assert!(pool.batch(&[&other]).is_err(), "another block size");
}
