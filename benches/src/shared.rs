//! Pieces the bench binaries share (`llm_bench`, and `src/bin/*` through `#[path]`).
use mlx_array::DType;

/// A `--dtype` value: `f32`, `bf16`, `f16` (or their long names).
pub fn dtype(s: &str) -> Option<DType> {
    match s {
        "f32" | "float32" => Some(DType::F32),
        "bf16" | "bfloat16" => Some(DType::BF16),
        "f16" | "float16" => Some(DType::F16),
        _ => None,
    }
}

/// A `--kv` value: `flat` or `paged` (the paged cache with its default settings).
pub fn kv_cache(s: &str) -> Option<mlx_models::KvCacheMode> {
    match s {
        "flat" => Some(mlx_models::KvCacheMode::Flat),
        "paged" => Some(mlx_models::KvCacheMode::Paged(Default::default())),
        _ => None,
    }
}

/// llm_bench's prompt of `n` ids (the same formula as mlx_lm_bench.py and
/// shared/tools/bench_mlx_lm.py).
#[allow(dead_code)] // not every binary that includes this module uses it
pub fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % (vocab - 100).min(30000) + 10) as u32).collect()
}

/// The index of the first largest value (NaN never wins).
/// The median of `iters` (at least 1) timings of `f` in ms, after `warm` untimed calls.
#[allow(dead_code)]
pub fn median_ms<E>(warm: usize, iters: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    for _ in 0..warm {
        f()?;
    }
    let mut v = Vec::with_capacity(iters.max(1));
    for _ in 0..iters.max(1) {
        let t = std::time::Instant::now();
        f()?;
        v.push(t.elapsed().as_secs_f64() * 1e3);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

#[allow(dead_code)]
pub fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold(0, |best, (j, &x)| if x > v[best] { j } else { best })
}

/// How many values are NaN or infinite.
#[allow(dead_code)]
pub fn non_finite(v: &[f32]) -> usize {
    v.iter().filter(|x| !x.is_finite()).count()
}

/// The checkpoint options of the single-model probes (`decode_profile`, `logits_probe`).
#[derive(clap::Args)]
pub struct ModelArgs {
    /// Checkpoint directory.
    #[arg(long)]
    pub model: String,
    /// Compute dtype: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Prompt tokens.
    #[arg(long, default_value_t = 128)]
    pub prompt: usize,
    /// KV cache: flat or paged.
    #[arg(long, default_value = "flat")]
    pub kv: String,
    /// Projections of one input as one product (`LoadOptions::fuse_projections`): on or off
    /// (default: on a GPU only).
    #[arg(long)]
    pub fuse_projections: Option<Switch>,
    /// On a GPU, pad few-query attention's keys to a multiple of this many
    /// (`mlx_array::ops::set_gpu_attention_key_bucket`; 0: no padding).
    #[arg(long, default_value_t = 0)]
    pub key_bucket: usize,
}

/// `on` or `off`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
}

#[allow(dead_code)] // llm_bench includes this module without the probes' arguments
impl ModelArgs {
    /// The load options `--dtype`, `--kv` and `--fuse-projections` ask for, and that dtype;
    /// sets `--key-bucket` process-wide (every probe loads through here).
    pub fn load_options(&self) -> Result<(mlx_models::LoadOptions, DType), Box<dyn std::error::Error>> {
        let dt = dtype(&self.dtype).ok_or_else(|| format!("unknown dtype {}", self.dtype))?;
        let kv_cache = kv_cache(&self.kv).ok_or_else(|| format!("--kv {:?}: expected flat or paged", self.kv))?;
        let fuse_projections = self.fuse_projections.map(|f| matches!(f, Switch::On));
        mlx_array::ops::set_gpu_attention_key_bucket(self.key_bucket);
        Ok((mlx_models::LoadOptions { dtype: Some(dt), kv_cache, fuse_projections, ..Default::default() }, dt))
    }

    /// The checkpoint loaded as a causal LM with `--dtype` and `--kv`, and that dtype.
    pub fn load_lm(&self) -> Result<(mlx_models::Model, DType), Box<dyn std::error::Error>> {
        let (opts, dt) = self.load_options()?;
        Ok((mlx_models::load_model(&self.model, &opts)?.into_lm()?, dt))
    }
}
