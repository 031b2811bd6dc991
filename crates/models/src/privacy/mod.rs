//! PII tagging with an OpenAI Privacy Filter checkpoint (`model_type` `openai_privacy_filter`).
//!
//! [`PrivacyFilterModel::classify`]:
//! 1. tokenizes the text without special tokens, with byte offsets (`tokenizers`' convention);
//! 2. runs the bidirectional encoder once over the whole sequence: logits `[1, T, n]` ([`model`]);
//! 3. takes softmax (token scores) and log-softmax (Viterbi emissions) over the classes;
//! 4. merges the checkpoint's transition biases (`viterbi_calibration.json`) with the call's
//!    overrides and decodes the best legal BIOES path ([`viterbi`]);
//! 5. scores each token by the probability of its decoded tag, and returns the entity spans whose
//!    mean token score is at least `threshold`.
//!
//! ```no_run
//! use mlx_models::privacy::{ClassifyOptions, PrivacyFilterModel};
//! let model = PrivacyFilterModel::load("path/to/privacy-filter")?;
//! let text = "Mail jane@doe.com";
//! for e in model.classify(text, &ClassifyOptions::default())?.entities {
//!     println!("{} {}..{} {:.2} {:?}", e.label, e.start, e.end, e.score, &text[e.start..e.end]);
//! }
//! Ok::<(), mlx_models::ModelError>(())
//! ```
pub mod model;
pub mod viterbi;

use crate::chat::{ChatError, Tokenizer};
use crate::weights::Weights;
use crate::{ModelError, Result};
use mlx_array::{Array, DType};
use model::{PrivacyEncoder, PrivacyFilterConfig};
use std::path::{Path, PathBuf};
pub use viterbi::{Calibration, Tag, TagSet, TransitionBiases};

/// The `model_type` this module loads.
pub const MODEL_TYPE: &str = "openai_privacy_filter";
/// The calibration file read at load, when present.
pub const CALIBRATION_FILE: &str = "viterbi_calibration.json";

/// Failures specific to the privacy filter (wrapped in [`ModelError::Privacy`]).
#[derive(Debug, thiserror::Error)]
pub enum PrivacyError {
    /// `id2label` is not a dense BIOES label set, or does not match the score head.
    #[error("bad id2label: {0}")]
    Labels(String),
    /// `viterbi_calibration.json` is unreadable or lacks the six finite biases.
    #[error("bad calibration file {}: {reason}", path.display())]
    Calibration { path: PathBuf, reason: String },
    /// `threshold` is NaN or outside `[0, 1]`.
    #[error("threshold {0} must be a number in [0, 1]")]
    Threshold(f32),
    /// A calibration override is NaN or infinite.
    #[error("calibration override {name} = {value} must be finite")]
    Override { name: &'static str, value: f32 },
    /// The decoder's inputs are inconsistent.
    #[error("BIOES decoding: {0}")]
    Decode(String),
    /// The tokenizer returned offsets that do not delimit the input text.
    #[error("token offsets {start}..{end} do not delimit the {len}-byte input on character boundaries")]
    Offsets { start: usize, end: usize, len: usize },
}

/// Per-call overrides of the checkpoint's transition biases; `None` keeps the checkpoint's value.
pub type CalibrationOverrides = TransitionBiases<Option<f32>>;

impl CalibrationOverrides {
    /// `base` with every set override applied; non-finite overrides are errors.
    pub fn apply(&self, base: &Calibration) -> std::result::Result<Calibration, PrivacyError> {
        let mut c = *base;
        for ((slot, o), name) in c.fields_mut().into_iter().zip(self.values()).zip(Calibration::KEYS) {
            if let Some(v) = o {
                if !v.is_finite() {
                    return Err(PrivacyError::Override { name, value: v });
                }
                *slot = v;
            }
        }
        Ok(c)
    }
}

/// Options of [`PrivacyFilterModel::classify`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClassifyOptions {
    /// Minimum mean token score of a returned entity, in `[0, 1]` (default 0.5).
    pub threshold: f32,
    /// Overrides of the checkpoint's transition biases for this call.
    pub calibration: CalibrationOverrides,
    /// Also return one [`PrivacyToken`] per input token (default false).
    pub return_tokens: bool,
}

impl Default for ClassifyOptions {
    fn default() -> Self {
        ClassifyOptions { threshold: 0.5, calibration: CalibrationOverrides::default(), return_tokens: false }
    }
}

/// A detected entity. `start..end` are byte offsets into the input (`tokenizers`' convention).
#[derive(Debug, Clone, PartialEq)]
pub struct PrivacyEntity {
    /// The class without its BIOES prefix (e.g. `private_email`).
    pub label: String,
    pub start: usize,
    pub end: usize,
    /// Mean over the span's tokens of the softmax probability of each token's decoded tag.
    pub score: f32,
    /// `input[start..end]`.
    pub text: String,
}

/// One input token with its decoded tag.
#[derive(Debug, Clone, PartialEq)]
pub struct PrivacyToken {
    /// `input[start..end]` (tokens inside one multi-byte character share its whole range).
    pub text: String,
    /// The full BIOES label chosen by the decoder (`O`, `B-…`, `I-…`, `E-…`, `S-…`).
    pub tag: String,
    /// Softmax probability of `tag` at this token (it may differ from the local argmax).
    pub score: f32,
    pub start: usize,
    pub end: usize,
}

/// Result of [`PrivacyFilterModel::classify`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ClassifyResult {
    pub entities: Vec<PrivacyEntity>,
    /// `Some` when [`ClassifyOptions::return_tokens`] is set.
    pub tokens: Option<Vec<PrivacyToken>>,
}

/// A loaded privacy-filter checkpoint: encoder, tokenizer, label set and default calibration.
pub struct PrivacyFilterModel {
    encoder: PrivacyEncoder,
    tokenizer: Tokenizer,
    tags: TagSet,
    calibration: Calibration,
    dir: PathBuf,
}

impl std::fmt::Debug for PrivacyFilterModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrivacyFilterModel").field("dir", &self.dir).field("labels", &self.tags.labels).field("calibration", &self.calibration).finish()
    }
}

fn read_config(dir: &Path) -> Result<PrivacyFilterConfig> {
    let path = dir.join("config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(ModelError::ConfigNotFound(dir.to_path_buf())),
        Err(e) => return Err(ModelError::io(&path, e)),
    };
    let raw: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::MalformedConfig { path: path.clone(), reason: e.to_string() })?;
    let model_type = raw.get("model_type").and_then(|m| m.as_str()).unwrap_or_default();
    if model_type != MODEL_TYPE {
        return Err(ModelError::UnsupportedModelType { path: dir.to_path_buf(), model_type: model_type.to_string() });
    }
    serde_json::from_value(raw).map_err(|e| ModelError::MalformedConfig { path, reason: e.to_string() })
}

/// `operating_points.default.biases` of a calibration file: exactly the six keys, finite numbers.
pub fn read_calibration(path: &Path) -> std::result::Result<Calibration, PrivacyError> {
    let bad = |reason: String| PrivacyError::Calibration { path: path.to_path_buf(), reason };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let root: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let biases = root
        .pointer("/operating_points/default/biases")
        .and_then(|b| b.as_object())
        .ok_or_else(|| bad("no object at operating_points.default.biases".into()))?;
    if let Some(k) = biases.keys().find(|k| !Calibration::KEYS.contains(&k.as_str())) {
        return Err(bad(format!("unknown bias {k:?} (expected {})", Calibration::KEYS.join(", "))));
    }
    let mut c = Calibration::default();
    for (slot, key) in c.fields_mut().into_iter().zip(Calibration::KEYS) {
        let v = biases.get(key).ok_or_else(|| bad(format!("missing {key}")))?;
        let x = v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| bad(format!("{key} is {v}, not a finite number")))?;
        *slot = x as f32;
    }
    Ok(c)
}

impl PrivacyFilterModel {
    /// Load `config.json`, the safetensors weights (`model.safetensors`, or sharded with its
    /// index), `tokenizer.json` (with `tokenizer_config.json` when present) and, when present,
    /// `viterbi_calibration.json` (otherwise every bias is 0). Weights are held in f32 and computed
    /// before this returns, so the model can move to another thread.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let cfg = read_config(dir)?;
        let tags = TagSet::from_id2label(&cfg.id2label_pairs()?)?;
        if let Some(n) = cfg.num_labels.filter(|n| *n != tags.len()) {
            return Err(PrivacyError::Labels(format!("num_labels {n} but id2label has {} labels", tags.len())).into());
        }
        let cal_path = dir.join(CALIBRATION_FILE);
        let calibration = if cal_path.exists() { read_calibration(&cal_path)? } else { Calibration::default() };
        let tokenizer = Tokenizer::from_dir(dir)?;
        let weights = Weights::load(dir, Some(DType::F32))?;
        let encoder = PrivacyEncoder::load(&weights, &cfg, tags.len())?;
        // Compute every weight and derived array on this thread (one token through every layer):
        // MLX binds a lazy array to a stream of the thread that made it, so a model whose arrays
        // were still lazy could not run on another thread.
        encoder.forward(&[0])?.eval()?;
        Ok(PrivacyFilterModel { encoder, tokenizer, tags, calibration, dir: dir.to_path_buf() })
    }

    /// The label set, in class order.
    pub fn tags(&self) -> &TagSet {
        &self.tags
    }

    /// The checkpoint's transition biases (all 0 without a calibration file).
    pub fn calibration(&self) -> &Calibration {
        &self.calibration
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Classifier logits `[1, T, num_labels]` (f32) for `ids`.
    pub fn logits(&self, ids: &[u32]) -> Result<Array> {
        self.encoder.forward(ids)
    }

    /// Tag `text`; see the module documentation for the pipeline.
    pub fn classify(&self, text: &str, opts: &ClassifyOptions) -> Result<ClassifyResult> {
        if !(0.0..=1.0).contains(&opts.threshold) {
            return Err(PrivacyError::Threshold(opts.threshold).into());
        }
        let cal = opts.calibration.apply(&self.calibration)?;
        let empty = ClassifyResult { entities: Vec::new(), tokens: opts.return_tokens.then(Vec::new) };
        if text.is_empty() {
            return Ok(empty);
        }
        let enc = self.tokenizer.inner().encode(text, false).map_err(|e| ModelError::Chat(ChatError::Encode(e.to_string())))?;
        let ids = enc.get_ids();
        if ids.is_empty() {
            return Ok(empty);
        }
        let offsets = enc.get_offsets();
        for &(s, e) in offsets {
            if s > e || text.get(s..e).is_none() {
                return Err(PrivacyError::Offsets { start: s, end: e, len: text.len() }.into());
            }
        }
        let n = self.tags.len();
        let logits = self.logits(ids)?.to_vec::<f32>()?;
        let (emissions, probs) = log_softmax_rows(&logits, n);
        let path = viterbi::viterbi(&emissions, n, &self.tags, &cal)?;
        let score = |t: usize| probs[t * n + path[t]];
        let entities = viterbi::spans(&path, &self.tags)
            .into_iter()
            .filter_map(|s| {
                let mean = ((s.start..s.end).map(|t| score(t) as f64).sum::<f64>() / (s.end - s.start) as f64) as f32;
                let (start, end) = (offsets[s.start].0, offsets[s.end - 1].1);
                (mean >= opts.threshold).then(|| PrivacyEntity { label: self.tags.entities[s.entity].clone(), start, end, score: mean, text: text[start..end].to_string() })
            })
            .collect();
        let tokens = opts.return_tokens.then(|| {
            offsets
                .iter()
                .enumerate()
                .map(|(t, &(start, end))| PrivacyToken { text: text[start..end].to_string(), tag: self.tags.labels[path[t]].clone(), score: score(t), start, end })
                .collect()
        });
        Ok(ClassifyResult { entities, tokens })
    }
}

/// Row-wise log-softmax and softmax of `[T, n]` logits (computed in f64).
pub fn log_softmax_rows(logits: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut logp = Vec::with_capacity(logits.len());
    let mut p = Vec::with_capacity(logits.len());
    for row in logits.chunks(n) {
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        for &x in row {
            let l = x as f64 - lse;
            logp.push(l as f32);
            p.push(l.exp() as f32);
        }
    }
    (logp, p)
}
