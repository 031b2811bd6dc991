//! Static activation-amax calibration (NVIDIA modelopt's `MaxCalibrator`: per tensor,
//! `amax = max over every calibration sample of max |x|`) and the forward that reads it.
//!
//! **Sites.** The projections whose input activations are quantised, by the mode the checkpoint
//! stores them in (MLX's modes; modelopt's recipes):
//! - `mxfp8` attention projections (`self_attn.{q,k,v,o}_proj`, or a gated-delta layer's
//!   `linear_attn.{in_proj_qkv,in_proj_z,in_proj_qkvz,out_proj}`): NVIDIA's mxfp8-attention
//!   recipe (W8A8 attention, weight-only elsewhere); activations in E4M3 with one scale per
//!   tensor, `x_q = from_fp8(to_fp8(x * 448/amax)) * amax/448` in f32 (MLX's `to_fp8` saturates
//!   at +-448);
//! - `nvfp4` linear layers other than `lm_head` (modelopt's NVFP4 W4A4): activations in NVFP4,
//!   E2M1 values with an E4M3 scale per 16 and the calibrated maximum as the tensor scale
//!   (MLX's `quantize(x, "nvfp4", global_scale = amax)` and back, in f32; MLX's global scale is
//!   the tensor maximum, modelopt's `input_scale` is the same number over 6 * 448).
//!
//! Every other layer keeps its activations as they are, stacked MoE experts (`gather_qmm`) and
//! embeddings included: their inputs are not recorded, and an `input_amax` that no projection of
//! the loaded model reads is a load error. MLX has no product of two quantized
//! operands on the CPU, so the quantised activation is dequantized before the product: the
//! numerics of W8A8 / W4A4, not their speed. It applies on both weight paths (packed
//! `quantized_matmul`, or dequantized at load).
//!
//! **Calibration.** [`calibrate_activation_amax`] loads the checkpoint, encodes each text with the
//! tokenizer's own special tokens and no chat template, keeps at most `seq_len` tokens, and runs a
//! prefill (no generation, every position through every layer) per text with a fresh cache,
//! recording the input `max |x|` of every site. The result goes into config.json as `input_amax`
//! of each site's per-layer entry, under `quantization` and `quantization_config` alike (an
//! entry is created from the layer's mode where the config has only the default); the file is
//! replaced atomically (temporary file, fsync, rename). One calibration runs at a time in a
//! process: a second one fails at once with [`CalibrateError::Busy`]. Any error (no text gave a
//! token, no site in the model, a non-finite maximum, I/O) leaves config.json byte for byte as it
//! was. While calibrating, the activation quantisation is off, so a calibrated checkpoint
//! re-calibrates on its raw activations.
//!
//! **Loading.** An `input_amax` on a layer that is not a site (affine, mxfp4, an mxfp8 MLP, an
//! unquantized layer, `lm_head`) is a load error: it is never dropped silently. mlx-lm passes
//! per-layer entries to `to_quantized` as keyword arguments, so a config with `input_amax` does
//! not load in mlx-lm 0.32 as it is.
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, TryLockError};

use mlx_array::{Array, DType, QuantMode};
use serde_json::{json, Value};

use crate::chat::Tokenizer;
use crate::weights::Vb;
use crate::{load_model, LoadOptions, Logits, ModelError};

/// E4M3's largest finite magnitude.
const E4M3_MAX: f32 = 448.0;

/// The attention projections of the mxfp8-attention recipe.
const MXFP8_SITES: [&str; 8] = [
    ".self_attn.q_proj",
    ".self_attn.k_proj",
    ".self_attn.v_proj",
    ".self_attn.o_proj",
    ".linear_attn.in_proj_qkv",
    ".linear_attn.in_proj_z",
    ".linear_attn.in_proj_qkvz",
    ".linear_attn.out_proj",
];

/// Why a calibration failed. config.json is unchanged after each of them.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    #[error("another activation-amax calibration is in progress in this process")]
    Busy,
    #[error("seq_len must be at least 1")]
    ZeroSeqLen,
    #[error("no calibration rows: none of the {texts} texts encoded to a token")]
    NoRows { texts: usize },
    #[error("{}: the model has no activation-quantised projection (mxfp8 attention projections, nvfp4 linear layers); nothing to calibrate", .0.display())]
    NoSites(PathBuf),
    #[error("non-finite activation maximum {value} at {layer}: the prefill overflowed")]
    NonFinite { layer: String, value: f32 },
    #[error("{}: quantization entry {layer:?} is {entry}, not an object that can hold input_amax", path.display())]
    BadEntry { path: PathBuf, layer: String, entry: String },
    #[error("{}: {msg}", path.display())]
    BadConfig { path: PathBuf, msg: String },
    #[error("I/O error on {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Array(#[from] mlx_array::Error),
}

/// What a calibration measured and wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CalibrationSummary {
    /// Projections calibrated (entries written per config alias).
    pub projections: usize,
    /// Texts prefilled (texts that encoded to no token are skipped).
    pub rows: usize,
    /// Tokens prefilled in all.
    pub tokens: usize,
    /// The maxima written, by layer.
    pub amax: BTreeMap<String, f32>,
    pub seconds: f64,
}

/// One row done (for progress bars).
pub struct CalibrationProgress {
    pub row: usize,
    pub rows: usize,
    pub tokens: usize,
}

/// Serialises calibrations within the process.
static CALIBRATION: Mutex<()> = Mutex::new(());

thread_local! {
    /// Whether this thread is running a calibration prefill.
    static ARMED: Cell<bool> = const { Cell::new(false) };
    /// Running maxima (lazy arrays, evaluated after each row) and modes, by layer.
    static AMAX: RefCell<HashMap<String, (Array, QuantMode)>> = RefCell::new(HashMap::new());
}

/// Arms this thread for the life of the guard; dropping it (any exit path) disarms it and drops
/// what was recorded.
struct Armed;

impl Armed {
    fn new() -> Self {
        AMAX.with(|m| m.borrow_mut().clear());
        ARMED.with(|a| a.set(true));
        Armed
    }
    /// Evaluate the running maxima (after a row).
    fn eval(&self) -> Result<(), CalibrateError> {
        AMAX.with(|m| {
            let m = m.borrow();
            let all: Vec<&Array> = m.values().map(|(a, _)| a).collect();
            mlx_array::eval(&all).map_err(CalibrateError::from)
        })
    }
    fn take(&self) -> Result<BTreeMap<String, (f32, QuantMode)>, CalibrateError> {
        let m = AMAX.with(|m| std::mem::take(&mut *m.borrow_mut()));
        m.into_iter().map(|(k, (a, mode))| Ok((k, (a.item_f32()?, mode)))).collect()
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        ARMED.with(|a| a.set(false));
        AMAX.with(|m| m.borrow_mut().clear());
    }
}

/// Whether `layer`, stored in `mode`, is an activation-quantised site.
fn is_site(layer: &str, mode: QuantMode) -> bool {
    match mode {
        QuantMode::Mxfp8 => MXFP8_SITES.iter().any(|s| layer.ends_with(s)),
        QuantMode::Nvfp4 => layer != "lm_head" && !layer.ends_with(".lm_head"),
        _ => false,
    }
}

/// The error for an `input_amax` on `layer` in `mode` when it is not a site.
pub(crate) fn check_site(layer: &str, mode: QuantMode) -> Result<(), String> {
    if !is_site(layer, mode) {
        return Err(format!(
            "quantization.{layer} has input_amax but is a {} layer that quantises no activation: activation quantisation is implemented for mxfp8 attention projections and nvfp4 linear layers",
            mode.name()
        ));
    }
    Ok(())
}

/// An activation-quantised projection: its layer path, mode and calibrated maximum, if any.
#[derive(Clone, Debug)]
pub(crate) struct ActSite {
    key: String,
    mode: QuantMode,
    input_amax: Option<f32>,
}

impl ActSite {
    /// The site of the layer under `vb`, if it is one; an `input_amax` on any other layer is an
    /// error.
    pub(crate) fn for_layer(vb: &Vb) -> crate::Result<Option<ActSite>> {
        let Some(spec) = vb.weights().quant.as_ref() else { return Ok(None) };
        let key = vb.prefix();
        let amax = spec.input_amax.get(key).copied();
        let mode = if vb.is_quantized() {
            match spec.layers.get(key) {
                Some(m) => *m,
                None => Some(spec.default),
            }
        } else {
            None
        };
        let site = mode.filter(|&m| is_site(key, m));
        if let (Some(a), None) = (amax, site) {
            let what = match mode {
                Some(m) => format!("a {} layer that quantises no activation", m.name()),
                None => "an unquantized layer".to_string(),
            };
            return Err(ModelError::UnsupportedOption(format!(
                "{key} has input_amax {a} but is {what}: activation quantisation is implemented for mxfp8 attention projections and nvfp4 linear layers"
            )));
        }
        if let (Some(_), Some(_)) = (amax, site) {
            spec.amax_read.lock().unwrap_or_else(|e| e.into_inner()).insert(key.to_string());
        }
        Ok(site.map(|mode| ActSite { key: key.to_string(), mode, input_amax: amax }))
    }

    /// The input the product sees: recorded while calibrating (and left as it is), else
    /// quantised and dequantised when calibrated.
    pub(crate) fn input(&self, x: &Array) -> crate::Result<Option<Array>> {
        if ARMED.with(Cell::get) {
            let m = x.abs()?.max(&[], false)?.astype(DType::F32)?;
            AMAX.with(|map| -> crate::Result<()> {
                let mut map = map.borrow_mut();
                let next = match map.remove(&self.key) {
                    Some((prev, _)) => prev.maximum(&m)?,
                    None => m,
                };
                map.insert(self.key.clone(), (next, self.mode));
                Ok(())
            })?;
            return Ok(None);
        }
        match (self.input_amax, self.mode) {
            (Some(amax), QuantMode::Mxfp8) => Ok(Some(fp8_fake_quant(x, amax)?)),
            (Some(amax), QuantMode::Nvfp4) => Ok(Some(nvfp4_fake_quant(x, amax)?)),
            _ => Ok(None),
        }
    }
}

/// NVFP4 quantize-dequantize of `x` (`[.., k]`, `k` a multiple of 16) with the calibrated
/// maximum `amax` (> 0) as MLX's global scale, in f32, returned in `x`'s dtype.
pub fn nvfp4_fake_quant(x: &Array, amax: f32) -> mlx_array::Result<Array> {
    let g = Array::scalar(amax);
    let q = x.astype(DType::F32)?.quantize_scaled(QuantMode::Nvfp4, Some(&g))?;
    q.dequantize_scaled(Some(DType::F32), Some(&g))?.astype(x.dtype())
}

/// Per-tensor E4M3 quantize-dequantize of `x` with maximum `amax` (> 0), in f32, returned in
/// `x`'s dtype.
pub fn fp8_fake_quant(x: &Array, amax: f32) -> mlx_array::Result<Array> {
    let xf = x.astype(DType::F32)?;
    let q = xf.mul_scalar(E4M3_MAX / amax)?.to_fp8()?;
    q.from_fp8(DType::F32)?.mul_scalar(amax / E4M3_MAX)?.astype(x.dtype())
}

/// Calibrate the activation maxima of the checkpoint in `dir` over `texts` (prefill only, each
/// text cut to `seq_len` tokens) and write them into its config.json. See the module docs.
pub fn calibrate_activation_amax(dir: &Path, texts: &[String], seq_len: usize) -> Result<CalibrationSummary, CalibrateError> {
    calibrate_activation_amax_with(dir, texts, seq_len, |_| {})
}

/// [`calibrate_activation_amax`], calling `progress` after each prefilled row.
pub fn calibrate_activation_amax_with(
    dir: &Path,
    texts: &[String],
    seq_len: usize,
    mut progress: impl FnMut(CalibrationProgress),
) -> Result<CalibrationSummary, CalibrateError> {
    let t0 = std::time::Instant::now();
    let _lock = match CALIBRATION.try_lock() {
        Ok(g) => g,
        // a calibration that panicked released the lock; its state died with its thread
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => return Err(CalibrateError::Busy),
    };
    if seq_len == 0 {
        return Err(CalibrateError::ZeroSeqLen);
    }
    let cfg_path = dir.join("config.json");
    let original = std::fs::read(&cfg_path).map_err(|source| CalibrateError::Io { path: cfg_path.clone(), source })?;
    let model = load_model(dir, &LoadOptions::default())?.into_lm()?;
    let tokenizer = Tokenizer::from_dir(dir).map_err(ModelError::from)?;
    let rows: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| {
            let mut ids = tokenizer.encode(t, true).map_err(ModelError::from)?;
            ids.truncate(seq_len);
            Ok(ids)
        })
        .collect::<Result<Vec<_>, CalibrateError>>()?
        .into_iter()
        .filter(|ids| !ids.is_empty())
        .collect();
    if rows.is_empty() {
        return Err(CalibrateError::NoRows { texts: texts.len() });
    }
    let armed = Armed::new();
    let mut tokens = 0;
    for (i, ids) in rows.iter().enumerate() {
        let mut cache = model.new_cache();
        let t = Array::from_slice(ids, &[1, ids.len()])?;
        // hidden states of every position, no output head: every layer runs on every row (a
        // last-position request would let the last layer query one row only)
        let out = model.forward(&t, &mut cache, Logits::None, true)?;
        if let Some(h) = &out.hidden {
            h.eval()?;
        }
        armed.eval()?;
        tokens += ids.len();
        progress(CalibrationProgress { row: i, rows: rows.len(), tokens });
    }
    let amax = armed.take()?;
    drop(armed);
    if amax.is_empty() {
        return Err(CalibrateError::NoSites(dir.to_path_buf()));
    }
    if let Some((layer, &(value, _))) = amax.iter().find(|(_, (v, _))| !v.is_finite()) {
        return Err(CalibrateError::NonFinite { layer: layer.clone(), value });
    }
    let updated = with_amax(&cfg_path, &original, &amax)?;
    mlx_array::io::write_atomic(&cfg_path, &updated)?;
    let amax: BTreeMap<String, f32> = amax.into_iter().map(|(k, (a, _))| (k, a)).collect();
    Ok(CalibrationSummary { projections: amax.len(), rows: rows.len(), tokens, amax, seconds: t0.elapsed().as_secs_f64() })
}

/// config.json's bytes with `input_amax` set in each site's per-layer entry of every
/// quantization alias present.
fn with_amax(path: &Path, original: &[u8], amax: &BTreeMap<String, (f32, QuantMode)>) -> Result<Vec<u8>, CalibrateError> {
    let bad = |msg: String| CalibrateError::BadConfig { path: path.to_path_buf(), msg };
    let mut config: Value = serde_json::from_slice(original).map_err(|e| bad(e.to_string()))?;
    let root = config.as_object_mut().ok_or_else(|| bad("root is not an object".into()))?;
    let mut aliases = 0;
    for alias in ["quantization", "quantization_config"] {
        let Some(block) = root.get_mut(alias).and_then(Value::as_object_mut) else { continue };
        aliases += 1;
        for (layer, &(a, mode)) in amax {
            // a layer that had no entry of its own gets its mode spelled out
            let own = || json!({"group_size": mode.group_size(), "bits": mode.bits(), "mode": mode.name()});
            match block.entry(layer.clone()).or_insert_with(own) {
                Value::Object(obj) => {
                    obj.insert("input_amax".into(), json!(a));
                }
                other => return Err(CalibrateError::BadEntry { path: path.to_path_buf(), layer: layer.clone(), entry: other.to_string() }),
            }
        }
    }
    if aliases == 0 {
        return Err(bad("no quantization object to record input_amax in".into()));
    }
    let mut out = serde_json::to_vec_pretty(&config).map_err(|e| bad(e.to_string()))?;
    out.push(b'\n');
    Ok(out)
}

