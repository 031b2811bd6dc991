//! `llm_bench`: our runtime against mlx-lm, side by side, on one checkpoint.
//!
//! ```text
//! llm_bench --model DIR [--dtype f32|bf16] [--runs 3] [--gen 128] [--prompts 128,2048]
//!           [--python PATH] [--no-mlx-lm] [--json FILE] [--bandwidth]
//! llm_bench --create-random qwen3-0.6b|qwen3-small|qwen3-8b [--dtype f32|bf16] [--out DIR]
//! llm_bench --bandwidth-only
//! ```
//!
//! For each prompt length P (default 128 and 2048) one request is "P prompt ids, greedy":
//! with P = the first length it generates `--gen` tokens (decode), otherwise 1 token (prefill
//! only). Runs alternate: warm-up (ours, theirs), then for r in 1..=runs: ours, theirs, for every
//! request. The table shows the **median** over the runs (and min-max). Both sides time the same way:
//! t0 just before generation starts (fresh cache), TTFT = first token id on the host, prefill tok/s
//! = P / TTFT, decode tok/s = (n - 1) / (t_last - t_first), peak = MLX's peak allocator counter
//! (weights included) reset before each request. The mlx-lm side is `mlx_lm_bench.py --serve`
//! (next to this crate, or `--script`), one process kept alive for the whole run, fed the same ids.
//! On the CPU it runs with `LD_PRELOAD` = the system OpenBLAS (the same library our libmlx uses
//! through mlx-sys' symlinks); env `MLX_LM_PRELOAD` overrides ("" = none).
//!
//! `--bandwidth` also measures device copy bandwidth (`y = x + 0` on a 1 GiB array: 2 GiB moved)
//! and prints the decode floor: bytes of weights (and KV) read per token / copy bandwidth.
use mlx_array::{memory, DType};
use mlx_models::families::qwen3::Qwen3Config;
use mlx_models::{create_random_qwen3_checkpoint, generate, load_model, GenerateConfig, LoadOptions, Model};
use sampling::SamplingConfig;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Debug, Clone)]
struct Args {
    model: Option<PathBuf>,
    dtype: Option<String>,
    /// KV cache of our side: "flat" (default, like mlx-lm's KVCache) or "paged".
    kv: String,
    runs: usize,
    gen: usize,
    prompts: Vec<usize>,
    python: Option<String>,
    script: Option<PathBuf>,
    no_mlx_lm: bool,
    json: Option<PathBuf>,
    create: Option<String>,
    out: Option<PathBuf>,
    bandwidth: bool,
    bandwidth_only: bool,
    seed: u64,
}

fn usage() -> ! {
    eprintln!("{}", USAGE);
    std::process::exit(2)
}

const USAGE: &str = "usage:
  llm_bench --model DIR [--dtype f32|bf16] [--kv flat|paged] [--runs 3] [--gen 128] [--prompts 128,2048]
            [--python PATH] [--script mlx_lm_bench.py] [--no-mlx-lm] [--json FILE] [--bandwidth]
  llm_bench --create-random qwen3-0.6b|qwen3-small|qwen3-8b [--dtype f32|bf16] [--out DIR] [--seed N]
  llm_bench --bandwidth-only
env: MLX_LM_PYTHON (python with mlx-lm; default /tmp/mlxlm/bin/python, else python3)";

fn parse_args() -> Args {
    let mut a = Args {
        model: None,
        dtype: None,
        kv: "flat".into(),
        runs: 3,
        gen: 128,
        prompts: vec![128, 2048],
        python: std::env::var("MLX_LM_PYTHON").ok(),
        script: None,
        no_mlx_lm: false,
        json: None,
        create: None,
        out: None,
        bandwidth: false,
        bandwidth_only: false,
        seed: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| usage());
        match k.as_str() {
            "--model" => a.model = Some(v().into()),
            "--dtype" => a.dtype = Some(v()),
            "--kv" => a.kv = v(),
            "--runs" => a.runs = v().parse().unwrap_or_else(|_| usage()),
            "--gen" => a.gen = v().parse().unwrap_or_else(|_| usage()),
            "--prompts" => a.prompts = v().split(',').map(|s| s.trim().parse().unwrap_or_else(|_| usage())).collect(),
            "--python" => a.python = Some(v()),
            "--script" => a.script = Some(v().into()),
            "--no-mlx-lm" => a.no_mlx_lm = true,
            "--json" => a.json = Some(v().into()),
            "--create-random" => a.create = Some(v()),
            "--out" => a.out = Some(v().into()),
            "--seed" => a.seed = v().parse().unwrap_or_else(|_| usage()),
            "--bandwidth" => a.bandwidth = true,
            "--bandwidth-only" => a.bandwidth_only = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0)
            }
            _ => usage(),
        }
    }
    a
}

fn parse_dtype(s: &str) -> DType {
    match s {
        "f32" | "float32" => DType::F32,
        "bf16" | "bfloat16" => DType::BF16,
        "f16" | "float16" => DType::F16,
        _ => usage(),
    }
}

fn device_name() -> String {
    format!("{:?}", mlx_array::default_device().map_err(|e| e.to_string()))
}

// ------------------------------------------------------------------ random checkpoints

fn shape(name: &str) -> Option<Qwen3Config> {
    let (h, l, nq, nkv, inter, vocab, tied) = match name {
        "qwen3-0.6b" => (1024, 28, 16, 8, 3072, 151936, true),
        "qwen3-small" => (1024, 8, 16, 8, 3072, 32768, true),
        "qwen3-8b" => (4096, 36, 32, 8, 12288, 151936, false),
        _ => return None,
    };
    Some(
        serde_json::from_value(json!({
            "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": l,
            "num_attention_heads": nq, "num_key_value_heads": nkv, "head_dim": 128, "vocab_size": vocab,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": tied,
            "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645
        }))
        .expect("static config"),
    )
}

fn params(c: &Qwen3Config) -> usize {
    let (h, d, i) = (c.hidden_size, c.head_dim(), c.intermediate_size);
    let attn = h * c.num_attention_heads * d * 2 + h * c.num_key_value_heads * d * 2 + 2 * d;
    let layer = attn + 3 * h * i + 2 * h;
    c.vocab_size * h * if c.tie_word_embeddings { 1 } else { 2 } + c.num_hidden_layers * layer + h
}

fn cache_root() -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/tmp".into());
    PathBuf::from(home).join(".cache/mlx-models/bench")
}

fn create(a: &Args, name: &str) -> Res<()> {
    let cfg = shape(name).unwrap_or_else(|| usage());
    let dt = a.dtype.as_deref().unwrap_or("bf16");
    let dtype = parse_dtype(dt);
    let dir = a.out.clone().unwrap_or_else(|| cache_root().join(format!("{name}-{dt}")));
    let n = params(&cfg);
    eprintln!(
        "creating random {name} ({:.3} B params, {:.2} GB in {dt}) in {} on {} ...",
        n as f64 / 1e9,
        (n * dtype_bytes(dtype)) as f64 / 1e9,
        dir.display(),
        device_name()
    );
    let t = Instant::now();
    create_random_qwen3_checkpoint(&cfg, &dir, dtype, a.seed)?;
    eprintln!("created in {:.1} s", t.elapsed().as_secs_f64());
    println!("{}", dir.display());
    Ok(())
}

fn dtype_bytes(d: DType) -> usize {
    match d {
        DType::F32 => 4,
        _ => 2,
    }
}

// ------------------------------------------------------------------ measurements

#[derive(Debug, Clone, Default)]
struct Run {
    ttft_ms: f64,
    prefill_tps: f64,
    decode_tps: f64,
    peak_bytes: f64,
    tokens: Vec<u32>,
}

fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    // the same formula as shared/tools/bench_mlx_lm.py
    (0..n).map(|i| ((i * 7919 + 13) % (vocab - 100).min(30000) + 10) as u32).collect()
}

fn run_ours(model: &Model, prompt: &[u32], gen: usize) -> Res<Run> {
    let mut cache = model.new_cache();
    memory::reset_peak()?;
    let cfg = GenerateConfig { max_new_tokens: gen, sampling: SamplingConfig::greedy(), prefill_step_size: 2048, stop_tokens: Some(vec![]) };
    let t0 = Instant::now();
    let (mut t_first, mut t_last) = (None, 0.0);
    let mut tokens = Vec::with_capacity(gen);
    {
        let g = generate(model, &mut cache, prompt, &[], cfg)?;
        for t in g {
            let t = t?;
            let now = t0.elapsed().as_secs_f64();
            t_first.get_or_insert(now);
            t_last = now;
            tokens.push(t.id);
        }
    }
    // The generator queues the step after the last token: let it finish before the next request.
    mlx_array::eval(&cache.arrays())?;
    let t_first = t_first.ok_or("no token generated")?;
    let n = tokens.len();
    Ok(Run {
        ttft_ms: t_first * 1e3,
        prefill_tps: prompt.len() as f64 / t_first,
        decode_tps: if n > 1 && t_last > t_first { (n - 1) as f64 / (t_last - t_first) } else { 0.0 },
        peak_bytes: memory::peak()? as f64,
        tokens,
    })
}

struct Theirs {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    info: Value,
}

impl Theirs {
    fn start(a: &Args, model: &Path, dtype: &str) -> Res<Theirs> {
        let py = a.python.clone().unwrap_or_else(|| if Path::new("/tmp/mlxlm/bin/python").exists() { "/tmp/mlxlm/bin/python".into() } else { "python3".into() });
        let script = a.script.clone().unwrap_or_else(|| {
            let exe_dir = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf));
            [Some(PathBuf::from(env!("CARGO_MANIFEST_DIR"))), exe_dir, Some(PathBuf::from("benches"))]
                .into_iter()
                .flatten()
                .map(|d| d.join("mlx_lm_bench.py"))
                .find(|p| p.exists())
                .unwrap_or_else(|| PathBuf::from("benches/mlx_lm_bench.py"))
        });
        eprintln!("starting mlx-lm: {py} {} {} --dtype {dtype} --serve", script.display(), model.display());
        let mut cmd = Command::new(&py);
        // The PyPI mlx-cpu wheel bundles reference BLAS; ours links OpenBLAS (mlx-sys symlinks the
        // bundled names to it). Give mlx-lm the same OpenBLAS by preloading it (MLX_LM_PRELOAD=""
        // to turn this off, or a path to use another library).
        let preload = std::env::var("MLX_LM_PRELOAD").unwrap_or_else(|_| {
            let p = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0";
            if mlx_array::default_device().ok() == Some(mlx_array::Device::Cpu) && Path::new(p).exists() { p.into() } else { String::new() }
        });
        if !preload.is_empty() {
            cmd.env("LD_PRELOAD", &preload);
        }
        eprintln!("  mlx-lm LD_PRELOAD={}", if preload.is_empty() { "(none)" } else { &preload });
        let mut child = cmd
            .arg(&script)
            .arg(model)
            .args(["--dtype", dtype, "--serve"])
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start {py}: {e}"))?;
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let info = read_json(&mut stdout)?;
        Ok(Theirs { child, stdin, stdout, info })
    }

    fn run(&mut self, prompt: &[u32], gen: usize) -> Res<Run> {
        writeln!(self.stdin, "{}", json!({"prompt": prompt, "gen": gen}))?;
        self.stdin.flush()?;
        let v = read_json(&mut self.stdout)?;
        if let Some(e) = v.get("error") {
            return Err(format!("mlx-lm: {e}").into());
        }
        let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        Ok(Run {
            ttft_ms: f("ttft_ms"),
            prefill_tps: f("prefill_tps"),
            decode_tps: f("decode_tps"),
            peak_bytes: f("peak_bytes"),
            tokens: v["tokens"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect()).unwrap_or_default(),
        })
    }
}

impl Drop for Theirs {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"quit": true}));
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

fn read_json(r: &mut impl BufRead) -> Res<Value> {
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Err("mlx-lm process ended (see its stderr above)".into());
        }
        // mlx-lm may print warnings on stdout; JSON lines start with '{'
        if line.trim_start().starts_with('{') {
            return Ok(serde_json::from_str(&line)?);
        }
        eprint!("[mlx-lm] {line}");
    }
}

/// Device copy bandwidth in bytes/s: best of 10 `y = x + 0` over a 1 GiB array (2 GiB moved).
fn copy_bandwidth() -> Res<f64> {
    let n = (1usize << 30) / 4;
    let x = mlx_array::random::uniform(&[n], 0.0, 1.0, DType::F32, &mlx_array::random::Key::new(1)?)?;
    x.eval()?;
    let mut best = f64::INFINITY;
    for i in 0..12 {
        let t = Instant::now();
        let y = x.add_scalar(0.0)?;
        y.eval()?;
        let s = t.elapsed().as_secs_f64();
        if i >= 2 {
            best = best.min(s);
        }
    }
    Ok(2.0 * (n * 4) as f64 / best)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

struct Stat {
    med: f64,
    min: f64,
    max: f64,
}

fn stat(runs: &[Run], f: impl Fn(&Run) -> f64) -> Stat {
    let mut v: Vec<f64> = runs.iter().map(f).collect();
    let med = median(&mut v);
    Stat { med, min: v.first().copied().unwrap_or(f64::NAN), max: v.last().copied().unwrap_or(f64::NAN) }
}

fn fmt_stat(s: &Stat, prec: usize) -> String {
    if s.min == s.max {
        format!("{:.*}", prec, s.med)
    } else {
        format!("{:.*} ({:.*}–{:.*})", prec, s.med, prec, s.min, prec, s.max)
    }
}

fn bench(a: &Args, dir: &Path) -> Res<()> {
    let raw: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let cfg: Qwen3Config = serde_json::from_value(raw.clone())?;
    let ckpt_dtype = match raw["torch_dtype"].as_str() {
        Some("bfloat16") => "bf16",
        Some("float16") => "f16",
        _ => "f32",
    };
    let dt = a.dtype.clone().unwrap_or_else(|| ckpt_dtype.to_string());
    let dtype = parse_dtype(&dt);
    let dev = device_name();
    eprintln!("device {dev}; checkpoint {} ({ckpt_dtype}), compute dtype {dt}", dir.display());
    for k in ["OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH"] {
        eprintln!("  {k}={}", std::env::var(k).unwrap_or_else(|_| "(unset)".into()));
    }

    let t = Instant::now();
    let kv_cache = match a.kv.as_str() {
        "flat" => mlx_models::KvCacheMode::Flat,
        "paged" => mlx_models::KvCacheMode::Paged(Default::default()),
        other => return Err(format!("--kv {other:?}: expected flat or paged").into()),
    };
    eprintln!("ours: {} KV cache", a.kv);
    let model = load_model(dir, &LoadOptions { dtype: Some(dtype), kv_cache, ..Default::default() })?.into_lm()?;
    let vocab = model.info().vocab_size;
    eprintln!("ours: loaded (lazy) in {:.2} s", t.elapsed().as_secs_f64());
    let mut theirs = if a.no_mlx_lm { None } else { Some(Theirs::start(a, dir, &dt)?) };
    if let Some(t) = &theirs {
        eprintln!("mlx-lm: {}", t.info);
    }

    // requests: (prompt, gen)
    let reqs: Vec<(usize, usize)> = a.prompts.iter().enumerate().map(|(i, &p)| (p, if i == 0 { a.gen } else { 1 })).collect();
    let prompts: Vec<Vec<u32>> = reqs.iter().map(|&(p, _)| prompt_ids(p, vocab)).collect();

    // warm-up: weights paged in / evaluated, kernels compiled (both sides). On the GPU every
    // request shape once (JIT kernels per shape); on the CPU the first request only.
    let on_gpu = mlx_array::default_device().ok() == Some(mlx_array::Device::Gpu);
    for (i, p) in prompts.iter().enumerate().take(if on_gpu { prompts.len() } else { 1 }) {
        let g = reqs[i].1.min(8);
        let t = Instant::now();
        run_ours(&model, p, g)?;
        eprintln!("ours: warm-up P={} {:.2} s", p.len(), t.elapsed().as_secs_f64());
        if let Some(th) = theirs.as_mut() {
            let t = Instant::now();
            th.run(p, g)?;
            eprintln!("mlx-lm: warm-up P={} {:.2} s", p.len(), t.elapsed().as_secs_f64());
        }
    }

    let mut ours: Vec<Vec<Run>> = vec![vec![]; reqs.len()];
    let mut mlxlm: Vec<Vec<Run>> = vec![vec![]; reqs.len()];
    for r in 0..a.runs {
        for (i, &(p, g)) in reqs.iter().enumerate() {
            let o = run_ours(&model, &prompts[i], g)?;
            eprintln!(
                "run {} P={p} gen={g} ours:   ttft {:8.1} ms  prefill {:8.1} tok/s  decode {:7.2} tok/s  peak {:.3} GB",
                r + 1,
                o.ttft_ms,
                o.prefill_tps,
                o.decode_tps,
                o.peak_bytes / 1e9
            );
            ours[i].push(o);
            if let Some(th) = theirs.as_mut() {
                let m = th.run(&prompts[i], g)?;
                eprintln!(
                    "run {} P={p} gen={g} mlx-lm: ttft {:8.1} ms  prefill {:8.1} tok/s  decode {:7.2} tok/s  peak {:.3} GB",
                    r + 1,
                    m.ttft_ms,
                    m.prefill_tps,
                    m.decode_tps,
                    m.peak_bytes / 1e9
                );
                mlxlm[i].push(m);
            }
        }
    }

    // greedy agreement on the decode request (same weights, same ids: tokens should match)
    let agree = if theirs.is_some() {
        let (o, m) = (&ours[0][0].tokens, &mlxlm[0][0].tokens);
        let same = o.iter().zip(m).take_while(|(x, y)| x == y).count();
        Some((same, o.len().min(m.len())))
    } else {
        None
    };

    let bw = if a.bandwidth { Some(copy_bandwidth()?) } else { None };

    // ---- table
    let mut out = String::new();
    let theirs_info = theirs.as_ref().map(|t| t.info.clone()).unwrap_or(Value::Null);
    out += &format!(
        "\n### {} ({:.3} B params, {dt}), device {dev}\n\nmedian of {} alternating runs (min–max in brackets); ratio = ours / mlx-lm (>1: we are faster; for TTFT and memory <1 is better); best = fastest run of each side\n\n",
        dir.file_name().unwrap_or_default().to_string_lossy(),
        params(&cfg) as f64 / 1e9,
        a.runs
    );
    out += "| metric | ours | mlx-lm | ratio (median) | ratio (best) |\n|---|---|---|---|---|\n";
    // (name, ours, theirs, decimals, higher is better)
    let mut rows: Vec<(String, Stat, Option<Stat>, usize, bool)> = vec![];
    for (i, &(p, _)) in reqs.iter().enumerate() {
        let th = |f: &dyn Fn(&Run) -> f64| if mlxlm[i].is_empty() { None } else { Some(stat(&mlxlm[i], f)) };
        rows.push((format!("prefill tok/s (prompt {p})"), stat(&ours[i], |r| r.prefill_tps), th(&|r| r.prefill_tps), 1, true));
        rows.push((format!("TTFT ms (prompt {p})"), stat(&ours[i], |r| r.ttft_ms), th(&|r| r.ttft_ms), 1, false));
        if i == 0 {
            rows.push((format!("decode tok/s ({} new, prompt {p})", a.gen), stat(&ours[i], |r| r.decode_tps), th(&|r| r.decode_tps), 2, true));
        }
        rows.push((format!("peak memory GB (prompt {p})"), stat(&ours[i], |r| r.peak_bytes / 1e9), th(&|r| r.peak_bytes / 1e9), 3, false));
    }
    for (name, o, m, prec, higher) in &rows {
        // best = the fastest run of each side (noise on a shared machine only ever slows down)
        let (ms, ratio, best) = match m {
            Some(m) => {
                let best = if *higher { o.max / m.max } else { o.min / m.min };
                (fmt_stat(m, *prec), format!("{:.2}", o.med / m.med), format!("{best:.2}"))
            }
            None => ("—".into(), "—".into(), "—".into()),
        };
        out += &format!("| {name} | {} | {ms} | {ratio} | {best} |\n", fmt_stat(o, *prec));
    }
    if let Some((same, n)) = agree {
        out += &format!("\ngreedy tokens identical for the first {same} of {n} (run 1, prompt {})\n", reqs[0].0);
    }
    if let Some(bw) = bw {
        // bytes read per decoded token: every weight once (the embedding table only as the tied
        // head, its row gather is negligible), plus K and V of the mean context.
        let h = cfg.hidden_size;
        let wbytes = (params(&cfg) - if cfg.tie_word_embeddings { 0 } else { cfg.vocab_size * h }) * dtype_bytes(dtype);
        let ctx = reqs[0].0 + a.gen / 2;
        let kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim() * ctx * dtype_bytes(dtype);
        let floor_tps = bw / (wbytes + kv) as f64;
        let o = stat(&ours[0], |r| r.decode_tps).med;
        out += &format!(
            "\ncopy bandwidth {:.0} GB/s (y = x + 0, 1 GiB f32, read + write); bytes per token {:.3} GB weights + {:.1} MB KV → floor {:.1} tok/s; time per token: ours {:.2}x the floor{}\n",
            bw / 1e9,
            wbytes as f64 / 1e9,
            kv as f64 / 1e6,
            floor_tps,
            floor_tps / o,
            if mlxlm[0].is_empty() { String::new() } else { format!(", mlx-lm {:.2}x", floor_tps / stat(&mlxlm[0], |r| r.decode_tps).med) }
        );
    }
    println!("{out}");
    if let Some(path) = &a.json {
        let dump = |v: &Vec<Vec<Run>>| -> Value {
            json!(v.iter().map(|rs| rs.iter().map(|r| json!({"ttft_ms": r.ttft_ms, "prefill_tps": r.prefill_tps, "decode_tps": r.decode_tps, "peak_bytes": r.peak_bytes})).collect::<Vec<_>>()).collect::<Vec<_>>())
        };
        let j = json!({
            "model": dir, "dtype": dt, "device": dev, "requests": reqs, "runs": a.runs,
            "ours": dump(&ours), "mlx_lm": dump(&mlxlm), "mlx_lm_info": theirs_info,
            "copy_bandwidth_bytes_per_s": bw, "greedy_agreement": agree, "table_md": out,
        });
        std::fs::write(path, serde_json::to_string_pretty(&j)?)?;
    }
    Ok(())
}

fn main() {
    let a = parse_args();
    let r = if a.bandwidth_only {
        copy_bandwidth().map(|bw| println!("device {}: copy bandwidth {:.1} GB/s", device_name(), bw / 1e9))
    } else if let Some(name) = a.create.clone() {
        create(&a, &name)
    } else if let Some(dir) = a.model.clone() {
        bench(&a, &dir)
    } else {
        usage()
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
