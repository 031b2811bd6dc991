//! The CPU packed-weight kernels (`Array::cpu_matmul_bf16`, `Quantized::cpu_matmul`) against the
//! machine's measured read bandwidth and against MLX's own CPU products on the same bytes.
//!
//! `cargo bench -p mlx-array --bench packed_matmul`
//!
//! 1. Read bandwidth: the better of a multi-threaded sum over a buffer of 4x the last-level cache
//!    (the same thread count as the kernels) and the f32 BLAS product of the upcast weights (the
//!    f32 floor the kernels are meant to beat), measured again before each of a kernel's
//!    `ROUNDS` passes; a kernel's share is its best pass against the best bandwidth of its rounds.
//! 2. Matrix-vector products (M = 1) over `[N, 4096]` weights, enough distinct matrices to total
//!    at least 4x the last-level cache, used in turn so that no weight byte comes from cache:
//!    GB/s of weight bytes read (packed words, scales and biases) for ours, for MLX's
//!    `quantized_matmul` / bf16 matmul on the same bytes; and ours over one weight of about a
//!    quarter of the last-level cache, read again and again from cache ("in LLC"): the kernel's
//!    compute rate on these threads, the ceiling a DRAM pass cannot beat (the quantized kernels
//!    spend about one `vpdpbusd` per 10-20 weight bytes, so on two threads that share a core this
//!    ceiling can fall below the read bandwidth).
//! 3. Small M: time per product for M = 1..64 at `[8192, 2048]`, ours against the f32 BLAS product
//!    of the dequantized weight and MLX's quantized_matmul (where the packed path stops paying:
//!    `CPU_PACKED_MAX_ROWS`).
use mlx_array::ops::{cpu_kernels_isa, cpu_kernels_threads};
use mlx_array::random::{self, Key};
use mlx_array::{with_device, Array, DType, Device, QuantMode, Quantized};
use std::time::Instant;

fn llc_bytes() -> usize {
    let mut best = 32 << 20;
    for idx in 0..8 {
        let p = format!("/sys/devices/system/cpu/cpu0/cache/index{idx}/size");
        if let Ok(s) = std::fs::read_to_string(&p) {
            let s = s.trim();
            let (num, mul) = match s.chars().last() {
                Some('K') => (&s[..s.len() - 1], 1 << 10),
                Some('M') => (&s[..s.len() - 1], 1 << 20),
                _ => (s, 1),
            };
            if let Ok(v) = num.parse::<usize>() {
                best = best.max(v * mul);
            }
        }
    }
    best
}

/// GB/s of one multi-threaded pass over `buf` (prefetching ahead where the architecture allows).
fn read_pass(buf: &[u64], threads: usize) -> f64 {
    let t = Instant::now();
    let chunk = buf.len().div_ceil(threads);
    let total: u64 = std::thread::scope(|s| {
        let hs: Vec<_> = buf
            .chunks(chunk)
            .map(|c| {
                s.spawn(move || {
                    let mut acc = [0u64; 8];
                    for (j, w) in c.chunks_exact(8).enumerate() {
                        // 8 KiB ahead into L2, as the kernels read their weights
                        #[cfg(target_arch = "x86_64")]
                        if let Some(ahead) = c.get(j * 8 + 1024) {
                            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>((ahead as *const u64).cast()) };
                        }
                        for i in 0..8 {
                            acc[i] = acc[i].wrapping_add(w[i]);
                        }
                    }
                    acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).fold(0u64, |a, b| a.wrapping_add(b))
    });
    std::hint::black_box(total);
    (buf.len() * 8) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Rounds of each kernel's passes, each round next to a measurement of the read bandwidth.
const ROUNDS: usize = 4;
/// Passes over the in-cache weight (the best is reported).
const IN_LLC_REPS: usize = 40;

fn key(s: u64) -> Key {
    Key::new(s).unwrap()
}

fn packed(n: usize, k: usize, mode: QuantMode, seed: u64) -> Quantized {
    let bits = mode.bits() as usize;
    let gs = mode.group_size() as usize;
    let weight = random::randint(&[n, k * bits / 32], 0, i32::MAX, DType::U32, &key(seed)).unwrap();
    let (scales, biases) = match mode {
        QuantMode::Mxfp4 => (random::randint(&[n, k / gs], 120, 130, DType::U8, &key(seed + 1)).unwrap(), None),
        _ => (
            random::uniform(&[n, k / gs], 0.001, 0.01, DType::F32, &key(seed + 1)).unwrap().astype(DType::BF16).unwrap(),
            Some(random::uniform(&[n, k / gs], -0.05, 0.05, DType::F32, &key(seed + 2)).unwrap().astype(DType::BF16).unwrap()),
        ),
    };
    for a in [Some(&weight), Some(&scales), biases.as_ref()].into_iter().flatten() {
        a.eval().unwrap();
    }
    Quantized { weight, scales, biases, mode }
}

fn qbytes(q: &Quantized) -> usize {
    q.weight.nbytes() + q.scales.nbytes() + q.biases.as_ref().map_or(0, |b| b.nbytes())
}

/// Best GB/s over `reps` passes through `count` products of `bytes` each.
fn pass(count: usize, bytes: usize, reps: usize, mut f: impl FnMut(usize)) -> f64 {
    f(0); // warm-up (threads, allocations)
    let mut best = 0f64;
    for _ in 0..reps {
        let t = Instant::now();
        for i in 0..count {
            f(i);
        }
        best = best.max((count * bytes) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

fn main() {
    with_device(Device::Cpu, run);
}

fn run() {
    let threads = cpu_kernels_threads();
    let llc = llc_bytes();
    let target = 4 * llc;
    println!("kernels: {}, threads: {threads}, last-level cache {} MiB, working sets >= {} MiB", cpu_kernels_isa(), llc >> 20, target >> 20);
    if let Ok(l) = std::fs::read_to_string("/proc/loadavg") {
        println!("load average at start: {}", l.trim());
    }
    let k = 4096;
    let x = random::normal(&[1, k], DType::F32, &key(9)).unwrap();
    x.eval().unwrap();

    // The machine's read bandwidth, measured in every round next to the kernel's passes (a
    // shared machine's bandwidth drifts): the better of a plain multi-threaded read and the f32
    // BLAS matrix-vector product over W^T views of [N, K] f32 (MLX's CPU product over upcast or
    // dequantized weights), which also reads every byte once and outruns the plain loop on
    // some machines.
    let buf: Vec<u64> = (0..(target / 8) as u64).collect();
    let sg_bytes = 8192 * k * 4;
    let sg_count = target.div_ceil(sg_bytes);
    let sg_ws: Vec<Array> = (0..sg_count)
        .map(|i| {
            let w = random::normal(&[8192, k], DType::F32, &key(100 + i as u64)).unwrap();
            w.eval().unwrap();
            w.swap_axes(0, 1).unwrap()
        })
        .collect();
    let (mut read_best, mut sgemv_best) = (0f64, 0f64);
    let mut bandwidth = || -> f64 {
        let read = read_pass(&buf, threads);
        let sgemv = pass(sg_count, sg_bytes, 1, |i| x.matmul(&sg_ws[i % sg_count]).unwrap().eval().unwrap());
        read_best = read_best.max(read);
        sgemv_best = sgemv_best.max(sgemv);
        read.max(sgemv)
    };
    // best of ROUNDS passes of `f` over `count` weights, the best bandwidth measured between
    // them, and the best of the in-cache passes of `f` over weight 0 (`in_llc` bytes, `f(0)`),
    // run in the same rounds: a shared machine's bandwidth and its cores' throughput drift
    let mut rounds = |count: usize, bytes: usize, in_llc: usize, f: &mut dyn FnMut(usize)| -> (f64, f64, f64) {
        let (mut ours, mut bw, mut cached) = (0f64, 0f64, 0f64);
        for _ in 0..ROUNDS {
            bw = bw.max(bandwidth());
            ours = ours.max(pass(count, bytes, 1, |i| f(1 + i)));
            cached = cached.max(pass(1, in_llc, IN_LLC_REPS / ROUNDS, |_| f(0)));
        }
        (ours, bw, cached)
    };
    println!("{:<26} {:>10} {:>8} {:>10} {:>12} {:>9} {:>8} {:>12}", "product (M=1, K=4096)", "bytes/mat", "mats", "ours GB/s", "MLX GB/s", "bw GB/s", "of bw", "in LLC GB/s");
    let row = |name: &str, bytes: usize, count: usize, ours: f64, mlx: f64, bw: f64, in_llc: f64| {
        println!("{:<26} {:>10} {:>8} {:>10.1} {:>12.1} {:>9.1} {:>7.0}% {:>12.1}", name, bytes, count, ours, mlx, bw, 100.0 * ours / bw, in_llc);
    };
    // rows of a weight of about llc / 4 bytes, `row_bytes` each (large enough that a call's fixed
    // cost, about 20 us, is small against its reads)
    let llc_rows = |row_bytes: usize| (llc / 4 / row_bytes).max(16);
    // bf16
    {
        let n = 16384;
        let bytes = n * k * 2;
        let count = target.div_ceil(bytes);
        let ws: Vec<Array> = (0..count)
            .map(|i| {
                let w = random::normal(&[n, k], DType::BF16, &key(200 + i as u64)).unwrap();
                w.eval().unwrap();
                w
            })
            .collect();
        let small = random::normal(&[llc_rows(k * 2), k], DType::BF16, &key(250)).unwrap();
        small.eval().unwrap();
        let (ours, bw, in_llc) = rounds(count, bytes, small.nbytes(), &mut |i| {
            let w = if i == 0 { &small } else { &ws[(i - 1) % count] };
            x.cpu_matmul_bf16(w).unwrap().eval().unwrap()
        });
        // MLX's bf16 matmul is far slower: one pass over a quarter of the set
        let xb = x.astype(DType::BF16).unwrap();
        let few = count.div_ceil(4);
        let mlx = pass(few, bytes, 1, |i| xb.matmul(&ws[i % count].swap_axes(0, 1).unwrap()).unwrap().eval().unwrap());
        row("bf16", bytes, count, ours, mlx, bw, in_llc);
    }
    for (name, mode) in [
        ("affine 4-bit g64", QuantMode::Affine { bits: 4, group_size: 64 }),
        ("affine 4-bit g32", QuantMode::Affine { bits: 4, group_size: 32 }),
        ("affine 8-bit g64", QuantMode::Affine { bits: 8, group_size: 64 }),
        ("mxfp4", QuantMode::Mxfp4),
    ] {
        let n = 32768 * 4 / mode.bits() as usize;
        let probe = packed(n, k, mode, 1);
        let bytes = qbytes(&probe);
        drop(probe);
        let count = target.div_ceil(bytes);
        let qs: Vec<Quantized> = (0..count).map(|i| packed(n, k, mode, 300 + 7 * i as u64)).collect();
        let small = packed(llc_rows(bytes / n), k, mode, 350);
        let (ours, bw, in_llc) = rounds(count, bytes, qbytes(&small), &mut |i| {
            let w = if i == 0 { &small } else { &qs[(i - 1) % count] };
            w.cpu_matmul(&x).unwrap().eval().unwrap()
        });
        let few = count.div_ceil(4);
        let mlx = pass(few, bytes, 1, |i| qs[i % count].matmul(&x, true).unwrap().eval().unwrap());
        row(name, bytes, count, ours, mlx, bw, in_llc);
    }
    drop(rounds);
    println!("read bandwidth over the rounds: plain read {read_best:.1} GB/s, f32 BLAS sgemv {sgemv_best:.1} GB/s ({threads} threads, {} MiB)", target >> 20);
    println!();
    println!("small M at [N=8192, K=2048], ms per product (weights in cache or not: same set for all)");
    println!("{:<18} {:>4} {:>10} {:>16} {:>18}", "weights", "M", "ours", "f32 BLAS (deq.)", "MLX quantized_mm");
    let (n, k) = (8192, 2048);
    let q = packed(n, k, QuantMode::Affine { bits: 4, group_size: 64 }, 77);
    let deq = q.dequantize(Some(DType::F32)).unwrap().swap_axes(0, 1).unwrap();
    deq.eval().unwrap();
    let wb = random::normal(&[n, k], DType::BF16, &key(78)).unwrap();
    let wbt = wb.astype(DType::F32).unwrap().swap_axes(0, 1).unwrap();
    wb.eval().unwrap();
    wbt.eval().unwrap();
    let time = |f: &mut dyn FnMut()| -> f64 {
        f();
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            f();
            best = best.min(t.elapsed().as_secs_f64() * 1e3);
        }
        best
    };
    for m in [1usize, 2, 4, 8, 12, 16, 32, 64] {
        let xm = random::normal(&[m, k], DType::F32, &key(500 + m as u64)).unwrap();
        xm.eval().unwrap();
        let ours = time(&mut || q.cpu_matmul(&xm).unwrap().eval().unwrap());
        let blas = time(&mut || xm.matmul(&deq).unwrap().eval().unwrap());
        let mlx = time(&mut || q.matmul(&xm, true).unwrap().eval().unwrap());
        println!("{:<18} {m:>4} {ours:>10.3} {blas:>16.3} {mlx:>18.3}", "affine 4-bit g64");
        let ob = time(&mut || xm.cpu_matmul_bf16(&wb).unwrap().eval().unwrap());
        let fb = time(&mut || xm.matmul(&wbt).unwrap().eval().unwrap());
        println!("{:<18} {m:>4} {ob:>10.3} {fb:>16.3} {:>18}", "bf16", "-");
    }
    if let Ok(l) = std::fs::read_to_string("/proc/loadavg") {
        println!("load average at end: {}", l.trim());
    }
}
