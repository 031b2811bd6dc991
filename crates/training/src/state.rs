//! Saving and loading optimizer state (mlx-node's safetensors layout) and whole checkpoints.
//!
//! Optimizer state file: one safetensors file. AdamW writes `{param}.m` and `{param}.v` for every
//! parameter it has updated, and `__metadata__` `{"step": "<updates>", "format":
//! "adamw_optimizer_state"}` (mlx-node's layout). SGD with momentum writes `{param}.momentum` and
//! `{"step", "format": "sgd_momentum_optimizer_state"}`. Plain SGD has no state and writes no
//! file; neither does an optimizer before its first update.
//!
//! Checkpoint directory ([`save_checkpoint`]): `model.safetensors` (the parameters by checkpoint
//! name), the source checkpoint's config and tokenizer files, `optimizer.safetensors` (when the
//! optimizer has state) and `trainer_state.json`. It is assembled in a temporary sibling
//! directory and renamed into place; a directory already there is first renamed to
//! `<dir>.previous` and removed after, so an interrupted save leaves either the old or the new
//! checkpoint complete ([`resolve_checkpoint`] finds it).
use crate::error::{io_err, Result, TrainError};
use crate::optim::{Optimizer, OptimizerConfig, Slot};
use mlx_array::{Array, DType};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const ADAMW_FORMAT: &str = "adamw_optimizer_state";
pub const SGD_MOMENTUM_FORMAT: &str = "sgd_momentum_optimizer_state";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const MODEL_FILE: &str = "model.safetensors";
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";

/// Write `opt`'s state to `path` (atomically). Returns `false`, writing nothing, when there is
/// no state yet (before the first update) or none at all (plain SGD).
pub fn save_optimizer_state(opt: &Optimizer, path: &Path) -> Result<bool> {
    if opt.step() == 0 || opt.slots.is_empty() || !opt.has_state() {
        return Ok(false);
    }
    let format = match opt.config() {
        OptimizerConfig::AdamW(_) => ADAMW_FORMAT,
        OptimizerConfig::Sgd(_) => SGD_MOMENTUM_FORMAT,
    };
    let mut named: Vec<(String, &Array)> = Vec::new();
    for (name, slot) in &opt.slots {
        match slot {
            Slot::Adam { m, v } => {
                named.push((format!("{name}.m"), m));
                named.push((format!("{name}.v"), v));
            }
            Slot::Momentum(b) => named.push((format!("{name}.momentum"), b)),
        }
    }
    let tensors: Vec<(&str, &Array)> = named.iter().map(|(n, a)| (n.as_str(), *a)).collect();
    let meta = HashMap::from([("step".to_string(), opt.step().to_string()), ("format".to_string(), format.to_string())]);
    mlx_array::io::save_safetensors(path, &tensors, Some(&meta))?;
    Ok(true)
}

/// Restore `opt`'s step and per-parameter state from `path`, for the parameters `names` (each
/// must have its tensors in the file, with the parameter's shape in `shapes`).
pub fn load_optimizer_state(opt: &mut Optimizer, path: &Path, names: &[&str], shapes: &[Vec<usize>]) -> Result<()> {
    let bad = |msg: String| TrainError::State { path: path.to_path_buf(), msg };
    let file = mlx_array::io::SafetensorsFile::open(path)?;
    let meta = file.metadata();
    let (want, suffixes): (&str, &[&str]) = match opt.config() {
        OptimizerConfig::AdamW(_) => (ADAMW_FORMAT, &["m", "v"]),
        OptimizerConfig::Sgd(_) => (SGD_MOMENTUM_FORMAT, &["momentum"]),
    };
    match meta.get("format") {
        Some(f) if f == want => {}
        other => return Err(bad(format!("format {other:?}, expected {want:?}"))),
    }
    let step: u64 = meta.get("step").ok_or_else(|| bad("no \"step\" in __metadata__".into()))?.parse().map_err(|e| bad(format!("step: {e}")))?;
    let mut slots = std::collections::BTreeMap::new();
    for (name, shape) in names.iter().zip(shapes) {
        let mut got = Vec::new();
        for s in suffixes {
            let key = format!("{name}.{s}");
            if !file.contains(&key) {
                return Err(bad(format!("no tensor {key}")));
            }
            let a = file.load(&key, Some(DType::F32))?;
            if &a.shape() != shape {
                return Err(bad(format!("{key}: shape {:?}, parameter shape {shape:?}", a.shape())));
            }
            got.push(a);
        }
        let slot = match <[Array; 2]>::try_from(got) {
            Ok([m, v]) => Slot::Adam { m, v },
            Err(mut one) => Slot::Momentum(one.remove(0)),
        };
        slots.insert(name.to_string(), slot);
    }
    let expected = names.len() * suffixes.len();
    if file.tensors().len() != expected {
        return Err(bad(format!("{} tensors, expected {expected} for {} trainable parameters", file.tensors().len(), names.len())));
    }
    opt.slots = slots;
    opt.set_step(step);
    Ok(())
}

/// Trainer progress saved with a checkpoint: enough to continue exactly where it stopped.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    /// Optimizer updates applied.
    pub step: u64,
    /// Current epoch (0-based).
    pub epoch: u64,
    /// Index of the next example in the current epoch's order.
    pub position: usize,
    /// The shuffle generator's state at the start of the current epoch.
    pub epoch_rng: u64,
    /// The run's seed.
    pub seed: u64,
    /// Number of examples the run trains on (checked on resume).
    pub dataset_len: usize,
    /// Names of the trained parameters.
    pub trainable: Vec<String>,
    /// `"adamw"` or `"sgd"`.
    pub optimizer: String,
    /// Examples per micro-batch, micro-batches per update and whether epochs are shuffled: a
    /// resumed run must use the same to see the same batches.
    pub batch_size: usize,
    pub grad_accumulation: usize,
    pub shuffle: bool,
    /// Updates skipped for non-finite gradients so far ([`crate::guard::NanGuard`]).
    #[serde(default)]
    pub nan_skipped: u64,
}

/// `dir`, or, when a save was interrupted between its two renames, `<dir>.previous`.
pub fn resolve_checkpoint(dir: &Path) -> Result<PathBuf> {
    if dir.join(TRAINER_STATE_FILE).is_file() {
        return Ok(dir.to_path_buf());
    }
    let prev = sibling(dir, "previous");
    if prev.join(TRAINER_STATE_FILE).is_file() {
        return Ok(prev);
    }
    Err(TrainError::State { path: dir.to_path_buf(), msg: format!("no {TRAINER_STATE_FILE}: not a training checkpoint") })
}

fn sibling(dir: &Path, tag: &str) -> PathBuf {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "checkpoint".into());
    dir.with_file_name(format!("{name}.{tag}"))
}

/// Files copied from the source checkpoint next to the trained weights.
const SIDE_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// What [`save_checkpoint`] writes.
pub struct CheckpointContents<'a> {
    /// Parameters by checkpoint name.
    pub params: Vec<(&'a str, &'a Array)>,
    /// dtype the weights are written in (`None`: as they are).
    pub save_dtype: Option<DType>,
    /// The checkpoint the run started from (config and tokenizer files are copied from it).
    pub source_dir: &'a Path,
    pub optimizer: &'a Optimizer,
    pub trainer: &'a TrainerState,
}

/// Write a checkpoint to `dir` atomically (see the module docs).
pub fn save_checkpoint(dir: &Path, c: &CheckpointContents) -> Result<()> {
    write_dir_atomically(dir, |tmp| {
        write_model_files(tmp, MODEL_FILE, &c.params, c.save_dtype, c.source_dir)?;
        write_training_state(tmp, c.optimizer, c.trainer)
    })
}

/// `optimizer.safetensors` (when the optimizer has state) and `trainer_state.json` in `dir`.
pub(crate) fn write_training_state(dir: &Path, optimizer: &Optimizer, trainer: &TrainerState) -> Result<()> {
    save_optimizer_state(optimizer, &dir.join(OPTIMIZER_FILE))?;
    let state = dir.join(TRAINER_STATE_FILE);
    let text = serde_json::to_string_pretty(trainer).map_err(|e| TrainError::State { path: state.clone(), msg: e.to_string() })?;
    std::fs::write(&state, text + "\n").map_err(io_err(&state))
}

/// `params` as `dir/<model_file>` (in `save_dtype` when given) with the config (its dtype
/// entries set to what was written) and tokenizer files of `source_dir`: a model directory in
/// Hugging Face's layout.
pub(crate) fn write_model_files(dir: &Path, model_file: &str, params: &[(&str, &Array)], save_dtype: Option<DType>, source_dir: &Path) -> Result<()> {
    let cast: Vec<(&str, Array)> = params
        .iter()
        .map(|(n, a)| {
            Ok((
                *n,
                match save_dtype {
                    Some(d) if a.dtype().is_float() && a.dtype() != d => a.astype(d)?,
                    _ => (*a).clone(),
                },
            ))
        })
        .collect::<Result<_>>()?;
    let refs: Vec<(&str, &Array)> = cast.iter().map(|(n, a)| (*n, a)).collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    mlx_array::io::save_safetensors(dir.join(model_file), &refs, Some(&meta))?;
    for f in SIDE_FILES {
        let src = source_dir.join(f);
        if !src.is_file() {
            continue;
        }
        if *f == "config.json" {
            let text = std::fs::read_to_string(&src).map_err(io_err(&src))?;
            let mut cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| TrainError::State { path: src.clone(), msg: e.to_string() })?;
            let float = params.iter().map(|(_, a)| save_dtype.unwrap_or(a.dtype())).find(|d| d.is_float());
            if let (Some(obj), Some(d)) = (cfg.as_object_mut(), float) {
                for key in ["torch_dtype", "dtype"] {
                    if obj.contains_key(key) {
                        obj.insert(key.into(), d.torch_name().into());
                    }
                }
            }
            let out = dir.join(f);
            let text = serde_json::to_string_pretty(&cfg).map_err(|e| TrainError::State { path: out.clone(), msg: e.to_string() })?;
            std::fs::write(&out, text + "\n").map_err(io_err(&out))?;
        } else {
            std::fs::copy(&src, dir.join(f)).map_err(io_err(&src))?;
        }
    }
    Ok(())
}

/// Fill a temporary sibling of `dir` with `fill` and rename it into place: a directory already
/// there is first renamed to `<dir>.previous` and removed after, so an interruption leaves
/// either the old or the new directory complete ([`resolve_checkpoint`] finds it).
pub(crate) fn write_dir_atomically(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = sibling(dir, &format!("tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    let result = (|| {
        fill(&tmp)?;
        if let Ok(d) = std::fs::File::open(&tmp) {
            let _ = d.sync_all();
        }
        let prev = sibling(dir, "previous");
        if dir.exists() {
            // `<dir>` is complete: an older `<dir>.previous` is not needed any more
            if prev.exists() {
                std::fs::remove_dir_all(&prev).map_err(io_err(&prev))?;
            }
            std::fs::rename(dir, &prev).map_err(io_err(dir))?;
        }
        // (when `<dir>` is missing and `<dir>.previous` exists, an earlier save stopped between
        // the renames: the previous checkpoint stays until the new one is in place)
        std::fs::rename(&tmp, dir).map_err(io_err(dir))?;
        if prev.exists() {
            std::fs::remove_dir_all(&prev).map_err(io_err(&prev))?;
        }
        Ok(())
    })();
    if result.is_err() && tmp.exists() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// Read `trainer_state.json` of a checkpoint directory.
pub fn read_trainer_state(dir: &Path) -> Result<TrainerState> {
    let p = dir.join(TRAINER_STATE_FILE);
    let text = std::fs::read_to_string(&p).map_err(io_err(&p))?;
    serde_json::from_str(&text).map_err(|e| TrainError::State { path: p, msg: e.to_string() })
}
