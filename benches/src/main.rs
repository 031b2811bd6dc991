//! `llm_bench`: our runtime against mlx-lm, side by side, on one checkpoint.
//!
//! ```text
//! llm_bench --model DIR [--dtype f32|bf16] [--runs 3] [--gen 128] [--prompts 128,2048]
//!           [--python PATH] [--no-mlx-lm] [--json FILE] [--bandwidth]
//!           [--fuse on|off|auto] [--cpu-fusion on|off] [--kv flat|paged] [--peer-blas same|openblas]
//!           [--quantized auto|keep|dequantize]
//! llm_bench --create-random SHAPE [--dtype f32|bf16] [--out DIR]
//!   SHAPE: FAMILY-PRESET from the registry: qwen3-tiny qwen3-small qwen3-0.6b qwen3-8b qwen3_5-small
//!          lfm2-small lfm2-moe-small
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
//! On the CPU it runs with `LD_PRELOAD` = mlx-sys's BLAS router and the system OpenBLAS, the
//! BLAS our libmlx uses (`--peer-blas openblas`: OpenBLAS alone, a stock mlx-lm on OpenBLAS);
//! env `MLX_LM_PRELOAD` overrides ("" = none). Every request (warm-up included) gets its own
//! first prompt id, on both sides, so a paged cache never serves a request from another's
//! cached prefix (`--kv paged` would otherwise time prefix-cache hits, not prefills).
//!
//! `--bandwidth` also measures device copy bandwidth (`y = x + 0` on a 1 GiB array: 2 GiB moved)
//! and prints the decode floor: bytes of weights (and KV, recurrent state) read per token / copy
//! bandwidth.
//!
//! Any family both loaders read works (our `load_model`, mlx-lm's `mlx_lm.load`): Qwen3, Qwen3.5
//! dense/MoE, Gemma 4, LFM2/LFM2-MoE. Parameters are counted from the safetensors headers, the
//! layer layout (attention, sliding, KV-shared, recurrent) comes from the model's cache spec.
//! `--kv paged` on a hybrid family pages its attention layers only (printed as a note).
mod shared;

use mlx_array::{memory, DType};
use mlx_models::{generate, load_model, GenerateConfig, LayerKind, LoadOptions, Model};
use sampling::SamplingConfig;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Our runtime against mlx-lm on one checkpoint (see the crate docs for what is timed).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "llm_bench", after_help = AFTER_HELP)]
struct Args {
    /// Checkpoint directory to benchmark.
    #[arg(long, required_unless_present_any = ["create", "bandwidth_only"])]
    model: Option<PathBuf>,
    /// Compute dtype (f32 | bf16; default: the loader's).
    #[arg(long)]
    dtype: Option<String>,
    /// KV cache of our side: flat (like mlx-lm's KVCache) or paged.
    #[arg(long, default_value = "flat", value_parser = ["flat", "paged"])]
    kv: String,
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// New tokens of the decode request.
    #[arg(long, default_value_t = 128)]
    gen: usize,
    /// Prompt lengths, comma-separated: the first also decodes, the others prefill only.
    #[arg(long, value_delimiter = ',', default_value = "128,2048")]
    prompts: Vec<usize>,
    /// Python with mlx-lm (default: $MLX_LM_PYTHON, /tmp/mlxlm/bin/python, else python3).
    #[arg(long, env = "MLX_LM_PYTHON")]
    python: Option<String>,
    /// The mlx-lm side's script (default: benches/mlx_lm_bench.py).
    #[arg(long)]
    script: Option<PathBuf>,
    /// Time our side only.
    #[arg(long)]
    no_mlx_lm: bool,
    /// Also write the figures as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write a random checkpoint FAMILY-PRESET from the registry (qwen3-small, qwen3-0.6b,
    /// qwen3_5-moe-small, gemma4-small, lfm2-small, ...) and exit.
    #[arg(long = "create-random", value_name = "SHAPE")]
    create: Option<String>,
    /// Where --create-random writes (default ~/.cache/mlx-models/bench/SHAPE-DTYPE).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also measure device copy bandwidth and print the decode floor.
    #[arg(long)]
    bandwidth: bool,
    /// Only measure device copy bandwidth.
    #[arg(long)]
    bandwidth_only: bool,
    /// Seed of --create-random.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// LoadOptions::fuse_projections: on, off, or auto (GPU only).
    #[arg(long, default_value = "auto", value_parser = ["on", "off", "auto"])]
    fuse: String,
    /// Whether the CPU backend fuses elementwise chains (mlx_array::CpuFusion; off by default).
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    cpu_fusion: String,
    /// The BLAS preloaded into mlx-lm on the CPU: same (our BLAS router and OpenBLAS, the BLAS
    /// ours runs) or openblas (OpenBLAS alone, a stock mlx-lm with OpenBLAS).
    #[arg(long, default_value = "same", value_parser = ["same", "openblas"])]
    peer_blas: String,
    /// LoadOptions::quantized for a quantized checkpoint (our side): auto, keep (packed), or
    /// dequantize (into the compute dtype at load).
    #[arg(long, value_enum, default_value = "auto")]
    quantized: QuantizedArg,
}

/// `--quantized`: [`mlx_models::QuantizedWeights`].
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum QuantizedArg {
    Auto,
    Keep,
    Dequantize,
}

impl From<QuantizedArg> for mlx_models::QuantizedWeights {
    fn from(q: QuantizedArg) -> Self {
        match q {
            QuantizedArg::Auto => mlx_models::QuantizedWeights::Auto,
            QuantizedArg::Keep => mlx_models::QuantizedWeights::Keep,
            QuantizedArg::Dequantize => mlx_models::QuantizedWeights::Dequantize,
        }
    }
}

const AFTER_HELP: &str = "env: MLX_LM_PRELOAD (LD_PRELOAD for mlx-lm, overrides --peer-blas)";

/// `--fuse` as LoadOptions::fuse_projections.
fn fuse_option(s: &str) -> Option<bool> {
    match s {
        "on" => Some(true),
        "off" => Some(false),
        _ => None,
    }
}

/// A bad value found after parsing (a dtype, a shape name): print usage and exit 2.
fn usage() -> ! {
    use clap::CommandFactory;
    let _ = Args::command().print_help();
    std::process::exit(2)
}

fn parse_args() -> Args {
    <Args as clap::Parser>::parse()
}

fn parse_dtype(s: &str) -> DType {
    shared::dtype(s).unwrap_or_else(|| usage())
}

fn device_name() -> String {
    format!("{:?}", mlx_array::default_device().map_err(|e| e.to_string()))
}

// ------------------------------------------------------------------ random checkpoints

/// A `--create-random` name, `FAMILY-PRESET` (`qwen3-small`, `qwen3_5-moe-small`, `qwen3-0.6b`):
/// the family's model type (dashes inside it spelled as underscores) and the preset's config.
fn shape(name: &str) -> Option<(&'static str, Value)> {
    let (family, preset) = name.rsplit_once('-')?;
    let f = mlx_models::registry::family(&family.replace('-', "_"))?;
    Some((f.model_type, f.preset(preset)?))
}

/// Every `FAMILY-PRESET` name of the registry.
fn shape_names() -> Vec<String> {
    mlx_models::registry::FAMILIES.iter().flat_map(|f| f.presets.iter().map(move |(p, _)| format!("{}-{p}", f.model_type.replace("_moe", "-moe")))).collect()
}

/// One tensor of a checkpoint, from the safetensors headers.
struct TensorInfo {
    name: String,
    numel: usize,
    bytes: usize,
    /// safetensors dtype (`BF16`, `U32`, ...).
    dtype: String,
}

/// Every tensor of `dir/model*.safetensors` (the files both loaders read), from the headers only.
fn checkpoint_tensors(dir: &Path) -> Res<Vec<TensorInfo>> {
    use std::io::Read;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors")))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("no model*.safetensors in {}", dir.display()).into());
    }
    let mut out = Vec::new();
    for f in files {
        let mut r = std::fs::File::open(&f)?;
        let mut len = [0u8; 8];
        r.read_exact(&mut len)?;
        let mut hdr = vec![0u8; u64::from_le_bytes(len) as usize];
        r.read_exact(&mut hdr)?;
        let v: Value = serde_json::from_slice(&hdr)?;
        for (name, t) in v.as_object().ok_or("bad safetensors header")? {
            if name == "__metadata__" {
                continue;
            }
            let numel = t["shape"].as_array().ok_or("bad safetensors header")?.iter().map(|d| d.as_u64().unwrap_or(0) as usize).product();
            let off = t["data_offsets"].as_array().ok_or("bad safetensors header")?;
            let bytes = (off[1].as_u64().unwrap_or(0) - off[0].as_u64().unwrap_or(0)) as usize;
            let dtype = t["dtype"].as_str().unwrap_or("").to_string();
            out.push(TensorInfo { name: name.clone(), numel, bytes, dtype });
        }
    }
    Ok(out)
}

/// Parameters (all tensors; an MLX-quantized weight counts its unpacked elements, its scales
/// and biases none), the parameters read per decoded token, and the bytes read per decoded token
/// with float tensors at `b` bytes an element (the compute dtype) and quantized layers' packed
/// weights, scales and biases as stored. Read per token: everything but the embedding tables (a
/// row gather; the table counts when it is also the tied head) and the MTP head, with
/// routed-expert tensors scaled by top_k / experts (a batch-1 token reads k experts).
/// `quant`: config.json's `quantization` (default `bits` and per-layer entries).
fn param_counts(tensors: &[TensorInfo], text_cfg: &Value, quant: Option<&Value>, b: usize) -> (usize, f64, f64) {
    let names: std::collections::HashSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    // (layer of a quantized tensor, whether it is the packed weight)
    let quantized = |n: &str| -> Option<(String, bool)> {
        let (layer, part) = n.rsplit_once('.')?;
        (matches!(part, "weight" | "scales" | "biases") && names.contains(format!("{layer}.scales").as_str())).then(|| (layer.to_string(), part == "weight"))
    };
    let bits_of = |layer: &str| -> usize {
        let q = quant.and_then(|q| q.get(layer)).filter(|v| v.is_object()).or(quant);
        q.and_then(|q| q["bits"].as_u64()).unwrap_or(4).max(1) as usize
    };
    let untied = tensors.iter().any(|t| t.name.ends_with("lm_head.weight"));
    let n_exp = text_cfg["num_experts"].as_u64().unwrap_or(0) as f64;
    let top_k = text_cfg.get("num_experts_per_tok").or_else(|| text_cfg.get("top_k_experts")).and_then(|v| v.as_u64()).unwrap_or(0) as f64;
    let (mut total, mut per_token, mut bytes) = (0usize, 0.0, 0.0);
    for t in tensors {
        let n = &t.name;
        let q = quantized(n);
        let params = match &q {
            Some((layer, true)) if t.dtype == "U32" => t.numel * 32 / bits_of(layer),
            Some(_) => 0,
            None => t.numel,
        };
        total += params;
        if n.contains("embed_tokens_per_layer") || n.starts_with("mtp.") || (n.contains("embed_tokens.") && untied) {
            continue;
        }
        let frac = if n.contains(".experts.") && n_exp > 0.0 && top_k > 0.0 { top_k / n_exp } else { 1.0 };
        per_token += params as f64 * frac;
        bytes += if q.is_some() { t.bytes as f64 } else { (t.numel * b) as f64 } * frac;
    }
    (total, per_token, bytes)
}

fn cache_root() -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/tmp".into());
    PathBuf::from(home).join(".cache/mlx-models/bench")
}

/// mlx-lm 0.32.2 has no `qwen3_5_text` / `qwen3_5_moe_text` module: it reads a flat (text-only)
/// Qwen3.5 config under `qwen3_5` / `qwen3_5_moe` (both aliases of the same family for us). It
/// also takes rope settings only from `rope_parameters` (default θ 1e5), so spell them out.
fn qwen35_config_for_both(dir: &Path, moe: bool) -> Res<()> {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p)?)?;
    let o = v.as_object_mut().ok_or("config.json is not an object")?;
    o.insert("model_type".into(), if moe { "qwen3_5_moe" } else { "qwen3_5" }.into());
    let rp = json!({"rope_type": "default", "rope_theta": o["rope_theta"].clone(), "partial_rotary_factor": o["partial_rotary_factor"].clone()});
    o.insert("rope_parameters".into(), rp);
    let tmp = p.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&v)?)?;
    std::fs::rename(&tmp, &p)?;
    Ok(())
}

fn create(a: &Args, name: &str) -> Res<()> {
    let Some((family, config)) = shape(name) else {
        eprintln!("unknown shape {name:?}; known: {}", shape_names().join(", "));
        usage()
    };
    let dt = a.dtype.as_deref().unwrap_or("bf16");
    let dtype = parse_dtype(dt);
    let dir = a.out.clone().unwrap_or_else(|| cache_root().join(format!("{name}-{dt}")));
    eprintln!("creating random {name} in {} ({dt}) on {} ...", dir.display(), device_name());
    let t = Instant::now();
    mlx_models::create_random_checkpoint(&config, &dir, dtype, a.seed)?;
    if family.starts_with("qwen3_5") {
        qwen35_config_for_both(&dir, family == "qwen3_5_moe")?;
    }
    let tensors = checkpoint_tensors(&dir)?;
    let raw: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let (n, per_tok, _) = param_counts(&tensors, &mlx_models::config::text_config(&raw), raw.get("quantization"), dtype_bytes(dtype));
    let bytes: usize = tensors.iter().map(|t| t.bytes).sum();
    eprintln!(
        "created in {:.1} s: {} ({:.3} B params, {:.3} B read per decoded token; {:.2} GB of {dt} tensors)",
        t.elapsed().as_secs_f64(),
        raw["model_type"].as_str().unwrap_or("?"),
        n as f64 / 1e9,
        per_tok / 1e9,
        bytes as f64 / 1e9
    );
    println!("{}", dir.display());
    Ok(())
}

/// Bytes of recurrent state one recurrent layer reads and writes per decoded token.
fn recurrent_state_bytes(cfg: &Value, b: usize) -> usize {
    let u = |k: &str| cfg[k].as_u64().unwrap_or(0) as usize;
    if cfg.get("linear_num_value_heads").is_some() {
        // GatedDeltaNet: f32 state [Hv, Dk, Dv] read + written; conv window (K - 1) x conv_dim
        let (hk, hv, dk, dv, k) = (u("linear_num_key_heads"), u("linear_num_value_heads"), u("linear_key_head_dim"), u("linear_value_head_dim"), u("linear_conv_kernel_dim"));
        2 * hv * dk * dv * 4 + k.saturating_sub(1) * (2 * hk * dk + hv * dv) * b
    } else {
        // LFM2 short conv: window (L - 1) x hidden
        u("conv_L_cache").saturating_sub(1) * u("hidden_size") * b
    }
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

fn run_ours(model: &Model, prompt: &[u32], gen: usize) -> Res<Run> {
    let mut cache = model.new_cache();
    memory::reset_peak()?;
    let cfg = GenerateConfig { max_new_tokens: gen, sampling: SamplingConfig::greedy(), prefill_step_size: 2048, stop_tokens: Some(vec![]), context: Vec::new() };
    let t0 = Instant::now();
    let (mut t_first, mut t_last) = (None, 0.0);
    let mut tokens = Vec::with_capacity(gen);
    {
        let g = generate(model, &mut cache, prompt, cfg)?;
        for t in g {
            let t = t?;
            let now = t0.elapsed().as_secs_f64();
            t_first.get_or_insert(now);
            t_last = now;
            tokens.push(t.id);
        }
    }
    // The generator queues the step after the last token: let it finish before the next request.
    cache.eval_with(&[])?;
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
        // The PyPI mlx-cpu wheel bundles reference BLAS; ours links OpenBLAS behind mlx-sys's
        // BLAS router (mlx-sys symlinks the bundled names to it). Give mlx-lm the same BLAS by
        // preloading the router and OpenBLAS (`--peer-blas openblas`: OpenBLAS alone, what a
        // stock mlx-lm install with OpenBLAS gets; MLX_LM_PRELOAD overrides both; "" for none).
        let preload = std::env::var("MLX_LM_PRELOAD").unwrap_or_else(|_| {
            let p = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0";
            if mlx_array::default_device().ok() != Some(mlx_array::Device::Cpu) || !Path::new(p).exists() {
                return String::new();
            }
            match (a.peer_blas.as_str(), mlx_sys::blas_router_path()) {
                ("same", Some(r)) => format!("{} {p}", r.display()),
                _ => p.into(),
            }
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
    let text_cfg = mlx_models::config::text_config(&raw);
    let tensors = checkpoint_tensors(dir)?;
    let ckpt_dtype = match raw.get("torch_dtype").or_else(|| raw.get("dtype")).and_then(|v| v.as_str()) {
        Some("bfloat16") => "bf16",
        Some("float16") => "f16",
        _ => "f32",
    };
    let dt = a.dtype.clone().unwrap_or_else(|| ckpt_dtype.to_string());
    let dtype = parse_dtype(&dt);
    let (n_params, _, per_token_bytes) = param_counts(&tensors, &text_cfg, raw.get("quantization"), dtype_bytes(dtype));
    let dev = device_name();
    eprintln!("device {dev}; checkpoint {} ({ckpt_dtype}), compute dtype {dt}", dir.display());
    for k in ["OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH"] {
        eprintln!("  {k}={}", std::env::var(k).unwrap_or_else(|_| "(unset)".into()));
    }

    let t = Instant::now();
    let kv_cache = shared::kv_cache(&a.kv).ok_or_else(|| format!("--kv {:?}: expected flat or paged", a.kv))?;
    eprintln!("ours: {} KV cache", a.kv);
    let model = load_model(dir, &LoadOptions { dtype: Some(dtype), kv_cache, fuse_projections: fuse_option(&a.fuse), quantized: a.quantized.into(), ..Default::default() })
        .map_err(|e| format!("our loader, {} ({} KV cache): {e}", dir.display(), a.kv))?
        .into_lm()?;
    let vocab = model.info().vocab_size;
    let spec = model.with_runtime(|rt| rt.cache_spec());
    let n_recurrent = spec.layers.iter().filter(|k| matches!(k, LayerKind::Recurrent { .. })).count();
    let n_kv = spec.layers.len() - n_recurrent;
    let n_shared = spec.layers.iter().filter(|k| matches!(k, LayerKind::SharedKv { .. })).count();
    let n_sliding = spec.layers.iter().filter(|k| matches!(k, LayerKind::SlidingAttention { .. })).count();
    eprintln!(
        "ours: {} ({} layers: {n_kv} attention ({n_sliding} sliding with own K/V, {n_shared} KV-shared), {n_recurrent} recurrent), vocab {vocab}, {:.3} B params",
        model.info().model_type,
        spec.layers.len(),
        n_params as f64 / 1e9
    );
    if a.kv == "paged" {
        eprintln!("note: --kv paged: our peak memory includes the block pool (it grows to the most blocks live at once, and keeps finished requests' blocks as prefix cache in what it holds)");
    }
    if a.kv == "paged" && n_recurrent > 0 {
        // Hybrid families page only their attention layers (opt-in, no prefix sharing across
        // requests: a recurrent state cannot be rebuilt from shared blocks). mlx-lm always uses
        // its own KVCache + ArraysCache, so this compares a paged runtime against a flat one.
        eprintln!(
            "note: {} is a hybrid family: --kv paged pages its {n_kv} attention layers only; its {n_recurrent} recurrent layers keep per-sequence state, and no prefix is shared between requests",
            model.info().model_type
        );
    }
    eprintln!("ours: loaded in {:.2} s (weights read and computed, as mlx-lm's load does)", t.elapsed().as_secs_f64());
    let mut theirs = if a.no_mlx_lm { None } else { Some(Theirs::start(a, dir, &dt)?) };
    if let Some(t) = &theirs {
        eprintln!("mlx-lm: {}", t.info);
    }

    // requests: (prompt, gen)
    let reqs: Vec<(usize, usize)> = a.prompts.iter().enumerate().map(|(i, &p)| (p, if i == 0 { a.gen } else { 1 })).collect();
    let prompts: Vec<Vec<u32>> = reqs.iter().map(|&(p, _)| shared::prompt_ids(p, vocab)).collect();
    // Every request (warm-up included) gets its own first id, so no request starts with another's
    // prefix: the paged cache would serve it from its prefix blocks (chained hashes: a different
    // first id changes every block's hash) and the table would time a cache hit, not a prefill.
    let mut salt = 0usize;
    let mut fresh = |p: &[u32]| -> Vec<u32> {
        salt += 1;
        let mut v = p.to_vec();
        let span = (vocab - 100).min(30000);
        v[0] = ((v[0] as usize - 10 + salt) % span + 10) as u32;
        v
    };

    // warm-up: weights paged in / evaluated, kernels compiled (both sides). On the GPU every
    // request shape once (JIT kernels per shape); on the CPU the first request only.
    let on_gpu = mlx_array::default_device().ok() == Some(mlx_array::Device::Gpu);
    for (i, p) in prompts.iter().enumerate().take(if on_gpu { prompts.len() } else { 1 }) {
        let g = reqs[i].1.min(8);
        let p = &fresh(p);
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
            let ids = fresh(&prompts[i]);
            let o = run_ours(&model, &ids, g)?;
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
                let m = th.run(&ids, g)?;
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
        n_params as f64 / 1e9,
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
        // bytes read per decoded token: every weight once (quantized layers as stored: packed
        // weights, scales and biases; embedding tables only as the tied
        // head, their row gathers are negligible; routed experts k of E), plus K and V of the mean
        // context (sliding layers at most their window; KV-shared layers read their anchor's
        // again), plus recurrent state (Qwen3.5's f32 delta-rule state read and written, the conv
        // windows).
        let b = dtype_bytes(dtype);
        let wbytes = per_token_bytes as usize;
        let ctx = reqs[0].0 + a.gen / 2;
        let kv_of = |k: &LayerKind| match *k {
            LayerKind::Attention { kv_heads, head_dim } => 2 * kv_heads * head_dim * ctx * b,
            LayerKind::SlidingAttention { kv_heads, head_dim, window } => 2 * kv_heads * head_dim * ctx.min(window) * b,
            _ => 0,
        };
        let kv: usize = spec.layers.iter().map(|k| if let LayerKind::SharedKv { anchor } = k { kv_of(&spec.layers[*anchor]) } else { kv_of(k) }).sum();
        let state = n_recurrent * recurrent_state_bytes(&text_cfg, b);
        let kv = kv + state;
        let floor_tps = bw / (wbytes + kv) as f64;
        let o = stat(&ours[0], |r| r.decode_tps).med;
        out += &format!(
            "\ncopy bandwidth {:.0} GB/s (y = x + 0, 1 GiB f32, read + write); bytes per token {:.3} GB weights + {:.1} MB KV and recurrent state ({:.1} MB of it state) → floor {:.1} tok/s; time per token: ours {:.2}x the floor{}\n",
            bw / 1e9,
            wbytes as f64 / 1e9,
            kv as f64 / 1e6,
            state as f64 / 1e6,
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
            "greedy_tokens": {"ours": ours[0].first().map(|r| r.tokens.clone()), "mlx_lm": mlxlm[0].first().map(|r| r.tokens.clone())},
        });
        std::fs::write(path, serde_json::to_string_pretty(&j)?)?;
    }
    Ok(())
}

fn main() {
    let a = parse_args();
    mlx_array::ops::set_cpu_fusion(if a.cpu_fusion == "on" { mlx_array::ops::CpuFusion::On } else { mlx_array::ops::CpuFusion::Off });
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

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, numel: usize, bytes: usize, dtype: &str) -> TensorInfo {
        TensorInfo { name: name.into(), numel, bytes, dtype: dtype.into() }
    }

    /// A quantized layer counts its unpacked weights as parameters and its stored bytes (packed
    /// weight, scales, biases) as read per token; float tensors count at the compute dtype; an
    /// untied embedding table is not read per token.
    #[test]
    fn quantized_layers_count_their_stored_bytes() {
        // 4-bit in groups of 64 by default, one 8-bit layer; [128, 256] weights, bf16 scales
        let q4 = [t("model.layers.0.mlp.up_proj.weight", 128 * 32, 128 * 32 * 4, "U32"), t("model.layers.0.mlp.up_proj.scales", 128 * 4, 128 * 4 * 2, "BF16"), t("model.layers.0.mlp.up_proj.biases", 128 * 4, 128 * 4 * 2, "BF16")];
        let q8 = [t("model.layers.0.mlp.down_proj.weight", 128 * 64, 128 * 64 * 4, "U32"), t("model.layers.0.mlp.down_proj.scales", 128 * 4, 1024, "BF16"), t("model.layers.0.mlp.down_proj.biases", 128 * 4, 1024, "BF16")];
        let emb = [t("model.embed_tokens.weight", 1000 * 32, 1000 * 32 * 4, "U32"), t("model.embed_tokens.scales", 1000 * 4, 8000, "BF16"), t("model.embed_tokens.biases", 1000 * 4, 8000, "BF16")];
        let mut all: Vec<TensorInfo> = q4.into_iter().chain(q8).chain(emb).collect();
        all.push(t("model.norm.weight", 256, 512, "BF16"));
        all.push(t("lm_head.weight", 1000 * 256, 1000 * 256 * 2, "BF16"));
        let quant = json!({"group_size": 64, "bits": 4, "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8}});
        let (n, per_tok, bytes) = param_counts(&all, &json!({}), Some(&quant), 2);
        assert_eq!(n, 128 * 256 * 2 + 1000 * 256 + 256 + 1000 * 256);
        assert_eq!(per_tok, (128 * 256 * 2 + 256 + 1000 * 256) as f64);
        let q_bytes = 128 * 32 * 4 + 2 * 1024 + 128 * 64 * 4 + 2 * 1024;
        assert_eq!(bytes, (q_bytes + 512 + 1000 * 256 * 2) as f64);
        // computed in f32, float tensors read 4 bytes an element; quantized ones stay as stored
        let (_, _, bytes32) = param_counts(&all, &json!({}), Some(&quant), 4);
        assert_eq!(bytes32, (q_bytes + 1024 + 1000 * 256 * 4) as f64);
    }
}
