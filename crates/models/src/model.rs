//! Loading checkpoints into runnable, thread-safe handles.
use crate::cache::Cache;
use crate::config;
use crate::families::harrier::HarrierModel;
use crate::registry::{self, Built, Family, KvDefault, LoadContext};
use crate::runtime::{ForwardOutput, Logits, ModelInfo, ModelRuntime};
use crate::weights::Weights;
use crate::{ModelError, Result};
use mlx_array::{Array, DType};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Options for [`load_model`].
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Compute dtype of float weights. Default: f32 on the CPU (MLX-CPU's bf16 matmul is 10-20x
    /// slower than f32 with a real BLAS), the checkpoint's dtype on the GPU.
    pub dtype: Option<DType>,
    /// Flat or paged KV cache for attention layers.
    pub kv_cache: KvCacheMode,
    /// Run projections of the same input (q/k/v, gate/up, GatedDeltaNet's inputs) as one
    /// matmul over concatenated weights. Default (`None`): on the GPU only, where fewer, larger
    /// products measured faster; on the CPU separate OpenBLAS products measured as fast.
    pub fuse_projections: Option<bool>,
    /// What to do with MLX-quantized layers (mlx-lm's layout).
    pub quantized: QuantizedWeights,
    /// Paged or flat per canonical family (`"qwen3_5"`, `"lfm2"`, ...: the registry's
    /// `model_type`), for [`KvCacheMode::Auto`]: an entry for the loaded family takes precedence
    /// over config.json's `use_block_paged_cache` and the family's default. An unknown family
    /// name is an error.
    pub force_paged: std::collections::BTreeMap<String, bool>,
    /// Tensor parallelism over this group's ranks (each rank runs the same load and the same
    /// calls; [`crate::layers::parallel`]): every rank reads and holds only its slices of the
    /// projections and of the vocabulary, and generation samples on rank 0 only. `None` (or a
    /// group of one): the whole model. Families: [`TENSOR_PARALLEL_FAMILIES`] (every causal LM).
    pub tensor_parallel: Option<mlx_array::distributed::Group>,
}

/// The families whose layers load sharded under [`LoadOptions::tensor_parallel`]; the others
/// refuse the option.
pub const TENSOR_PARALLEL_FAMILIES: &[&str] = &["qwen3", "llama", "qwen2", "gemma3", "lfm2", "lfm2_moe", "qwen3_5", "qwen3_5_moe", "gemma4"];

/// How a quantized checkpoint's layers run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum QuantizedWeights {
    /// [`QuantizedWeights::Keep`] on the GPU, and on the CPU when every quantized layer is in a
    /// format the CPU packed kernels take (affine 4 or 8-bit, mxfp4: decode reads the packed
    /// bytes, see [`mlx_array::ops::CPU_PACKED_NARROW_MAX_ROWS`] and BENCHMARKS.md, "Packed CPU
    /// kernels"); otherwise on the CPU [`QuantizedWeights::Dequantize`], as MLX's own CPU
    /// quantized matmul is slower than an f32 product over the dequantized weight.
    #[default]
    Auto,
    /// Keep the packed weights: products run `quantized_matmul` (resident bytes about bits/16
    /// of bf16's).
    Keep,
    /// Dequantize every quantized layer at load into the compute dtype.
    Dequantize,
}

/// Which KV cache a loaded model's sequences use.
#[derive(Debug, Clone, Default)]
pub enum KvCacheMode {
    /// The family's [`LoadOptions::force_paged`] entry when there is one, else
    /// `use_block_paged_cache` from config.json when present, else the family's default (paged
    /// for Qwen3, as in mlx-node; see the registry's `kv_default`).
    #[default]
    Auto,
    /// Contiguous per-sequence K/V, preallocated in steps (fastest on the CPU backend).
    Flat,
    /// The shared block pool of `kv-paged` (prefix sharing across sequences).
    Paged(crate::paged::PagedConfig),
}

impl KvCacheMode {
    /// `forced`: the [`LoadOptions::force_paged`] entry of the family.
    fn resolve(&self, config: &serde_json::Value, family_default: bool, forced: Option<bool>) -> Option<crate::paged::PagedConfig> {
        match self {
            KvCacheMode::Flat => None,
            KvCacheMode::Paged(c) => Some(c.clone()),
            KvCacheMode::Auto => match forced.or_else(|| config.get("use_block_paged_cache").and_then(|v| v.as_bool())).unwrap_or(family_default) {
                true => Some(crate::paged::PagedConfig {
                    block_size: config.get("paged_block_size").and_then(|v| v.as_u64()).map_or(16, |v| v as usize),
                    memory_mb: config.get("paged_cache_memory_mb").and_then(|v| v.as_f64()),
                    ..Default::default()
                }),
                false => None,
            },
        }
    }
}

/// A loaded causal LM: cheap to clone, `Send + Sync`; forward passes are serialized internally,
/// so sessions on several threads can share one model.
#[derive(Clone)]
pub struct Model {
    inner: Arc<Mutex<Box<dyn ModelRuntime>>>,
    paged: Option<Arc<Mutex<crate::paged::PagedKv>>>,
    info: Arc<ModelInfo>,
    dir: Arc<PathBuf>,
    /// The tensor-parallel group the model was loaded over.
    group: Option<mlx_array::distributed::Group>,
}

impl Model {
    /// Wrap any runtime (e.g. a model built in code).
    pub fn from_runtime(rt: Box<dyn ModelRuntime>, dir: impl Into<PathBuf>) -> Self {
        let info = Arc::new(rt.info().clone());
        Model { inner: Arc::new(Mutex::new(rt)), paged: None, info, dir: Arc::new(dir.into()), group: None }
    }

    /// The tensor-parallel group the model was loaded over ([`LoadOptions::tensor_parallel`]).
    pub fn tensor_parallel(&self) -> Option<&mlx_array::distributed::Group> {
        self.group.as_ref()
    }

    /// Give the model a shared paged KV pool: caches from [`Model::new_cache`] then live in it.
    pub fn with_paged_cache(mut self, cfg: &crate::paged::PagedConfig, dtype: DType) -> Result<Self> {
        let spec = self.with_runtime(|rt| rt.cache_spec());
        let kv = crate::paged::PagedKv::new(&spec, cfg, dtype, self.info.max_position_embeddings)?;
        self.paged = Some(Arc::new(Mutex::new(kv)));
        Ok(self)
    }

    /// Whether the checkpoint has MTP head weights (see [`ModelRuntime::has_mtp_weights`]).
    pub fn has_mtp_weights(&self) -> bool {
        self.with_runtime(|rt| rt.has_mtp_weights())
    }

    /// Block pool counters, when the model uses a paged cache.
    pub fn paged_stats(&self) -> Option<kv_paged::ManagerStats> {
        self.paged.as_ref().map(|p| p.lock().unwrap_or_else(|e| e.into_inner()).stats())
    }
    /// Bytes of K/V storage the paged pool holds now (it grows with use up to its budget), when
    /// the model uses a paged cache.
    pub fn paged_storage_bytes(&self) -> Option<usize> {
        self.paged.as_ref().map(|p| p.lock().unwrap_or_else(|e| e.into_inner()).storage_bytes())
    }
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }
    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// An empty cache laid out for this model.
    pub fn new_cache(&self) -> Cache {
        let spec = self.inner.lock().unwrap_or_else(|e| e.into_inner()).cache_spec();
        match &self.paged {
            Some(p) => Cache::new_paged(&spec, p.clone()),
            None => Cache::new(&spec),
        }
    }
    /// One forward pass (holding the model for its duration). Token ids are range-checked
    /// (one device sync); [`ModelRuntime::forward`] itself checks only shape and dtype.
    pub fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        crate::runtime::check_token_range(tokens, self.info.vocab_size)?;
        let rt = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        rt.forward(tokens, cache, logits, hidden)
    }
    /// Compute every array the runtime holds, on this thread, by one forward pass over a single
    /// token into a throwaway flat cache. Weights load lazily and layers derive arrays from
    /// them (fused projections, transposed experts, casts); MLX binds a lazy array to a stream
    /// of the thread that made it, so without this a forward call from any other thread would
    /// fail with "There is no Stream(.., ..) in current thread". [`load_model`] calls it.
    pub fn materialize(&self) -> Result<()> {
        let rt = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut cache = Cache::new(&rt.cache_spec());
        let mut run = |ids: &[u32]| -> Result<()> {
            let t = Array::from_slice(ids, &[1, ids.len()])?;
            let out = rt.forward(&t, &mut cache, Logits::Last, false)?;
            let mut arrays: Vec<&Array> = out.logits.iter().collect();
            arrays.extend(cache.arrays());
            Ok(mlx_array::eval(&arrays)?)
        };
        run(&[0])?;
        if !crate::layers::runs_on_cpu() && mlx_array::ops::cuda_few_row_kernels().any() {
            // two positions more: the few-row products and few-query attention kernels
            // (mlx_array::ops::cuda) of this model's shapes compile now, not at the first
            // verify step or short prompt (about 2 s each on first use, H100)
            run(&[0, 0])?;
        }
        Ok(())
    }
    /// Run `f` with exclusive use of the runtime.
    pub fn with_runtime<R>(&self, f: impl FnOnce(&dyn ModelRuntime) -> R) -> R {
        let rt = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(rt.as_ref())
    }
}

/// What [`load_model`] returns.
pub enum LoadedModel {
    Lm(Model),
    Embedding(Arc<HarrierModel>),
}

impl LoadedModel {
    /// The causal LM, or a [`ModelError::WrongKind`] for embedding models.
    pub fn into_lm(self) -> Result<Model> {
        match self {
            LoadedModel::Lm(m) => Ok(m),
            LoadedModel::Embedding(_) => Err(ModelError::WrongKind("embedding models (Harrier) cannot generate text".into())),
        }
    }
    pub fn into_embedding(self) -> Result<Arc<HarrierModel>> {
        match self {
            LoadedModel::Embedding(m) => Ok(m),
            LoadedModel::Lm(_) => Err(ModelError::WrongKind("not an embedding model".into())),
        }
    }
}

pub(crate) fn default_dtype(opts: &LoadOptions) -> Option<DType> {
    if opts.dtype.is_some() {
        return opts.dtype;
    }
    crate::layers::runs_on_cpu().then_some(DType::F32)
}

/// The group of a tensor-parallel load: [`LoadOptions::tensor_parallel`] unless it has one rank.
fn tensor_parallel(opts: &LoadOptions) -> Option<&mlx_array::distributed::Group> {
    opts.tensor_parallel.as_ref().filter(|g| g.size() > 1)
}

/// Load the checkpoint in `dir`, detecting its family from config.json (see [`registry`]).
pub fn load_model(dir: impl AsRef<Path>, opts: &LoadOptions) -> Result<LoadedModel> {
    let dir = dir.as_ref();
    let family = registry::detect_model_type(dir)?;
    load_family(dir, family, opts)
}

pub(crate) fn load_family(dir: &Path, family: &'static Family, opts: &LoadOptions) -> Result<LoadedModel> {
    let m = build_family(dir, family, opts)?;
    match &m {
        LoadedModel::Lm(lm) => lm.materialize()?,
        // Same reason as Model::materialize: compute the weights on the loading thread.
        LoadedModel::Embedding(e) => drop(e.encode_ids(&[0])?),
    }
    Ok(m)
}

fn build_family(dir: &Path, family: &'static Family, opts: &LoadOptions) -> Result<LoadedModel> {
    let raw = config::read_config_json(dir)?;
    // Tensor parallel: each layer copies only its slices out of the memory-mapped files.
    let mut weights = if tensor_parallel(opts).is_some() { Weights::open_mapped(dir, default_dtype(opts))? } else { Weights::load(dir, default_dtype(opts))? };
    build_over(dir, &raw, &mut weights, family, opts)
}

/// Build `family`'s model over `weights` (a checkpoint's tensors, or a parameter tree's): the
/// load options applied to the weights, sanitize, construction, the strict check, the cache.
pub(crate) fn build_over(dir: &Path, raw: &serde_json::Value, weights: &mut Weights, family: &'static Family, opts: &LoadOptions) -> Result<LoadedModel> {
    if let Some(g) = tensor_parallel(opts) {
        if !TENSOR_PARALLEL_FAMILIES.contains(&family.model_type) {
            return Err(ModelError::UnsupportedOption(format!(
                "tensor parallelism ({} ranks) is not supported for model_type \"{}\" (supported: {})",
                g.size(),
                family.model_type,
                TENSOR_PARALLEL_FAMILIES.join(", ")
            )));
        }
    }
    configure(dir, raw, weights, opts)?;
    let text = config::text_config(raw);
    let paged_default = match family.kv_default {
        KvDefault::Paged => true,
        KvDefault::Flat => false,
    };
    if let Some(bad) = opts.force_paged.keys().find(|k| registry::family(k).is_none()) {
        let known: Vec<&str> = registry::FAMILIES.iter().map(|f| f.model_type).collect();
        return Err(ModelError::UnsupportedOption(format!("force_paged: unknown family \"{bad}\" (families: {})", known.join(", "))));
    }
    let mut paged = opts.kv_cache.resolve(&text, paged_default, opts.force_paged.get(family.model_type).copied());
    if let Some(pc) = paged.as_mut() {
        pc.memory_floor_mb = pc.memory_floor_mb.or(family.paged_memory_floor_mb);
    }
    let dtype = default_dtype(opts).or_else(|| weights.float_dtype()).unwrap_or(DType::F32);
    (family.sanitize)(weights, raw);
    let built = construct(dir, raw, weights, family)?;
    weights.check_all_used()?;
    Ok(match built {
        Built::Lm(rt) => {
            let mut m = Model::from_runtime(rt, dir);
            m.group = tensor_parallel(opts).cloned();
            LoadedModel::Lm(match paged {
                Some(pc) => m.with_paged_cache(&pc, dtype)?,
                None => m,
            })
        }
        Built::Embedding(e) => LoadedModel::Embedding(Arc::new(e)),
    })
}

/// Apply the load options and config.json's quantization entries to `weights`.
fn configure(dir: &Path, raw: &serde_json::Value, weights: &mut Weights, opts: &LoadOptions) -> Result<()> {
    weights.fuse_projections = opts.fuse_projections;
    weights.tensor_parallel = tensor_parallel(opts).cloned();
    weights.quant = crate::weights::QuantSpec::from_config(raw).map_err(|reason| ModelError::MalformedConfig { path: dir.to_path_buf(), reason })?;
    weights.fp8_block = crate::weights::fp8_block_size(raw).map_err(|reason| ModelError::MalformedConfig { path: dir.to_path_buf(), reason })?;
    if weights.quant.is_some() {
        let dequantize = match opts.quantized {
            QuantizedWeights::Keep => false,
            QuantizedWeights::Dequantize => true,
            // On the CPU: packed when our kernels take every quantized layer's format.
            QuantizedWeights::Auto => crate::layers::runs_on_cpu() && !weights.quant.as_ref().is_some_and(|q| q.cpu_kernels_take_all()),
        };
        if dequantize {
            weights.dequantize_to = Some(default_dtype(opts).or_else(|| weights.float_dtype()).unwrap_or(DType::F32));
        }
    }
    Ok(())
}

/// Run `family`'s constructor over `weights` (a checkpoint's, or [`Weights::expecting`]).
pub(crate) fn construct(dir: &Path, raw: &serde_json::Value, weights: &Weights, family: &'static Family) -> Result<Built> {
    let text = config::text_config(raw);
    let eos = config::eos_ids(dir, &text);
    let ctx = LoadContext { dir, config: raw, text, weights, eos, family };
    (family.load)(&ctx)
}
