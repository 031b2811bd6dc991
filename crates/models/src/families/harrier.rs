//! Harrier embeddings: a Qwen3 backbone (`Qwen3Model` checkpoint, keys without `model.`),
//! last-token pooling and L2 normalization, as in the checkpoint's sentence-transformers modules.
use super::qwen3::{Qwen3Backbone, Qwen3Config};
use crate::cache::Cache;
use crate::weights::Weights;
use crate::{ModelError, Result};
use mlx_array::{Array, DType};
use std::collections::BTreeMap;
use crate::registry::{Built, LoadContext, Preset};
use std::path::Path;

/// A loaded embedding model: `Send + Sync`, so one `Arc<HarrierModel>` serves several threads
/// (forward passes take turns).
pub struct HarrierModel {
    backbone: std::sync::Mutex<Qwen3Backbone>,
    cfg: Qwen3Config,
    /// Named instruction prefixes from `config_sentence_transformers.json` (`query`, `document`).
    pub prompts: BTreeMap<String, String>,
    pub default_prompt_name: Option<String>,
    normalize: bool,
    /// The checkpoint's tokenizer, when it ships one (text encoding needs it).
    tokenizer: Option<crate::chat::Tokenizer>,
}

impl HarrierModel {
    pub fn new(dir: &Path, weights: &Weights, cfg: Qwen3Config) -> Result<Self> {
        cfg.validate().map_err(|reason| ModelError::MalformedConfig { path: dir.to_path_buf(), reason })?;
        // Qwen3Model checkpoints have no `model.` prefix; some exports keep it.
        let root = weights.root();
        let vb = if root.contains("model.embed_tokens.weight") { root.pp("model") } else { root };
        let backbone = Qwen3Backbone::load(&vb, &cfg)?;
        let (mut prompts, mut default_prompt_name) = (BTreeMap::new(), None);
        if let Ok(s) = std::fs::read_to_string(dir.join("config_sentence_transformers.json")) {
            let v: serde_json::Value = serde_json::from_str(&s).map_err(|e| ModelError::MalformedConfig {
                path: dir.to_path_buf(),
                reason: format!("config_sentence_transformers.json: {e}"),
            })?;
            if let Some(p) = v.get("prompts").and_then(|p| p.as_object()) {
                for (k, v) in p {
                    prompts.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
                }
            }
            default_prompt_name = v.get("default_prompt_name").and_then(|x| x.as_str()).map(String::from);
        }
        // Normalization is on unless modules.json lists no Normalize module.
        let normalize = match std::fs::read_to_string(dir.join("modules.json")) {
            Ok(s) => s.contains("Normalize"),
            Err(_) => true,
        };
        let tokenizer = if dir.join("tokenizer.json").exists() { Some(crate::chat::Tokenizer::from_dir(dir)?) } else { None };
        Ok(HarrierModel { backbone: std::sync::Mutex::new(backbone), cfg, prompts, default_prompt_name, normalize, tokenizer })
    }

    pub fn hidden_size(&self) -> usize {
        self.cfg.hidden_size
    }
    pub fn max_length(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    /// Embed one token sequence (truncated to `max_position_embeddings`): the final-normed hidden
    /// state of its last token, L2-normalized.
    pub fn encode_ids(&self, ids: &[u32]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(ModelError::InvalidInput("cannot embed an empty token sequence".into()));
        }
        let vocab = self.cfg.vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!("token id {bad} out of range for vocab size {vocab}")));
        }
        let ids = &ids[..ids.len().min(self.max_length())];
        let tokens = Array::from_slice(ids, &[1, ids.len()])?;
        let backbone = self.backbone.lock().unwrap_or_else(|e| e.into_inner());
        let mut cache = Cache::new(&backbone.cache_spec());
        // Only the last position is pooled: the last layer computes just that row.
        let (h, _) = backbone.forward(&tokens, &mut cache, crate::runtime::Rows::Last)?;
        let v = h.reshape(&[-1])?.astype(DType::F32)?.to_vec::<f32>()?;
        drop(backbone);
        Ok(if self.normalize { l2_normalize(v) } else { v })
    }

    /// Embed `text`, prefixed with the instruction preset `prompt_name` from
    /// `config_sentence_transformers.json` (e.g. `"query"`; `None` uses `default_prompt_name`,
    /// else no prefix), as sentence-transformers does.
    pub fn encode(&self, text: &str, prompt_name: Option<&str>) -> Result<Vec<f32>> {
        let tok = self.tokenizer.as_ref().ok_or_else(|| ModelError::InvalidInput("this checkpoint has no tokenizer.json: use encode_ids".into()))?;
        let prefix = match prompt_name.or(self.default_prompt_name.as_deref()) {
            Some(name) => self.prompts.get(name).ok_or_else(|| {
                ModelError::InvalidInput(format!("unknown prompt name {name:?} (available: {:?})", self.prompts.keys().collect::<Vec<_>>()))
            })?,
            None => "",
        };
        let ids = tok.encode(&format!("{prefix}{text}"), true)?;
        self.encode_ids(&ids)
    }

    /// [`HarrierModel::encode`] for several texts with the same preset.
    pub fn encode_batch(&self, texts: &[&str], prompt_name: Option<&str>) -> Result<Vec<Vec<f32>>> {
        texts.iter().map(|t| self.encode(t, prompt_name)).collect()
    }

    /// Embed several sequences (each independently: no padding effects).
    pub fn encode_batch_ids(&self, batch: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        batch.iter().map(|ids| self.encode_ids(ids)).collect()
    }
}

fn l2_normalize(v: Vec<f32>) -> Vec<f32> {
    let n = v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt().max(1e-12);
    v.into_iter().map(|x| (x as f64 / n) as f32).collect()
}

/// The registry's constructor.
pub(crate) fn load(c: &LoadContext) -> Result<Built> {
    Ok(Built::Embedding(HarrierModel::new(c.dir, c.weights, c.parse()?)?))
}

/// `tiny`: the tiny Qwen3 stack as a `Qwen3Model` checkpoint (keys without `model.`).
pub(crate) const PRESETS: &[Preset] = &[(
    "tiny",
    || {
        let mut v = (super::qwen3::PRESETS[0].1)();
        v["architectures"] = serde_json::json!(["Qwen3Model"]);
        v
    },
)];
