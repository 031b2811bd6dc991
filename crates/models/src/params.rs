//! A model's parameters by checkpoint name, with trainable/frozen marks.
//!
//! [`ParameterTree::load`] builds a family's model over a checkpoint and keeps every tensor the
//! model reads, as read (before the model fuses, transposes or dequantizes it), under its
//! checkpoint name: exactly the tensors strict loading accepts, after the family's sanitize step.
//! [`ParameterTree::build`] constructs the model from the tree's arrays again. Construction is
//! made of array ops, so a loss computed through a model built inside
//! [`mlx_array::grad::value_and_grad`] from replaced arrays ([`ParameterTree::with_trainable`])
//! differentiates with respect to them: this is what training builds on.
//!
//! ```no_run
//! use mlx_models::{LoadOptions, ParameterTree};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut tree = ParameterTree::load("path/to/Qwen3-0.6B", &LoadOptions::default())?;
//! tree.freeze(|name| name.contains("embed_tokens"));
//! println!("{} of {} tensors trainable", tree.trainable_names().len(), tree.len());
//! let model = tree.build(&LoadOptions::default())?.into_lm()?;
//! # drop(model); Ok(()) }
//! ```
use crate::model::{build_over, default_dtype, LoadOptions, LoadedModel};
use crate::registry::{self, Family};
use crate::weights::Weights;
use crate::layers::LoraSettings;
use crate::{config, ModelError, Result};
use mlx_array::{Array, DType};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// One parameter: its array and whether training updates it.
#[derive(Clone)]
pub struct Parameter {
    pub array: Array,
    pub trainable: bool,
    /// Part of a packed quantized layer (`weight`, `scales`, `biases`) or an integer tensor
    /// (FP8 bytes): never trainable.
    pub packed: bool,
}

/// A model's parameters by checkpoint name (sorted), with trainable/frozen marks.
#[derive(Clone)]
pub struct ParameterTree {
    dir: PathBuf,
    config: serde_json::Value,
    family: &'static Family,
    params: BTreeMap<String, Parameter>,
    /// How the LoRA adapters among the parameters run ([`ParameterTree::set_lora`]).
    lora: Option<LoraSettings>,
}

impl ParameterTree {
    /// The parameters of the checkpoint in `dir`: the tensors its family's model reads. Floating
    /// point tensors start trainable; packed quantized weights with their scales and biases, and
    /// other integer tensors (FP8 bytes), start frozen.
    pub fn load(dir: impl AsRef<Path>, opts: &LoadOptions) -> Result<Self> {
        let dir = dir.as_ref();
        let family = registry::detect_model_type(dir)?;
        let config = config::read_config_json(dir)?;
        let mut weights = Weights::load(dir, default_dtype(opts))?;
        weights.log_reads();
        // The model is built for the strict check and the read log, then dropped: only the
        // tensors are kept, so no cache (flat) is needed.
        drop(build_over(dir, &config, &mut weights, family, &flat(opts))?);
        let read = weights.take_read_log();
        let quantized: Vec<String> = read.keys().filter_map(|k| k.strip_suffix(".scales").map(str::to_string)).collect();
        let is_quant = |name: &str| quantized.iter().any(|q| name.strip_prefix(q.as_str()).is_some_and(|r| matches!(r, ".weight" | ".scales" | ".biases")));
        let params = read
            .into_iter()
            .map(|(name, array)| {
                let packed = !array.dtype().is_float() || is_quant(&name);
                (name, Parameter { array, trainable: !packed, packed })
            })
            .collect();
        Ok(ParameterTree { dir: dir.to_path_buf(), config, family, params, lora: None })
    }

    /// The model these parameters make (config.json from the checkpoint directory), with the
    /// strict loading checks of [`crate::load_model`].
    pub fn build(&self, opts: &LoadOptions) -> Result<LoadedModel> {
        let map: HashMap<String, Array> = self.params.iter().map(|(k, p)| (k.clone(), p.array.clone())).collect();
        let mut weights = Weights::from_map(map, &self.dir);
        weights.sources_held = true;
        weights.lora = self.lora.clone();
        build_over(&self.dir, &self.config, &mut weights, self.family, opts)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// The checkpoint directory the tree was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every parameter by name, sorted.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Parameter)> {
        self.params.iter().map(|(k, p)| (k.as_str(), p))
    }

    pub fn get(&self, name: &str) -> Option<&Parameter> {
        self.params.get(name)
    }

    /// Mark the parameters whose names match `pred` frozen; returns how many matched.
    pub fn freeze(&mut self, pred: impl Fn(&str) -> bool) -> usize {
        self.mark(pred, false)
    }

    /// Mark the parameters whose names match `pred` trainable; returns how many changed. Packed
    /// ones ([`Parameter::packed`]) stay frozen.
    pub fn unfreeze(&mut self, pred: impl Fn(&str) -> bool) -> usize {
        self.mark(pred, true)
    }

    fn mark(&mut self, pred: impl Fn(&str) -> bool, trainable: bool) -> usize {
        let mut n = 0;
        for (k, p) in &mut self.params {
            if pred(k) && p.trainable != trainable && !p.packed {
                p.trainable = trainable;
                n += 1;
            }
        }
        n
    }

    /// The names of the trainable parameters, sorted (the order of
    /// [`ParameterTree::trainable_arrays`] and [`ParameterTree::with_trainable`]).
    pub fn trainable_names(&self) -> Vec<&str> {
        self.params.iter().filter(|(_, p)| p.trainable).map(|(k, _)| k.as_str()).collect()
    }

    /// The trainable parameters' arrays, in [`ParameterTree::trainable_names`] order.
    pub fn trainable_arrays(&self) -> Vec<Array> {
        self.params.values().filter(|p| p.trainable).map(|p| p.array.clone()).collect()
    }

    /// A copy whose trainable parameters are `arrays` (in [`ParameterTree::trainable_names`]
    /// order; each with the shape of the one it replaces). Frozen ones are shared.
    pub fn with_trainable(&self, arrays: &[Array]) -> Result<Self> {
        let names = self.trainable_names();
        if names.len() != arrays.len() {
            return Err(ModelError::InvalidInput(format!("{} arrays for {} trainable parameters", arrays.len(), names.len())));
        }
        let mut out = self.clone();
        for (name, a) in names.iter().zip(arrays) {
            out.set(name, a.clone())?;
        }
        Ok(out)
    }

    /// Replace parameter `name`'s array (same shape; a float array for a float parameter).
    pub fn set(&mut self, name: &str, array: Array) -> Result<()> {
        let p = self.params.get_mut(name).ok_or_else(|| ModelError::InvalidInput(format!("no parameter named {name}")))?;
        if array.shape() != p.array.shape() {
            return Err(ModelError::InvalidInput(format!("parameter {name}: shape {:?}, expected {:?}", array.shape(), p.array.shape())));
        }
        if array.dtype().is_float() != p.array.dtype().is_float() {
            return Err(ModelError::InvalidInput(format!("parameter {name}: dtype {}, expected {}", array.dtype(), p.array.dtype())));
        }
        p.array = array;
        Ok(())
    }

    /// Total elements of the trainable parameters.
    pub fn trainable_count(&self) -> usize {
        self.params.values().filter(|p| p.trainable).map(|p| p.array.size()).sum()
    }

    /// The checkpoint's config.json.
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// Add parameter `name` (a LoRA adapter's `lora_a`/`lora_b`; [`ParameterTree::build`]
    /// refuses tensors the model does not read). An existing one of that name is an error.
    pub fn insert(&mut self, name: &str, array: Array, trainable: bool) -> Result<()> {
        if self.params.contains_key(name) {
            return Err(ModelError::InvalidInput(format!("parameter {name} exists already")));
        }
        let packed = !array.dtype().is_float();
        self.params.insert(name.to_string(), Parameter { array, trainable: trainable && !packed, packed });
        Ok(())
    }

    /// Remove parameter `name`, returning it.
    pub fn remove(&mut self, name: &str) -> Option<Parameter> {
        self.params.remove(name)
    }

    /// How projections with LoRA tensors (`prefix.lora_a`, `prefix.lora_b`) run them when the
    /// model is built; `None` (the default) refuses such tensors.
    pub fn set_lora(&mut self, settings: Option<LoraSettings>) {
        self.lora = settings;
    }

    pub fn lora(&self) -> Option<&LoraSettings> {
        self.lora.as_ref()
    }

    /// The dtype of the first floating-point parameter (the checkpoint's compute dtype).
    pub fn float_dtype(&self) -> Option<DType> {
        self.params.values().map(|p| p.array.dtype()).find(|d| d.is_float())
    }
}

fn flat(opts: &LoadOptions) -> LoadOptions {
    LoadOptions { kv_cache: crate::KvCacheMode::Flat, ..opts.clone() }
}
