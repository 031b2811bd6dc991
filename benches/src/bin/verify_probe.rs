//! Where a speculative verify step's time goes on a GPU: a forward of M rows against one row,
//! and the same model's products and attention alone, with MLX's ops and with the few-row CUDA
//! kernels of `crates/mlx-sys/src/cudakern` ([`CudaFewRowKernels`]):
//!
//! ```text
//! verify_probe --model DIR [--dtype bf16] [--prompt 384] [--rows 1,2,4,8] [--iters 20]
//!              [--modes off,products,attention,on] [--forward-only | --op-costs | --compare | --growth [--prewarm] [--reserve N]]
//! ```
//!
//! - `forward`: with each [`CudaFewRowKernels`] setting, the median time of a forward of M rows at a fixed position (logits of every row
//!   and the cache evaluated, then the M positions trimmed away), as the verifier runs it; the
//!   first call's time (one-time costs of a new shape), the median host time to build its graph,
//!   and the graph's primitives (the most frequent by name);
//! - `product`: x `[M, K]` @ w.T for each weight shape of the checkpoint's config (q, k/v, the
//!   joined q+k+v, o, gate/up, the joined gate+up, down, the head), one distinct random weight
//!   per layer (at most 2.4 GB of them), chained (each call reads the previous one's output, so
//!   the calls run one after another as in a forward: independent calls of one evaluation run
//!   concurrently on a GPU and would hide a kernel that occupies few SMs): time a call and
//!   weight GB/s;
//! - `attention`: M causal queries over `--prompt` keys, one distinct K/V per layer, contiguous
//!   and as a flat cache hands them over, chained the same way (queries = the previous output);
//! - `--op-costs` (instead of the tables): the time per node of chains of one-row ops of the
//!   model's width (add, reshape, rms_norm, a product through a 3-d input and through a 2-d one,
//!   one query's attention; a verify step's 8-row products by libmlx and by the few-row kernel,
//!   and its attention as products), building the graph and evaluating it: where a one-row forward's
//!   host time goes (each node's share of libmlx's per-node work);
//! - `--compare` (instead of the timings): for each setting and M, the logits of a forward of M
//!   rows against M one-row forwards over the same tokens from the same cache (what a verify
//!   step computes against plain decoding), and against a second M-row forward: the largest
//!   difference, the rows whose argmax differs, and the smallest top-1/top-2 gap of the one-row
//!   logits (argmaxes may differ where that gap is below the difference);
//! - `--growth [--prewarm] [--reserve N]` (alone): one-row decode steps across the flat caches' K/V growth at
//!   256 and 512 positions in a fresh process, to tell a growth's one-time cost from the rest.
use mlx_array::ops::{concatenate, set_cuda_few_row_kernels, AttentionMask, CudaFewRowKernels};
use mlx_array::random::{normal, Key};
use mlx_array::Array;
use mlx_models::Logits;
use std::time::Instant;

#[path = "../shared.rs"]
mod shared;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Where a verify step's time goes on a GPU.
#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    m: shared::ModelArgs,
    /// Rows of each forward and product.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    rows: Vec<usize>,
    /// Timed repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Kernel settings the forwards run with (off, products, attention, on).
    #[arg(long, value_delimiter = ',', default_value = "off,products,attention,on")]
    modes: Vec<CudaFewRowKernels>,
    /// Only the forwards (no product or attention tables).
    #[arg(long)]
    forward_only: bool,
    /// Time per node of chains of one-row ops instead of the product and attention tables.
    #[arg(long, conflicts_with = "forward_only")]
    op_costs: bool,
    /// Logits of M-row forwards against one-row forwards instead of timings.
    #[arg(long, conflicts_with_all = ["forward_only", "op_costs", "iters", "growth"])]
    compare: bool,
    /// Only one-row decode steps from --prompt positions to 520 in a fresh cache, twice: the
    /// steps where the flat K/V grows (256, 512 positions) against the rest.
    #[arg(long, conflicts_with_all = ["forward_only", "op_costs", "rows", "modes", "iters"])]
    growth: bool,
    /// With --growth: first make, evaluate and drop arrays of every grown K/V size, so that
    /// libmlx's buffer cache holds them before the first growth.
    #[arg(long, requires = "growth")]
    prewarm: bool,
    /// With --growth: size the caches for this many positions before the prefill
    /// (`Cache::reserve`, as `generate` does for a generation's length), so they never grow.
    #[arg(long, requires = "growth")]
    reserve: Option<usize>,
}

/// `--compare`: M-row forwards against one-row forwards over `next` from `cache`'s position
/// (restored after each).
fn compare_rows(model: &mlx_models::Model, cache: &mut mlx_models::Cache, next: &[u32], rows: &[usize], modes: &[CudaFewRowKernels]) -> Res<()> {
    let host = |a: &Array| -> Res<Vec<f32>> { Ok(a.astype(mlx_array::DType::F32)?.to_vec::<f32>()?) };
    let vocab = model.info().vocab_size;
    for &mode in modes {
        set_cuda_few_row_kernels(mode);
        for &m in rows {
            // rolled back by snapshot, which recurrent layers (LFM2 conv, GatedDeltaNet) need
            let snap = cache.snapshot();
            let multi = |cache: &mut mlx_models::Cache| -> Res<Vec<f32>> {
                let out = model.with_runtime(|rt| rt.forward(&Array::from_slice(&next[..m], &[1, m])?, cache, Logits::All, false))?;
                let logits = out.logits.ok_or("no logits")?;
                cache.eval_with(&[&logits])?;
                let v = host(&logits)?;
                cache.restore(&snap)?;
                Ok(v)
            };
            let (a, b) = (multi(cache)?, multi(cache)?);
            let mut seq = Vec::with_capacity(m * vocab);
            for i in 0..m {
                let out = model.with_runtime(|rt| rt.forward(&Array::from_slice(&next[i..i + 1], &[1, 1])?, cache, Logits::Last, false))?;
                let logits = out.logits.ok_or("no logits")?;
                cache.eval_with(&[&logits])?;
                seq.extend(host(&logits)?);
            }
            cache.restore(&snap)?;
            let diff = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            let mut flips = Vec::new();
            let mut gap = f32::INFINITY;
            for i in 0..m {
                let (r, s) = (&a[i * vocab..(i + 1) * vocab], &seq[i * vocab..(i + 1) * vocab]);
                if shared::argmax(r) != shared::argmax(s) {
                    flips.push(i);
                }
                let top = shared::argmax(s);
                let second = s.iter().enumerate().filter(|&(j, _)| j != top).map(|(_, &x)| x).fold(f32::NEG_INFINITY, f32::max);
                gap = gap.min(s[top] - second);
            }
            let scale = seq.iter().map(|x| x.abs()).fold(0f32, f32::max);
            // f32::max skips NaN: non-finite logits are counted on their own
            println!(
                "compare kernels={mode:?} rows={m}: max |M-row - one-row| {:.3e} (largest |logit| {scale:.2}), argmax differs at rows {flips:?}, smallest one-row top-1/top-2 gap {gap:.3e}; max |M-row - M-row again| {:.3e}; non-finite logits: M-row {}, again {}, one-row {}",
                diff(&a, &seq),
                diff(&a, &b),
                shared::non_finite(&a),
                shared::non_finite(&b),
                shared::non_finite(&seq)
            );
        }
    }
    set_cuda_few_row_kernels(CudaFewRowKernels::Off);
    Ok(())
}

const MODES: [CudaFewRowKernels; 2] = [CudaFewRowKernels::Off, CudaFewRowKernels::On];

/// The median of `iters` timings of `f` in ms, after two untimed calls.
fn median_ms(iters: usize, f: impl FnMut() -> Res<()>) -> Res<f64> {
    shared::median_ms(2, iters, f)
}

fn usize_field(cfg: &serde_json::Value, k: &str) -> Res<usize> {
    cfg.get(k).and_then(|v| v.as_u64()).map(|v| v as usize).ok_or_else(|| format!("config.json has no {k}").into())
}

fn main() -> Res<()> {
    let Cli { m, rows, iters, modes, forward_only, op_costs: costs, compare, growth, prewarm, reserve } = <Cli as clap::Parser>::parse();
    if rows.iter().any(|&r| r == 0) || m.prompt == 0 {
        return Err("--rows and --prompt must be positive".into());
    }
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(std::path::Path::new(&m.model).join("config.json"))?)?;
    let (model, dt) = m.load_lm()?;
    let shared::ModelArgs { dtype, prompt, .. } = m;
    let info = model.info().clone();
    println!("device {:?}, {} layers, {} keys, dtype {dtype}", mlx_array::default_device()?, info.num_layers, prompt);
    if growth {
        let hq = usize_field(&cfg, "num_attention_heads")?;
        let kv = [usize_field(&cfg, "num_key_value_heads").unwrap_or(hq), usize_field(&cfg, "head_dim").unwrap_or(usize_field(&cfg, "hidden_size")? / hq)];
        return growth_steps(&model, prompt, kv, dt, prewarm, reserve);
    }

    // forward of M rows at a fixed position
    let vocab = info.vocab_size;
    let ids: Vec<u32> = shared::prompt_ids(prompt + rows.iter().max().copied().unwrap_or(1), vocab);
    let mut cache = model.new_cache();
    let pre = model.with_runtime(|rt| rt.forward(&Array::from_slice(&ids[..prompt], &[1, prompt])?, &mut cache, Logits::Last, false))?;
    cache.eval_with(&pre.logits.iter().collect::<Vec<_>>())?;
    if compare {
        return compare_rows(&model, &mut cache, &ids[prompt..], &rows, &modes);
    }
    for &mode in &modes {
        set_cuda_few_row_kernels(mode);
        for &m in &rows {
            let input = Array::from_slice(&ids[prompt..prompt + m], &[1, m])?;
            let mut build = Vec::with_capacity(iters + 2);
            let mut nodes = None;
            let mut first = None;
            let ms = median_ms(iters, || {
                let t = Instant::now();
                let out = model.with_runtime(|rt| rt.forward(&input, &mut cache, Logits::All, false))?;
                let logits = out.logits.ok_or("no logits")?;
                build.push(t.elapsed().as_secs_f64() * 1e3);
                if nodes.is_none() {
                    nodes = Some(mlx_array::graph_nodes(&[&logits])?);
                }
                cache.eval_with(&[&logits])?;
                cache.trim(m)?;
                first.get_or_insert(t.elapsed().as_secs_f64() * 1e3);
                Ok(())
            })?;
            build.sort_by(f64::total_cmp);
            let (n, by) = nodes.unwrap_or_default();
            let top: Vec<String> = by.iter().map(|(name, c)| format!("{name} {c}")).collect();
            let first = first.unwrap_or_default();
            println!("forward kernels={mode:?} rows={m}: {ms:.3} ms (first call {first:.1} ms), graph built in {:.3} ms, {n} nodes ({})", build[build.len() / 2], top.join(", "));
        }
    }

    set_cuda_few_row_kernels(CudaFewRowKernels::Off);
    if forward_only {
        return Ok(());
    }
    if costs {
        return op_costs(usize_field(&cfg, "hidden_size")?, dt, iters);
    }

    // products of the checkpoint's shapes
    let h = usize_field(&cfg, "hidden_size")?;
    let inter = usize_field(&cfg, "intermediate_size")?;
    let hq = usize_field(&cfg, "num_attention_heads")?;
    let hk = usize_field(&cfg, "num_key_value_heads").unwrap_or(hq);
    let d = usize_field(&cfg, "head_dim").unwrap_or(h / hq);
    let layers = info.num_layers;
    // the separate projections, the joined ones the GPU loads (q/k/v, gate/up) and the head
    let shapes = [
        ("q", hq * d, h),
        ("k/v", hk * d, h),
        ("q+k+v", (hq + 2 * hk) * d, h),
        ("o", h, hq * d),
        ("gate/up", inter, h),
        ("gate+up", 2 * inter, h),
        ("down", h, inter),
        ("head", vocab, h),
    ];
    let mut key = Key::new(7)?;
    let mut next_key = || -> Res<Key> {
        let (a, b) = key.split()?;
        key = a;
        Ok(b)
    };
    for (name, n, k) in shapes {
        // one weight per layer, at most about 2.4 GB of them
        let count = layers.min((2.4e9 / (n * k * dt.size()) as f64) as usize).max(1);
        let ws: Vec<Array> = (0..count).map(|_| Ok(normal(&[n, k], dt, &next_key()?)?.mul_scalar(0.02)?)).collect::<Res<_>>()?;
        mlx_array::eval(&ws.iter().collect::<Vec<_>>())?;
        let gb = (count * n * k * dt.size()) as f64 / 1e9;
        for &m in &rows {
            let x = normal(&[m, k], dt, &next_key()?)?;
            x.eval()?;
            let mut line = format!("product {name} N={n} K={k} rows={m}:");
            for mode in MODES {
                set_cuda_few_row_kernels(mode);
                // chained: each product reads the previous one's output (its first K columns, a
                // view; repeated first where N < K), so the calls run one after another as in a
                // forward (independent calls in one evaluation overlap on the GPU)
                let ms = median_ms(iters, || {
                    let mut x = x.clone();
                    for w in &ws {
                        let y = x.matmul_weight_t(&w.swap_axes(0, 1)?)?;
                        let y = if n >= k { y } else { concatenate(&vec![&y; k.div_ceil(n)], 1)? };
                        x = y.slice_axis(1, 0, k)?;
                    }
                    x.eval()?;
                    Ok(())
                })?;
                line += &format!(" {mode:?} {:.1} us/call {:.0} GB/s;", ms * 1e3 / count as f64, gb / (ms / 1e3));
            }
            println!("{line}");
        }
    }

    // attention of M queries over the prompt's keys: contiguous q/k/v, and as a flat cache
    // hands them over (k/v a slice of a longer buffer, q a transposed view of [B, M, Hq, D])
    let cap = prompt + 256;
    let bufs: Vec<(Array, Array)> = (0..layers).map(|_| Ok((normal(&[1, hk, cap, d], dt, &next_key()?)?, normal(&[1, hk, cap, d], dt, &next_key()?)?))).collect::<Res<_>>()?;
    let kvs: Vec<(Array, Array)> = (0..layers).map(|_| Ok((normal(&[1, hk, prompt, d], dt, &next_key()?)?, normal(&[1, hk, prompt, d], dt, &next_key()?)?))).collect::<Res<_>>()?;
    mlx_array::eval(&bufs.iter().chain(&kvs).flat_map(|(k, v)| [k, v]).collect::<Vec<_>>())?;
    let scale = 1.0 / (d as f32).sqrt();
    for &m in rows.iter().filter(|&&m| m > 1 && m <= prompt) {
        let q = normal(&[1, hq, m, d], dt, &next_key()?)?;
        let qt = normal(&[1, m, hq, d], dt, &next_key()?)?;
        mlx_array::eval(&[&q, &qt])?;
        let qt = qt.transpose(&[0, 2, 1, 3])?;
        for (layout, q) in [("contiguous", &q), ("cache views", &qt)] {
            let mut line = format!("attention {layout} {hq}/{hk} heads D={d} queries={m} keys={prompt}:");
            for mode in MODES {
                set_cuda_few_row_kernels(mode);
                // chained: each layer's queries are the previous layer's output
                let ms = median_ms(iters, || {
                    let mut x = q.clone();
                    for ((kb, vb), (k, v)) in bufs.iter().zip(&kvs) {
                        x = match layout {
                            "contiguous" => x.sdpa(k, v, scale, AttentionMask::Causal)?,
                            _ => x.sdpa(&kb.slice_axis(2, 0, prompt)?, &vb.slice_axis(2, 0, prompt)?, scale, AttentionMask::Causal)?,
                        };
                    }
                    x.eval()?;
                    Ok(())
                })?;
                line += &format!(" {mode:?} {:.1} us/call;", ms * 1e3 / layers as f64);
            }
            println!("{line}");
        }
    }
    set_cuda_few_row_kernels(CudaFewRowKernels::Off);
    Ok(())
}

/// Per node: the median time to build and to evaluate chains of `N` one-row ops `[1, 1, h]` (each
/// op reads the previous one's output), after two untimed chains.
/// Positions the growth probe decodes to (past the flat caches' growth at 256 and 512).
const GROWTH_END: usize = 520;

/// `--growth`: one-row decode steps from `start` positions to [`GROWTH_END`] in a fresh flat
/// cache, each built, evaluated and timed, in two caches one after the other (the second after
/// the first is dropped); per cache the median step and every step over twice it. With
/// `prewarm`, first arrays of each layer's grown K/V sizes (`[1, kv_heads, cap, head_dim]` for
/// capacities 256, 512 and 768, and the 256-position blocks of zeros a growth concatenates) are
/// made, evaluated and dropped: a spike that then goes away was the allocation's. With
/// `reserve`, the caches are sized for that many positions first (no growth below it).
fn growth_steps(model: &mlx_models::Model, start: usize, [hk, d]: [usize; 2], dt: mlx_array::DType, prewarm: bool, reserve: Option<usize>) -> Res<()> {
    if start >= GROWTH_END {
        return Err(format!("--prompt must be below {GROWTH_END} with --growth").into());
    }
    let layers = model.info().num_layers;
    if prewarm {
        let t = Instant::now();
        for cap in [256, 512, 768] {
            let blocks: Vec<Array> = (0..2 * layers).map(|_| Array::zeros(&[1, hk, cap, d], dt)).collect::<Result<_, _>>()?;
            mlx_array::eval(&blocks.iter().collect::<Vec<_>>())?;
        }
        println!("prewarm: {} arrays in {:.1} ms", 6 * layers, t.elapsed().as_secs_f64() * 1e3);
    }
    let ids = shared::prompt_ids(GROWTH_END, model.info().vocab_size);
    for run in 0..2 {
        let mut cache = model.new_cache();
        if let Some(n) = reserve {
            cache.reserve(n)?;
        }
        let pre = model.with_runtime(|rt| rt.forward(&Array::from_slice(&ids[..start], &[1, start])?, &mut cache, Logits::Last, false))?;
        cache.eval_with(&pre.logits.iter().collect::<Vec<_>>())?;
        let mut steps = Vec::with_capacity(GROWTH_END - start);
        for pos in start..GROWTH_END {
            let t = Instant::now();
            let out = model.with_runtime(|rt| rt.forward(&Array::from_slice(&ids[pos..pos + 1], &[1, 1])?, &mut cache, Logits::Last, false))?;
            cache.eval_with(&out.logits.iter().collect::<Vec<_>>())?;
            steps.push((pos, t.elapsed().as_secs_f64() * 1e3));
        }
        let mut sorted: Vec<f64> = steps.iter().map(|s| s.1).collect();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        let slow: Vec<String> = steps.iter().filter(|s| s.1 > 2.0 * median).map(|(p, ms)| format!("at {p}: {ms:.1} ms")).collect();
        println!("cache {}: {} steps from {start}, median {median:.2} ms; over twice it: {}", run + 1, steps.len(), if slow.is_empty() { "none".to_string() } else { slow.join(", ") });
    }
    Ok(())
}

fn op_costs(h: usize, dt: mlx_array::DType, iters: usize) -> Res<()> {
    const N: usize = 256;
    let key = Key::new(11)?;
    let (k1, k2) = key.split()?;
    let x0 = normal(&[1, 1, h], dt, &k1)?;
    let w = normal(&[h, h], dt, &k2)?.mul_scalar(1.0 / (h as f32).sqrt())?;
    let c = x0.mul_scalar(0.001)?;
    let norm_w = c.reshape(&[h as i32])?;
    let (hd, heads) = (64, h / 64);
    let keys = normal(&[1, heads, 64, hd], dt, &k1)?;
    mlx_array::eval(&[&x0, &w, &c, &norm_w, &keys])?;
    let wt = w.swap_axes(0, 1)?;
    wt.eval()?; // a view, no node of the chains
    let scale = 1.0 / (hd as f32).sqrt();
    type Step<'a> = Box<dyn Fn(&Array) -> Res<Array> + 'a>;
    // each chain: its name, its first input, and one step
    let x2 = x0.reshape(&[1, h as i32])?;
    let x8 = normal(&[8, h], dt, &k2)?;
    mlx_array::eval(&[&x2, &x8])?;
    let chains: Vec<(&str, &Array, Step)> = vec![
        ("add", &x0, Box::new(|x: &Array| Ok(x.add(&c)?))),
        ("reshape", &x0, Box::new(|x: &Array| Ok(x.reshape(&[1, h as i32])?.reshape(&[1, 1, h as i32])?))),
        ("rms_norm", &x0, Box::new(|x: &Array| Ok(x.rms_norm(Some(&norm_w), 1e-6)?))),
        ("product, 3-d input", &x0, Box::new(|x: &Array| Ok(x.matmul(&wt)?))),
        ("product, 2-d input", &x2, Box::new(|x: &Array| Ok(x.matmul(&wt)?))),
        // a verify step's products: libmlx's (cuBLASLt for more than one row) and the few-row kernel
        ("product, 8 rows", &x8, Box::new(|x: &Array| Ok(x.matmul(&wt)?))),
        ("product, 8 rows, few-row kernel", &x8, Box::new(|x: &Array| Ok(x.cuda_rows_matmul(&w)?))),
        ("attention, 8 causal queries as products, 64 keys", &x8, Box::new(|x: &Array| {
            let q = x.reshape(&[1, 8, heads as i32, hd as i32])?.transpose(&[0, 2, 1, 3])?;
            Ok(q.sdpa_by_products(&keys, &keys, scale, AttentionMask::Causal)?.transpose(&[0, 2, 1, 3])?.reshape(&[8, h as i32])?)
        })),
        ("attention, 1 query, 64 keys", &x0, Box::new(|x: &Array| {
            let q = x.reshape(&[1, heads as i32, 1, hd as i32])?;
            Ok(q.sdpa(&keys, &keys, scale, AttentionMask::None)?.reshape(&[1, 1, h as i32])?)
        })),
    ];
    println!("op costs: chains of {N} ops over [1, 1, {h}] {dt}; per node: build, evaluate (us)");
    for (name, start, step) in &chains {
        let first = match step(start) {
            Ok(y) => y,
            Err(e) => {
                println!("  {name}: not run ({e})");
                continue;
            }
        };
        let (nodes, by) = mlx_array::graph_nodes(&[&first])?;
        let kinds: Vec<String> = by.iter().map(|(n, c)| format!("{n} {c}")).collect();
        let mut build = Vec::new();
        let ms = median_ms(iters, || {
            let t = Instant::now();
            let mut x = (*start).clone();
            for _ in 0..N {
                x = step(&x)?;
            }
            build.push(t.elapsed().as_secs_f64() * 1e3);
            x.eval()?;
            Ok(())
        })?;
        build.sort_by(f64::total_cmp);
        let per = |v: f64| v * 1e3 / (N * nodes) as f64;
        println!("  {name} ({}): {:.2} us to build, {:.2} us a node in all", kinds.join(", "), per(build[build.len() / 2]), per(ms));
    }
    Ok(())
}
