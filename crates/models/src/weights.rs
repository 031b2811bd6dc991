//! Prefixed weight access: constructors read like the checkpoint's tensor names.
//!
//! ```text
//! let vb = weights.root().pp("model.layers").pp(3).pp("self_attn");
//! let q = vb.get("q_proj.weight", &[n_heads * head_dim, hidden])?;
//! ```
use crate::{ModelError, Result};
use mlx_array::{Array, DType, QuantMode, Quantized};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// How a random checkpoint draws one tensor: `N(mean, std)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Init {
    pub mean: f32,
    pub std: f32,
}

impl Init {
    /// Projections and embeddings: `N(0, 0.02)`.
    pub const WEIGHT: Init = Init { mean: 0.0, std: 0.02 };
    pub const fn normal(mean: f32, std: f32) -> Self {
        Init { mean, std }
    }
}

/// A tensor a model reads, as recorded while it is built from a config alone
/// ([`Weights::expecting`]): the expected checkpoint keys, in the order the model reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpectedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    /// How a random checkpoint draws it.
    pub init: Init,
}

/// All tensors of a checkpoint, by name, plus which ones a model has taken.
pub struct Weights {
    tensors: Mutex<HashMap<String, Array>>,
    path: PathBuf,
    taken: Mutex<std::collections::HashSet<String>>,
    /// Tensors set aside on purpose by the loader's sanitize step (vision towers, a tied
    /// checkpoint's `lm_head` copy): present, not consumed, not an error.
    set_aside: Mutex<Vec<String>>,
    /// Recording mode ([`Weights::expecting`]): every read is recorded and answered with zeros.
    expected: Option<Mutex<Vec<ExpectedTensor>>>,
    /// [`Weights::log_reads`]: every tensor the model read, as read (name -> array).
    read_log: Option<Mutex<std::collections::BTreeMap<String, Array>>>,
    /// [`crate::LoadOptions::fuse_projections`]: `None` = fuse on the GPU only.
    pub(crate) fuse_projections: Option<bool>,
    /// The tensors stay held elsewhere (a [`crate::ParameterTree`]): arrays derived at load are
    /// left lazy, since computing them early frees nothing (and cannot run inside a gradient
    /// transform, where a model built from a tree's arrays is differentiated).
    pub(crate) sources_held: bool,
    /// config.json's `quantization` (mlx-lm's layout), when the checkpoint is quantized.
    pub(crate) quant: Option<QuantSpec>,
    /// Dequantize quantized layers at load into this dtype ([`crate::QuantizedWeights`]).
    pub(crate) dequantize_to: Option<DType>,
    /// Block-scaled FP8 checkpoints (`quantization_config.quant_method = "fp8"`): the
    /// `weight_block_size` `[rows, cols]` of `weight_scale_inv`.
    pub(crate) fp8_block: Option<[usize; 2]>,
    /// How projections with `lora_a`/`lora_b` tensors run their adapters.
    pub(crate) lora: Option<crate::layers::LoraSettings>,
    /// [`crate::LoadOptions::tensor_parallel`]: layers that shard load this rank's slices.
    pub(crate) tensor_parallel: Option<mlx_array::distributed::Group>,
    /// [`Weights::open_mapped`]: tensors not read yet stay in the memory-mapped files.
    mapped: Option<Mapped>,
    /// Scales and biases of quantized layers loaded in their stored dtype, not the float dtype
    /// ([`kept_quant_params`]).
    quant_params: std::collections::HashSet<String>,
}

/// The memory-mapped checkpoint behind [`Weights::open_mapped`] and the tensors it still holds.
struct Mapped {
    ckpt: mlx_array::io::Checkpoint,
    float_dtype: Option<DType>,
    /// Not read (nor set aside) yet: name -> (dtype after conversion, shape).
    pending: Mutex<HashMap<String, (DType, Vec<usize>)>>,
}

/// `quantization_config` of a block-scaled FP8 checkpoint (Qwen3's and DeepSeek's FP8 releases):
/// `Some([rows, cols])` of `weight_block_size`; `None` when the checkpoint is not FP8.
pub fn fp8_block_size(root: &serde_json::Value) -> std::result::Result<Option<[usize; 2]>, String> {
    let Some(q) = root.get("quantization_config").filter(|q| q.get("quant_method").and_then(|m| m.as_str()) == Some("fp8")) else {
        return Ok(None);
    };
    if let Some(f) = q.get("fmt").and_then(|f| f.as_str()) {
        if f != "e4m3" {
            return Err(format!("fp8 fmt {f:?} is not supported (e4m3 is)"));
        }
    }
    let b = q.get("weight_block_size").and_then(|b| b.as_array()).ok_or("fp8 quantization_config needs weight_block_size [rows, cols]")?;
    match b.iter().map(|x| x.as_u64().filter(|&v| v > 0).map(|v| v as usize)).collect::<Option<Vec<_>>>().as_deref() {
        Some([r, c]) => Ok(Some([*r, *c])),
        _ => Err(format!("fp8 weight_block_size must be two positive integers, got {}", serde_json::Value::Array(b.clone()))),
    }
}

/// The float value of every e4m3fn byte (sign, 4 exponent bits with bias 7, 3 mantissa bits;
/// subnormals below exponent 1; `S.1111.111` is NaN; no infinities).
fn e4m3fn_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    for (b, v) in t.iter_mut().enumerate() {
        let (s, e, m) = ((b >> 7) & 1, (b >> 3) & 15, b & 7);
        let mag = if e == 15 && m == 7 {
            f32::NAN
        } else if e == 0 {
            m as f32 / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7)
        };
        *v = if s == 1 { -mag } else { mag };
    }
    t
}

/// mlx-lm's `quantization` entry of config.json: the default mode and per-layer entries
/// (a mode, or `false` for a layer left unquantized).
#[derive(Debug, Clone)]
pub struct QuantSpec {
    pub default: QuantMode,
    pub layers: HashMap<String, Option<QuantMode>>,
    /// Calibrated per-tensor activation maxima (`input_amax` of a per-layer entry, written by
    /// [`crate::calibrate::calibrate_activation_amax`]).
    pub input_amax: HashMap<String, f32>,
    /// The layers whose `input_amax` a projection took at load ([`Weights::check_all_used`]
    /// refuses the others).
    pub(crate) amax_read: std::sync::Arc<Mutex<std::collections::HashSet<String>>>,
}

impl QuantSpec {
    /// Whether the CPU packed kernels take every format this checkpoint uses.
    pub(crate) fn cpu_kernels_take_all(&self) -> bool {
        mlx_array::ops::cpu_packed_supports(self.default) && self.layers.values().flatten().all(|m| mlx_array::ops::cpu_packed_supports(*m))
    }
    /// From config.json's root (`quantization`, else `quantization_config` when it has mlx-lm's
    /// keys). `Ok(None)`: not quantized.
    pub fn from_config(root: &serde_json::Value) -> std::result::Result<Option<Self>, String> {
        let q = match root.get("quantization").filter(|q| !q.is_null()) {
            Some(q) => q,
            None => match root.get("quantization_config") {
                Some(q) if q.get("bits").is_some() && q.get("group_size").is_some() => q,
                // block-scaled FP8: see fp8_block_size
                Some(q) if q.get("quant_method").and_then(|m| m.as_str()) == Some("fp8") => return Ok(None),
                Some(q) if !q.is_null() => {
                    let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("unknown");
                    return Err(format!("quantization_config with quant_method {method:?} is not supported (MLX quantized checkpoints are)"));
                }
                _ => return Ok(None),
            },
        };
        let obj = q.as_object().ok_or("quantization must be an object")?;
        let mode = |v: &serde_json::Value| -> std::result::Result<QuantMode, String> {
            let num = |k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as u32).ok_or(format!("quantization entry {v} needs {k}"));
            let m = v.get("mode").and_then(|m| m.as_str()).unwrap_or("affine");
            QuantMode::from_parts(m, num("bits")?, num("group_size")?).map_err(|e| e.to_string())
        };
        let default = mode(q)?;
        if obj.contains_key("input_amax") {
            return Err("quantization.input_amax: activation maxima belong to per-layer entries".into());
        }
        let mut layers = HashMap::new();
        let mut input_amax = HashMap::new();
        for (k, v) in obj {
            match v {
                serde_json::Value::Object(_) => {
                    layers.insert(k.clone(), Some(mode(v)?));
                    if let Some(a) = v.get("input_amax") {
                        let a = a.as_f64().map(|a| a as f32).filter(|a| a.is_finite() && *a > 0.0).ok_or(format!("quantization.{k}.input_amax must be a positive finite number, got {a}"))?;
                        crate::calibrate::check_site(k, mode(v)?)?;
                        input_amax.insert(k.clone(), a);
                    }
                }
                serde_json::Value::Bool(false) => {
                    layers.insert(k.clone(), None);
                }
                _ => {}
            }
        }
        Ok(Some(QuantSpec { default, layers, input_amax, amax_read: Default::default() }))
    }
}

impl Weights {
    /// Wrap already-loaded tensors; `path` names the checkpoint in errors.
    pub fn from_map(tensors: HashMap<String, Array>, path: impl Into<PathBuf>) -> Self {
        Weights {
            tensors: Mutex::new(tensors),
            path: path.into(),
            taken: Mutex::new(Default::default()),
            set_aside: Mutex::new(Vec::new()),
            expected: None,
            read_log: None,
            fuse_projections: None,
            sources_held: false,
            quant: None,
            dequantize_to: None,
            fp8_block: None,
            lora: None,
            tensor_parallel: None,
            mapped: None,
            quant_params: Default::default(),
        }
    }

    /// No tensors: a model built over this records every tensor it reads (name, shape, init)
    /// and gets zeros (lazy, never computed). [`Weights::expected`] lists them afterwards: the
    /// checkpoint layout a config implies, which random checkpoints are written from. Optional
    /// tensors (those a loader probes with `contains`) are taken as absent, so the recorded
    /// layout is the hub layout.
    pub fn expecting(path: impl Into<PathBuf>) -> Self {
        let mut w = Self::from_map(HashMap::new(), path);
        w.expected = Some(Mutex::new(Vec::new()));
        w.fuse_projections = Some(false);
        w
    }

    /// Keep every tensor a model reads from now on, as it was read (before the model fuses,
    /// transposes or dequantizes it): [`Weights::take_read_log`] returns them by name. This is
    /// the model's parameter tree in checkpoint names ([`crate::ParameterTree`]).
    pub fn log_reads(&mut self) {
        self.read_log = Some(Mutex::new(Default::default()));
    }

    /// The tensors read since [`Weights::log_reads`], by checkpoint name (empty when not logging).
    pub fn take_read_log(&self) -> std::collections::BTreeMap<String, Array> {
        self.read_log.as_ref().map(|l| std::mem::take(&mut *l.lock().unwrap_or_else(|e| e.into_inner()))).unwrap_or_default()
    }

    /// The tensors recorded by a model built over [`Weights::expecting`], in reading order.
    pub fn expected(&self) -> Vec<ExpectedTensor> {
        self.expected.as_ref().map(|e| e.lock().unwrap_or_else(|e| e.into_inner()).clone()).unwrap_or_default()
    }

    /// Remove the tensors whose names match `pred` as set aside on purpose (not loaded, not
    /// an error for [`Weights::check_all_used`]); returns how many.
    pub fn set_aside(&mut self, pred: impl Fn(&str) -> bool) -> usize {
        let map = self.tensors.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<String> = map.keys().filter(|k| pred(k)).cloned().collect();
        for n in &names {
            map.remove(n);
        }
        if let Some(m) = &mut self.mapped {
            let pending = m.pending.get_mut().unwrap_or_else(|e| e.into_inner());
            let more: Vec<String> = pending.keys().filter(|k| pred(k)).cloned().collect();
            for n in &more {
                pending.remove(n);
            }
            names.extend(more);
        }
        let n = names.len();
        self.set_aside.get_mut().unwrap_or_else(|e| e.into_inner()).extend(names);
        n
    }

    /// The names [`Weights::set_aside`] removed, sorted.
    pub fn set_aside_names(&self) -> Vec<String> {
        let mut v = self.set_aside.lock().unwrap_or_else(|e| e.into_inner()).clone();
        v.sort();
        v
    }

    /// Strict loading: every tensor of the checkpoint was consumed by the model or set aside.
    /// Unexpected tensors (a mistyped layout, a newer checkpoint format) are an error naming them.
    pub fn check_all_used(&self) -> Result<()> {
        if let Some(q) = &self.quant {
            let read = q.amax_read.lock().unwrap_or_else(|e| e.into_inner());
            let mut unread: Vec<&str> = q.input_amax.keys().filter(|k| !read.contains(*k)).map(String::as_str).collect();
            if !unread.is_empty() {
                unread.sort();
                return Err(self.err(format!(
                    "input_amax of {} is read by no activation-quantised projection of the model (mxfp8 attention projections, nvfp4 linear layers; not embeddings or stacked experts)",
                    unread.join(", ")
                )));
            }
        }
        let unused = self.unused();
        if unused.is_empty() {
            return Ok(());
        }
        let shown: Vec<&str> = unused.iter().take(8).map(String::as_str).collect();
        let more = if unused.len() > 8 { format!(" (+{} more)", unused.len() - 8) } else { String::new() };
        Err(self.err(format!("{} unexpected tensor(s) that no layer of the model reads: {}{more}", unused.len(), shown.join(", "))))
    }

    /// Load every `*.safetensors` tensor under `dir` (sharded through
    /// `model.safetensors.index.json` when present), converting floats to `float_dtype`, except
    /// the scales and biases of MLX-quantized layers on the CPU (`kept_quant_params`).
    pub fn load(dir: &Path, float_dtype: Option<DType>) -> Result<Self> {
        // Sharded (index) checkpoints name their files; otherwise `model*.safetensors`, as mlx-lm
        // globs, so side files (e.g. reference outputs) in the directory are not mistaken for weights.
        let ckpt = open_checkpoint(dir)?.ok_or_else(|| ModelError::Checkpoint { path: dir.to_path_buf(), msg: "no safetensors weights found".into() })?;
        let infos = ckpt.tensors();
        let kept = kept_quant_params(&infos, float_dtype);
        let mut tensors = HashMap::with_capacity(infos.len());
        for t in &infos {
            let dt = if kept.contains(&t.name) { None } else { float_dtype };
            tensors.insert(t.name.clone(), ckpt.load(&t.name, dt)?);
        }
        if tensors.is_empty() {
            return Err(ModelError::Checkpoint { path: dir.to_path_buf(), msg: "no safetensors weights found".into() });
        }
        let mut w = Self::from_map(tensors, dir);
        w.quant_params = kept;
        Ok(w)
    }

    /// The files [`Weights::load`] reads, memory-mapped, with nothing copied yet: each tensor is
    /// copied out when a layer reads it, and a sharded layer ([`Vb::get_shard`]) copies only
    /// its slice, so a tensor-parallel rank holds about its share of the model.
    pub fn open_mapped(dir: &Path, float_dtype: Option<DType>) -> Result<Self> {
        let ckpt = open_checkpoint(dir)?.ok_or_else(|| ModelError::Checkpoint { path: dir.to_path_buf(), msg: "no safetensors weights found".into() })?;
        let infos = ckpt.tensors();
        let kept = kept_quant_params(&infos, float_dtype);
        let pending = infos
            .into_iter()
            .map(|t| {
                let dt = match float_dtype {
                    Some(f) if t.dtype.is_float() && !kept.contains(&t.name) => f,
                    _ => t.dtype,
                };
                (t.name, (dt, t.shape))
            })
            .collect();
        let mut w = Self::from_map(HashMap::new(), dir);
        w.mapped = Some(Mapped { ckpt, float_dtype, pending: Mutex::new(pending) });
        w.quant_params = kept;
        Ok(w)
    }

    fn pending(&self) -> Option<std::sync::MutexGuard<'_, HashMap<String, (DType, Vec<usize>)>>> {
        self.mapped.as_ref().map(|m| m.pending.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// `name` copied out of the memory map (`None` when it is not there): whole, then held like
    /// an eagerly loaded tensor, or only `slice` (`axis`, `start..end`), left listed for
    /// [`Weights::shape_of`].
    fn load_mapped(&self, name: &str, slice: Option<(&[usize], usize, usize, usize)>) -> Result<Option<Array>> {
        let Some(m) = &self.mapped else { return Ok(None) };
        let mut pending = m.pending.lock().unwrap_or_else(|e| e.into_inner());
        if !pending.contains_key(name) {
            return Ok(None);
        }
        let dt = if self.quant_params.contains(name) { None } else { m.float_dtype };
        Ok(Some(match slice {
            Some((view, axis, start, end)) => m.ckpt.load_slice_as(name, Some(view), axis, start, end, dt)?,
            None => {
                pending.remove(name);
                let a = m.ckpt.load(name, dt)?;
                self.map().insert(name.to_string(), a.clone());
                a
            }
        }))
    }

    /// The group a tensor-parallel load shards over (`None`: every layer whole).
    pub fn tensor_parallel(&self) -> Option<&mlx_array::distributed::Group> {
        self.tensor_parallel.as_ref()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether [`crate::layers::FusedLinear`] fuses: the load option, else the default device
    /// (where the weights live) is the GPU.
    pub(crate) fn fuse_projections(&self) -> Result<bool> {
        Ok(match self.fuse_projections {
            Some(f) => f,
            None => mlx_array::default_device()? == mlx_array::Device::Gpu,
        })
    }

    /// The unprefixed root.
    pub fn root(&self) -> Vb<'_> {
        Vb { w: self, prefix: String::new() }
    }

    /// Whether the checkpoint has `name` (also after a model has taken it with [`Vb::take`]).
    pub fn contains(&self, name: &str) -> bool {
        self.map().contains_key(name)
            || self.taken.lock().unwrap_or_else(|e| e.into_inner()).contains(name)
            || self.pending().is_some_and(|p| p.contains_key(name))
    }

    /// Where a decoder's tensors live: `model.` (…ForCausalLM), `model.language_model.`
    /// (…ForConditionalGeneration in transformers 5) or `language_model.model.` (older hub and
    /// mlx-lm-saved checkpoints); found by its `embed_tokens.weight`, `model` when none has one.
    pub fn decoder_prefix(&self) -> &'static str {
        ["model.language_model", "language_model.model", "model"].into_iter().find(|p| self.contains(&format!("{p}.embed_tokens.weight"))).unwrap_or("model")
    }

    /// The shape of tensor `name` (without marking it read), `None` if absent.
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.map().get(name).map(|a| a.shape()).or_else(|| self.pending().and_then(|p| p.get(name).map(|(_, s)| s.clone())))
    }

    /// The names of the tensors still held (taken ones excluded), unsorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.map().keys().cloned().collect();
        if let Some(p) = self.pending() {
            v.extend(p.keys().cloned());
        }
        v
    }

    /// The dtype of some floating-point tensor (the checkpoint's compute dtype), without
    /// marking anything as read.
    pub fn float_dtype(&self) -> Option<DType> {
        let q = &self.quant_params;
        self.map()
            .iter()
            .filter(|(n, _)| !q.contains(*n))
            .map(|(_, a)| a.dtype())
            .find(|d| d.is_float())
            .or_else(|| self.pending().and_then(|p| p.iter().filter(|(n, _)| !q.contains(*n)).map(|(_, (d, _))| *d).find(|d| d.is_float())))
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Array>> {
        self.tensors.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tensors never read by the model, sorted (checkpoint keys the model did not expect).
    pub fn unused(&self) -> Vec<String> {
        let taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<String> = self.map().keys().filter(|k| !taken.contains(*k)).cloned().collect();
        if let Some(p) = self.pending() {
            v.extend(p.keys().filter(|k| !taken.contains(*k)).cloned());
        }
        v.sort();
        v
    }

    fn err(&self, msg: String) -> ModelError {
        ModelError::Checkpoint { path: self.path.clone(), msg }
    }
}

/// A view of [`Weights`] under a name prefix.
#[derive(Clone)]
pub struct Vb<'a> {
    w: &'a Weights,
    prefix: String,
}

impl<'a> Vb<'a> {
    /// The dotted path of this view (`model.layers.0.self_attn.q_proj`).
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }
    /// The checkpoint this view reads.
    pub(crate) fn weights(&self) -> &'a Weights {
        self.w
    }
    /// Descend into `name` (joined with a dot).
    pub fn pp(&self, name: impl std::fmt::Display) -> Vb<'a> {
        let prefix = if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        Vb { w: self.w, prefix }
    }

    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.w.contains(&self.full(name))
    }

    /// Whether this builder records the tensors a model reads (a random checkpoint's layout)
    /// rather than reading a checkpoint: optional tensors and alternative layouts are then the
    /// family's choice of what its published checkpoints hold.
    pub fn recording(&self) -> bool {
        self.w.expected.is_some()
    }

    /// The tensor `prefix.name`, which must have exactly `shape` (a random checkpoint draws it
    /// from [`Init::WEIGHT`]).
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Array> {
        self.get_init(name, shape, Init::WEIGHT)
    }

    /// [`Vb::get`], naming how a random checkpoint draws the tensor.
    pub fn get_init(&self, name: &str, shape: &[usize], init: Init) -> Result<Array> {
        let full = self.full(name);
        if let Some(rec) = &self.w.expected {
            rec.lock().unwrap_or_else(|e| e.into_inner()).push(ExpectedTensor { name: full, shape: shape.to_vec(), init });
            return Ok(Array::zeros(shape, DType::F32)?);
        }
        let a = self.get_any(name)?;
        if a.shape() != shape {
            return Err(self.w.err(format!("tensor {full} has shape {:?}, expected {shape:?}", a.shape())));
        }
        Ok(a)
    }

    /// The tensor `prefix.name` in one of the layouts `shapes` (the first is the hub's, the
    /// one a random checkpoint gets).
    pub fn get_either(&self, name: &str, shapes: &[&[usize]], init: Init) -> Result<Array> {
        if self.w.expected.is_some() {
            return self.get_init(name, shapes[0], init);
        }
        let a = self.get_any(name)?;
        if !shapes.contains(&a.shape().as_slice()) {
            return Err(self.w.err(format!("tensor {} has shape {:?}, expected one of {shapes:?}", self.full(name), a.shape())));
        }
        Ok(a)
    }

    /// The tensor `prefix.name`, whatever its shape.
    pub fn get_any(&self, name: &str) -> Result<Array> {
        let full = self.full(name);
        if self.w.expected.is_some() {
            return Err(self.w.err(format!("{full}: a tensor of unknown shape cannot be recorded")));
        }
        let mut found = self.w.map().get(&full).cloned();
        if found.is_none() {
            found = self.w.load_mapped(&full, None)?;
        }
        match found {
            Some(a) => {
                if let Some(log) = &self.w.read_log {
                    log.lock().unwrap_or_else(|e| e.into_inner()).insert(full.clone(), a.clone());
                }
                self.w.taken.lock().unwrap_or_else(|e| e.into_inner()).insert(full);
                Ok(a)
            }
            None => Err(self.w.err(format!("missing tensor {full}"))),
        }
    }

    /// Part `part` of `parts` equal slices along `axis` of the tensor `prefix.name`, whose whole
    /// shape must be `shape` (a tensor-parallel rank's shard). From a memory-mapped checkpoint
    /// ([`Weights::open_mapped`]) only the slice's bytes are copied; a tensor already in memory
    /// is sliced and copied. A random checkpoint records the whole tensor.
    pub fn get_shard(&self, name: &str, shape: &[usize], axis: usize, part: usize, parts: usize) -> Result<Array> {
        self.get_shard_as(name, shape, shape, axis, part, parts)
    }

    /// [`Vb::get_shard`] of the tensor `shape` viewed as `view` (the same elements, e.g.
    /// `[3, h, h]` for a `[3h, h]` projection of three parts, sharded along axis 1): the shard
    /// comes back in the view's layout.
    pub fn get_shard_as(&self, name: &str, shape: &[usize], view: &[usize], axis: usize, part: usize, parts: usize) -> Result<Array> {
        let full = self.full(name);
        if shape.iter().product::<usize>() != view.iter().product::<usize>() {
            return Err(self.w.err(format!("{full} {shape:?} cannot be viewed as {view:?}")));
        }
        if axis >= view.len() || parts == 0 || part >= parts || view[axis] % parts != 0 {
            return Err(self.w.err(format!("{full} {view:?}: axis {axis} does not split into {parts} equal parts")));
        }
        let n = view[axis] / parts;
        self.get_range_as(name, shape, view, axis, part * n, (part + 1) * n)
    }

    /// Elements `start..end` along `axis` of the tensor `prefix.name` of shape `shape` (e.g. a
    /// rank's heads of one part of a projection whose parts differ in size).
    pub fn get_range(&self, name: &str, shape: &[usize], axis: usize, start: usize, end: usize) -> Result<Array> {
        self.get_range_as(name, shape, shape, axis, start, end)
    }

    fn get_range_as(&self, name: &str, shape: &[usize], view: &[usize], axis: usize, start: usize, end: usize) -> Result<Array> {
        let full = self.full(name);
        if axis >= view.len() || start > end || end > view[axis] || shape.iter().product::<usize>() != view.iter().product::<usize>() {
            return Err(self.w.err(format!("{full} {shape:?} viewed as {view:?}: no range {start}..{end} along axis {axis}")));
        }
        let (stored, shape) = (shape, view);
        let mut local = shape.to_vec();
        local[axis] = end - start;
        if let Some(rec) = &self.w.expected {
            rec.lock().unwrap_or_else(|e| e.into_inner()).push(ExpectedTensor { name: full, shape: stored.to_vec(), init: Init::WEIGHT });
            return Ok(Array::zeros(&local, DType::F32)?);
        }
        let held = self.w.map().get(&full).cloned();
        let a = match held {
            Some(a) => {
                if a.shape() != stored {
                    return Err(self.w.err(format!("tensor {full} has shape {:?}, expected {stored:?}", a.shape())));
                }
                // A product with one is a new buffer: the slice does not keep the whole alive.
                let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
                let s = a.reshape(&dims)?.slice_axis(axis as i32, start, end)?;
                s.mul(&Array::scalar_as(1.0, s.dtype())?)?
            }
            None => {
                match self.w.shape_of(&full) {
                    Some(s) if s != stored => return Err(self.w.err(format!("tensor {full} has shape {s:?}, expected {stored:?}"))),
                    _ => {}
                }
                self.w.load_mapped(&full, Some((shape, axis, start, end)))?.ok_or_else(|| self.w.err(format!("missing tensor {full}")))?
            }
        };
        self.w.taken.lock().unwrap_or_else(|e| e.into_inner()).insert(full);
        Ok(a)
    }

    /// Mark `prefix.name` as read without loading it (a tensor another rank holds); an error
    /// when the checkpoint does not have it.
    pub fn skip(&self, name: &str) -> Result<()> {
        let full = self.full(name);
        if self.w.expected.is_some() {
            return Err(self.w.err(format!("{full}: a skipped tensor cannot be recorded")));
        }
        if !self.w.contains(&full) {
            return Err(self.w.err(format!("missing tensor {full}")));
        }
        self.w.taken.lock().unwrap_or_else(|e| e.into_inner()).insert(full);
        Ok(())
    }

    /// Like [`Vb::get`], but removes the tensor from the checkpoint map, so its memory goes
    /// once the caller drops it (used when weights are rewritten at load, e.g. fused).
    pub fn take(&self, name: &str, shape: &[usize]) -> Result<Array> {
        let a = self.get(name, shape)?;
        self.w.map().remove(&self.full(name));
        Ok(a)
    }

    /// Whether the layer under this prefix is stored in block-scaled FP8 (it has `weight_scale_inv`).
    pub fn is_fp8(&self) -> bool {
        self.contains("weight_scale_inv")
    }

    /// The FP8 layer under this prefix decoded to f32: e4m3fn `weight` `[out, in]` (loaded as
    /// bytes) times `weight_scale_inv`, one scale per `weight_block_size` block (the last blocks
    /// may be partial), as transformers' FP8 dequantization computes it.
    pub fn fp8_dequantized(&self, out_dim: usize, in_dim: usize) -> Result<Array> {
        let layer = self.prefix.clone();
        let [br, bc] = self.w.fp8_block.ok_or_else(|| self.w.err(format!("{layer} has weight_scale_inv but config.json has no fp8 quantization_config")))?;
        let w = self.get_any("weight")?;
        if w.dtype() != DType::U8 || w.shape() != [out_dim, in_dim] {
            return Err(self.w.err(format!("{layer}.weight is {} {:?}, expected F8_E4M3 [{out_dim}, {in_dim}]", w.dtype(), w.shape())));
        }
        let (sr, sc) = (out_dim.div_ceil(br), in_dim.div_ceil(bc));
        let s = self.get("weight_scale_inv", &[sr, sc])?.astype(DType::F32)?;
        let table = Array::from_slice(&e4m3fn_table(), &[256])?;
        let vals = table.take(&w.astype(DType::U32)?, 0)?; // [out, in] f32
        // expand the scales over their blocks, then cut the partial last ones
        let s = s.expand_dims(1)?.expand_dims(3)?.broadcast_to(&[sr, br, sc, bc])?.reshape(&[(sr * br) as i32, (sc * bc) as i32])?;
        let s = s.slice_axis(0, 0, out_dim)?.slice_axis(1, 0, in_dim)?;
        Ok(vals.mul(&s)?)
    }

    /// Whether the layer under this prefix is stored quantized (it has `scales`).
    pub fn is_quantized(&self) -> bool {
        self.contains("scales")
    }

    /// The quantized layer under this prefix (`weight` packed u32, `scales`, affine `biases`), its
    /// mode from config.json (the layer's own entry, else the default), checked against the
    /// float shape `[.., out, in]` it stands for.
    pub fn quantized(&self, shape: &[usize]) -> Result<Quantized> {
        let layer = self.prefix.clone();
        let (mode, wshape, sshape) = self.quant_layout(shape)?;
        let weight = self.get_any("weight")?;
        if weight.dtype() != DType::U32 || weight.shape() != wshape.as_slice() {
            return Err(self.w.err(format!("{layer}.weight is {} {:?}, expected packed u32 {wshape:?} ({} bits)", weight.dtype(), weight.shape(), mode.name())));
        }
        let scales = self.get("scales", &sshape)?;
        let biases = match mode {
            QuantMode::Affine { .. } => Some(self.get("biases", &sshape)?),
            _ => None,
        };
        Ok(Quantized { weight, scales, biases, mode })
    }

    /// The mode of the quantized layer under this prefix (its own entry in config.json's
    /// `quantization`, else the default) and the stored shapes of its packed `weight` and of its
    /// `scales` (and affine `biases`) for the float shape `[.., out, in]`.
    fn quant_layout(&self, shape: &[usize]) -> Result<(QuantMode, Vec<usize>, Vec<usize>)> {
        let layer = &self.prefix;
        let spec = self.w.quant.as_ref().ok_or_else(|| self.w.err(format!("{layer} is quantized (it has scales) but config.json has no quantization")))?;
        let mode = match spec.layers.get(layer) {
            Some(Some(m)) => *m,
            Some(None) => return Err(self.w.err(format!("{layer} has scales but config.json's quantization marks it unquantized"))),
            None => spec.default,
        };
        let (lead, k) = shape.split_at(shape.len() - 1);
        let k = k[0];
        let (bits, gs) = (mode.bits() as usize, mode.group_size() as usize);
        if k % gs != 0 || (k * bits) % 32 != 0 {
            return Err(self.w.err(format!("{layer}: {k} input features do not fit {} groups of {gs}", mode.name())));
        }
        let mut wshape = lead.to_vec();
        wshape.push(k * bits / 32);
        let mut sshape = lead.to_vec();
        sshape.push(k / gs);
        Ok((mode, wshape, sshape))
    }

    /// Part `part` of `parts` of the quantized layer under this prefix (a tensor-parallel rank's
    /// shard), whose float shape `[.., out, in]` is viewed as `view` (the same elements with the
    /// same last axis, e.g. `[3, h, in]` for three fused outputs) and split along `axis` of the
    /// view: the packed `weight`, the `scales` and the affine `biases` are cut at the same place
    /// and come back in the view's layout. Along an outer axis whole rows go to each part; along
    /// the last (input) axis each part must hold whole quantization groups: a shard boundary
    /// inside a group (`in / parts` not a multiple of the group size) is an error. Only the
    /// shard's bytes are read from a memory-mapped checkpoint ([`Vb::get_shard_as`]).
    pub fn quantized_shard_as(&self, shape: &[usize], view: &[usize], axis: usize, part: usize, parts: usize) -> Result<Quantized> {
        let layer = self.prefix.clone();
        let (mode, wshape, sshape) = self.quant_layout(shape)?;
        let last = view.len().wrapping_sub(1);
        if view.is_empty() || view[last] != shape[shape.len() - 1] || shape.iter().product::<usize>() != view.iter().product::<usize>() {
            return Err(self.w.err(format!("{layer} {shape:?} cannot be viewed as {view:?} (the input axis must stay last)")));
        }
        if axis >= view.len() || parts == 0 || part >= parts || view[axis] % parts != 0 {
            return Err(self.w.err(format!("{layer} {view:?}: axis {axis} does not split into {parts} equal parts")));
        }
        let gs = mode.group_size() as usize;
        if axis == last && (view[last] / parts) % gs != 0 {
            return Err(ModelError::UnsupportedOption(format!(
                "tensor parallelism over {parts} ranks: {layer} splits its {} input features into {} per rank, which cuts its {} groups of {gs}",
                view[last],
                view[last] / parts,
                mode.name()
            )));
        }
        let packed = |stored: &[usize]| {
            let mut v = view.to_vec();
            v[last] = stored[stored.len() - 1];
            v
        };
        let weight = self.get_shard_as("weight", &wshape, &packed(&wshape), axis, part, parts)?;
        if weight.dtype() != DType::U32 {
            return Err(self.w.err(format!("{layer}.weight is {}, expected packed u32 ({} bits)", weight.dtype(), mode.name())));
        }
        let scales = self.get_shard_as("scales", &sshape, &packed(&sshape), axis, part, parts)?;
        let biases = match mode {
            QuantMode::Affine { .. } => Some(self.get_shard_as("biases", &sshape, &packed(&sshape), axis, part, parts)?),
            _ => None,
        };
        Ok(Quantized { weight, scales, biases, mode })
    }

    /// [`Vb::quantized_shard_as`] without a view: part `part` of `parts` of the quantized layer
    /// `[.., out, in]` along `axis`.
    pub fn quantized_shard(&self, shape: &[usize], axis: usize, part: usize, parts: usize) -> Result<Quantized> {
        self.quantized_shard_as(shape, shape, axis, part, parts)
    }

    /// Like [`Vb::get`], `None` when absent.
    pub fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Array>> {
        if self.contains(name) { self.get(name, shape).map(Some) } else { Ok(None) }
    }
}

/// The `model*.safetensors` files directly under `dir`, sorted (mlx-lm's glob for unsharded
/// checkpoints).
fn model_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ModelError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors")))
        .collect();
    files.sort();
    Ok(files)
}

/// The `.scales` / `.biases` of MLX-quantized layers (beside an integer `.weight`) that keep their
/// stored dtype when floats load as f32 on the CPU: the CPU kernels read bf16 and f16 scales as
/// they are (the same values an f32 copy holds), so a 4-bit layer with bf16 scales in groups of
/// 32 reads 0.625 bytes a weight instead of 0.75 at every decode step, and prefill's dequantize
/// converts them exactly. Elsewhere (the GPU, other dtypes) none are kept.
fn kept_quant_params(infos: &[mlx_array::io::TensorInfo], float_dtype: Option<DType>) -> std::collections::HashSet<String> {
    if float_dtype != Some(DType::F32) || !crate::layers::runs_on_cpu() {
        return Default::default();
    }
    let packed: std::collections::HashSet<&str> = infos.iter().filter(|t| t.name.ends_with(".weight") && !t.dtype.is_float()).map(|t| t.name.trim_end_matches(".weight")).collect();
    infos
        .iter()
        .filter(|t| t.dtype.is_float())
        .filter(|t| {
            let base = t.name.strip_suffix(".scales").or_else(|| t.name.strip_suffix(".biases"));
            base.is_some_and(|b| packed.contains(b))
        })
        .map(|t| t.name.clone())
        .collect()
}

/// The weight files of `dir` memory-mapped, headers checked, nothing copied: the sharded index
/// when there is one, else the `model*.safetensors` files; `None` when there are none.
pub(crate) fn open_checkpoint(dir: &Path) -> Result<Option<mlx_array::io::Checkpoint>> {
    if dir.join("model.safetensors.index.json").exists() {
        return Ok(Some(mlx_array::io::Checkpoint::open(dir)?));
    }
    let files = model_files(dir)?;
    if files.is_empty() {
        return Ok(None);
    }
    Ok(Some(mlx_array::io::Checkpoint::open_files(dir, &files)?))
}

/// The bytes of the tensors in `dir`'s weight files as stored (the files `open_checkpoint`
/// reads: the sharded index's, else `model*.safetensors`); `None` when there are none. What a
/// decode step reads scales with it, so comparing a draft's with its target's bounds what
/// speculating can gain.
pub fn checkpoint_bytes(dir: &Path) -> Result<Option<u64>> {
    Ok(open_checkpoint(dir)?.map(|c| c.tensors().iter().map(|t| (t.shape.iter().product::<usize>() * t.dtype.size()) as u64).sum()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixtures' stored bytes: shapes times element sizes of `model.safetensors` only
    /// (`reference.safetensors` beside it is not a weight file).
    #[test]
    fn checkpoint_bytes_count_the_weight_files() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/qwen3");
        let want: u64 = mlx_array::io::list_tensors(dir.join("model.safetensors")).unwrap().iter().map(|t| (t.shape.iter().product::<usize>() * t.dtype.size()) as u64).sum();
        assert!(want > 0);
        assert_eq!(checkpoint_bytes(&dir).unwrap(), Some(want));
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(checkpoint_bytes(empty.path()).unwrap(), None);
    }

    /// Quantized layers' bf16 scales and biases stay bf16 when floats load as f32 on the CPU;
    /// every other float converts, and without a float dtype nothing does.
    #[test]
    fn quant_params_keep_their_dtype_on_the_cpu() {
        let dir = tempfile::tempdir().unwrap();
        let bf = |n: usize| Array::from_slice(&vec![0.5f32; n], &[n]).unwrap().astype(DType::BF16).unwrap();
        let w = Array::from_slice(&[1u32, 2, 3, 4], &[1, 4]).unwrap();
        let (s, b, norm, other) = (bf(1), bf(1), bf(4), bf(2));
        mlx_array::io::save_safetensors(
            dir.path().join("model.safetensors"),
            &[("l.weight", &w), ("l.scales", &s), ("l.biases", &b), ("n.weight", &norm), ("x.scales", &other)],
            None,
        )
        .unwrap();
        let loaded = Weights::load(dir.path(), Some(DType::F32)).unwrap();
        let dt = |n: &str| loaded.map().get(n).unwrap().dtype();
        assert_eq!((dt("l.scales"), dt("l.biases")), (DType::BF16, DType::BF16));
        assert_eq!((dt("n.weight"), dt("x.scales")), (DType::F32, DType::F32), "no packed weight beside them");
        assert_eq!(loaded.float_dtype(), Some(DType::F32));
        let mapped = Weights::open_mapped(dir.path(), Some(DType::F32)).unwrap();
        assert_eq!(mapped.load_mapped("l.scales", None).unwrap().unwrap().dtype(), DType::BF16);
        assert_eq!(mapped.load_mapped("n.weight", None).unwrap().unwrap().dtype(), DType::F32);
        let plain = Weights::load(dir.path(), None).unwrap();
        assert_eq!(plain.map().get("n.weight").unwrap().dtype(), DType::BF16);
    }
}
