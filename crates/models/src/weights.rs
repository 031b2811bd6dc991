//! Prefixed weight access: constructors read like the checkpoint's tensor names.
//!
//! ```text
//! let vb = weights.root().pp("model.layers").pp(3).pp("self_attn");
//! let q = vb.get("q_proj.weight", &[n_heads * head_dim, hidden])?;
//! ```
use crate::{ModelError, Result};
use mlx_array::{Array, DType};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// All tensors of a checkpoint, by name, plus which ones a model has taken.
pub struct Weights {
    tensors: Mutex<HashMap<String, Array>>,
    path: PathBuf,
    taken: Mutex<std::collections::HashSet<String>>,
    /// [`crate::LoadOptions::fuse_projections`]: `None` = fuse on the GPU only.
    pub(crate) fuse_projections: Option<bool>,
}

impl Weights {
    /// Wrap already-loaded tensors; `path` names the checkpoint in errors.
    pub fn from_map(tensors: HashMap<String, Array>, path: impl Into<PathBuf>) -> Self {
        Weights { tensors: Mutex::new(tensors), path: path.into(), taken: Mutex::new(Default::default()), fuse_projections: None }
    }

    /// Load every `*.safetensors` tensor under `dir` (sharded through
    /// `model.safetensors.index.json` when present), converting floats to `float_dtype`.
    pub fn load(dir: &Path, float_dtype: Option<DType>) -> Result<Self> {
        // Sharded (index) checkpoints name their files; otherwise `model*.safetensors`, as mlx-lm
        // globs, so side files (e.g. reference outputs) in the directory are not mistaken for weights.
        let tensors = if dir.join("model.safetensors.index.json").exists() {
            mlx_array::io::load_dir(dir, float_dtype)?
        } else {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| ModelError::io(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors")))
                .collect();
            files.sort();
            let mut all = HashMap::new();
            for f in files {
                all.extend(mlx_array::io::load_safetensors(&f, float_dtype)?);
            }
            all
        };
        if tensors.is_empty() {
            return Err(ModelError::Checkpoint { path: dir.to_path_buf(), msg: "no safetensors weights found".into() });
        }
        Ok(Self::from_map(tensors, dir))
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
        self.map().contains_key(name) || self.taken.lock().unwrap_or_else(|e| e.into_inner()).contains(name)
    }

    /// The names of the tensors still held (taken ones excluded), unsorted.
    pub fn names(&self) -> Vec<String> {
        self.map().keys().cloned().collect()
    }

    /// The dtype of some floating-point tensor (the checkpoint's compute dtype), without
    /// marking anything as read.
    pub fn float_dtype(&self) -> Option<DType> {
        self.map().values().map(|a| a.dtype()).find(|d| d.is_float())
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Array>> {
        self.tensors.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rename, drop or add tensors before a model reads them (the sanitize hook).
    pub fn map_mut(&mut self) -> &mut HashMap<String, Array> {
        self.tensors.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// Tensors never read by the model, sorted (checkpoint keys the model did not expect).
    pub fn unused(&self) -> Vec<String> {
        let taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<String> = self.map().keys().filter(|k| !taken.contains(*k)).cloned().collect();
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

    /// The tensor `prefix.name`, which must have exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Array> {
        let full = self.full(name);
        let a = self.get_any(name)?;
        if a.shape() != shape {
            return Err(self.w.err(format!("tensor {full} has shape {:?}, expected {shape:?}", a.shape())));
        }
        Ok(a)
    }

    /// The tensor `prefix.name`, whatever its shape.
    pub fn get_any(&self, name: &str) -> Result<Array> {
        let full = self.full(name);
        let found = self.w.map().get(&full).cloned();
        match found {
            Some(a) => {
                self.w.taken.lock().unwrap_or_else(|e| e.into_inner()).insert(full);
                Ok(a)
            }
            None => Err(self.w.err(format!("missing tensor {full}"))),
        }
    }

    /// Like [`Vb::get`], but removes the tensor from the checkpoint map, so its memory goes
    /// once the caller drops it (used when weights are rewritten at load, e.g. fused).
    pub fn take(&self, name: &str, shape: &[usize]) -> Result<Array> {
        let a = self.get(name, shape)?;
        self.w.map().remove(&self.full(name));
        Ok(a)
    }

    /// Like [`Vb::get`], `None` when absent.
    pub fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Array>> {
        if self.contains(name) { self.get(name, shape).map(Some) } else { Ok(None) }
    }
}
