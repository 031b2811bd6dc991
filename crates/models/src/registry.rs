//! The loader registry: one ordered table of families (the rules of mlx-node's `model-loader.js`).
//!
//! A base family is chosen from `model_type` (a raw alias, or the single default for a missing or
//! `null` model_type: qwen3); then architecture probes refine it in table order (Harrier = a
//! `qwen3` config whose architectures name `Qwen3Model` and not `Qwen3ForCausalLM`). Config
//! validation fails closed: a root that is not an object, or `architectures` that is neither an
//! array nor a string, is rejected rather than silently routed to the default.
use crate::families::harrier::HarrierModel;
use crate::runtime::ModelRuntime;
use crate::weights::Weights;
use crate::{ModelError, Result};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::HashSet;
use std::path::Path;

/// What a family's constructor reads: the checkpoint directory, its config and its weights.
pub struct LoadContext<'a> {
    pub dir: &'a Path,
    /// The whole config.json.
    pub config: &'a Value,
    /// The decoder's settings ([`crate::config::text_config`] of `config`).
    pub text: Value,
    pub weights: &'a Weights,
    /// End-of-sequence ids from config.json and generation_config.json.
    pub eos: Vec<u32>,
    pub family: &'static Family,
}

impl LoadContext<'_> {
    /// The family's typed config, parsed from [`LoadContext::text`].
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T> {
        crate::config::parse(self.dir, &self.text)
    }
    /// A config error naming the checkpoint.
    pub fn bad_config(&self, reason: impl Into<String>) -> ModelError {
        ModelError::MalformedConfig { path: self.dir.to_path_buf(), reason: reason.into() }
    }
}

/// What a family's constructor builds.
pub enum Built {
    Lm(Box<dyn ModelRuntime>),
    Embedding(HarrierModel),
}

/// Which KV cache a family's sequences get when neither the load options nor config.json's
/// `use_block_paged_cache` choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDefault {
    Paged,
    Flat,
}

/// A named random-checkpoint shape of a family: its hub-style config.json.
pub type Preset = (&'static str, fn() -> Value);

/// What a family can be used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FamilyKind {
    /// Chat-capable, with training support planned (Qwen families).
    Trainable,
    /// Chat-capable.
    Loadable,
    /// Embeddings only: cannot become a chat session.
    Embedding,
    /// Vision-language (images, for Gemma 4 audio too, in chat messages: [`crate::media`]).
    Vlm,
}

/// What a probe sees of a config.
pub struct ProbeContext<'a> {
    /// The base family's canonical type, if any.
    pub model_type: Option<&'a str>,
    pub architectures: &'a HashSet<String>,
    /// The whole config.json.
    pub config: &'a Value,
    /// Whether the checkpoint's weight files hold vision or audio tower tensors: `None` when there
    /// are no weight files to look at (a config alone, e.g. for a random checkpoint).
    pub has_media_tower: Option<bool>,
}

/// Tensor-name fragments of vision and audio towers (transformers', mlx-vlm's and InternVL's
/// layouts).
const TOWER_MARKERS: [&str; 6] = ["visual.", "vision_tower.", "audio_tower.", "vision_model.", "embed_vision.", "embed_audio."];

/// Whether the weight files under `dir` name a tower tensor ([`ProbeContext::has_media_tower`];
/// `None` when there are none or they cannot be read, which the loader then reports). A text-only
/// conversion, such as mlx-lm's of a ConditionalGeneration checkpoint, keeps `vision_config` in
/// config.json but drops the tower.
fn media_tower_in(dir: &Path) -> Option<bool> {
    let ckpt = crate::weights::open_checkpoint(dir).ok()??;
    Some(ckpt.tensors().iter().any(|t| TOWER_MARKERS.iter().any(|m| t.name.contains(m))))
}

/// One row of the registry: everything the loader, the random-checkpoint writer and the
/// benchmarks know about a family.
pub struct Family {
    pub model_type: &'static str,
    pub kind: FamilyKind,
    pub raw_model_types: &'static [&'static str],
    pub architecture_probe: Option<fn(&ProbeContext) -> bool>,
    pub default_for_nullish_model_type: bool,
    /// Build the model from a checkpoint (or, over [`Weights::expecting`], from a config alone).
    pub load: fn(&LoadContext) -> Result<Built>,
    /// Set aside tensors the family does not load on purpose (vision towers, rotary tables),
    /// before construction (given config.json); whatever else the model leaves unread is an error.
    pub sanitize: fn(&mut Weights, &Value),
    pub kv_default: KvDefault,
    /// The floor of the paged cache's automatic budget, MB ([`crate::PagedConfig::memory_floor_mb`]
    /// when that is `None`).
    pub paged_memory_floor_mb: Option<f64>,
    /// Random-checkpoint shapes: `tiny` (tests), `small` (benchmarks), named sizes.
    pub presets: &'static [Preset],
}

impl Family {
    /// A row with the usual settings, which a row overrides where it differs (`..Family::new(..)`):
    /// loadable, the type names given, no architecture probe, not the default for a
    /// config without `model_type`, the common sanitize hook, paged caches.
    const fn new(model_type: &'static str, raw_model_types: &'static [&'static str], load: fn(&LoadContext) -> Result<Built>, presets: &'static [Preset]) -> Family {
        Family {
            model_type,
            kind: FamilyKind::Loadable,
            raw_model_types,
            architecture_probe: None,
            default_for_nullish_model_type: false,
            load,
            sanitize: sanitize_common,
            kv_default: KvDefault::Paged,
            paged_memory_floor_mb: None,
            presets,
        }
    }

    /// The config.json of preset `name`.
    pub fn preset(&self, name: &str) -> Option<Value> {
        self.presets.iter().find(|(n, _)| *n == name).map(|(_, f)| f())
    }
}

/// Tensors no family reads: precomputed rotary tables some exports carry, and the `lm_head`
/// copy of a checkpoint whose config ties it to the embedding.
fn sanitize_common(w: &mut Weights, config: &Value) {
    w.set_aside(|n| n.ends_with(".rotary_emb.inv_freq"));
    let tied = crate::config::text_config(config).get("tie_word_embeddings").and_then(Value::as_bool) == Some(true);
    if tied {
        w.set_aside(|n| n == "lm_head.weight" || n == "language_model.lm_head.weight");
    }
}

/// Multimodal checkpoints whose towers are not supported: the language model alone loads.
fn sanitize_towers(w: &mut Weights, c: &Value) {
    sanitize_common(w, c);
    const TOWERS: [&str; 6] = ["vision_tower.", "multi_modal_projector.", "audio_tower.", "embed_vision.", "embed_audio.", "visual."];
    w.set_aside(|n| {
        let n = n.strip_prefix("model.").unwrap_or(n);
        TOWERS.iter().any(|t| n.starts_with(t))
    });
}

/// The table, in probe order.
pub static FAMILIES: &[Family] = &[
    // First in probe order: the unified architecture is authoritative (as in mlx-node's loader).
    // Speculative decoding (any family, with a plain draft model of the same vocabulary, flat or
    // paged caches) is the mlx-speculative crate's.
    Family {
        architecture_probe: Some(|c| c.architectures.contains("Gemma4UnifiedForConditionalGeneration")),
        sanitize: sanitize_towers,
        kv_default: KvDefault::Paged,
        ..Family::new("gemma4", &["gemma4", "gemma4_text", "gemma4_unified"], crate::families::gemma4::load, crate::families::gemma4::PRESETS)
    },
    // Gemma 4 ConditionalGeneration checkpoints with their vision and/or audio towers.
    Family {
        kind: FamilyKind::Vlm,
        architecture_probe: Some(crate::families::gemma4_media::probe),
        kv_default: KvDefault::Paged,
        ..Family::new("gemma4_vlm", &[], crate::families::gemma4_media::load, crate::families::gemma4_media::PRESETS)
    },
    // Qwen3.5 (dense or MoE) ConditionalGeneration checkpoints with their vision tower.
    Family {
        kind: FamilyKind::Vlm,
        architecture_probe: Some(crate::families::qwen3_5_vl::probe),
        kv_default: KvDefault::Flat,
        paged_memory_floor_mb: Some(16384.0),
        ..Family::new("qwen3_5_vl", &[], crate::families::qwen3_5_vl::load, crate::families::qwen3_5_vl::PRESETS)
    },
    // PaddleOCR-VL: vision encoder, projector and ERNIE-4.5 language model.
    Family {
        kind: FamilyKind::Vlm,
        sanitize: crate::families::paddleocr_vl::sanitize,
        kv_default: KvDefault::Flat,
        ..Family::new("paddleocr_vl", &["paddleocr_vl"], crate::families::paddleocr_vl::load, crate::families::paddleocr_vl::PRESETS)
    },
    Family {
        kind: FamilyKind::Embedding,
        architecture_probe: Some(|c| {
            c.model_type == Some("qwen3") && c.architectures.contains("Qwen3Model") && !c.architectures.contains("Qwen3ForCausalLM")
        }),
        kv_default: KvDefault::Flat,
        ..Family::new("harrier", &["harrier"], crate::families::harrier::load, crate::families::harrier::PRESETS)
    },
    Family {
        kind: FamilyKind::Trainable,
        default_for_nullish_model_type: true,
        ..Family::new("qwen3", &["qwen3"], crate::families::qwen3::load, crate::families::qwen3::PRESETS)
    },
    Family {
        kind: FamilyKind::Trainable,
        sanitize: sanitize_towers,
        kv_default: KvDefault::Flat,
        paged_memory_floor_mb: Some(16384.0),
        ..Family::new("qwen3_5", &["qwen3_5", "qwen3_5_text"], crate::families::qwen3_5::load, crate::families::qwen3_5::PRESETS)
    },
    Family {
        kind: FamilyKind::Trainable,
        sanitize: sanitize_towers,
        kv_default: KvDefault::Flat,
        paged_memory_floor_mb: Some(16384.0),
        ..Family::new("qwen3_5_moe", &["qwen3_5_moe", "qwen3_5_moe_text"], crate::families::qwen3_5::load, crate::families::qwen3_5::MOE_PRESETS)
    },
    Family::new("llama", &["llama", "mistral"], crate::families::llama::load_llama, crate::families::llama::PRESETS),
    Family::new("qwen2", &["qwen2"], crate::families::llama::load_qwen2, crate::families::llama::QWEN2_PRESETS),
    Family {
        sanitize: sanitize_towers,
        ..Family::new("gemma3", &["gemma3", "gemma3_text"], crate::families::gemma3::load, crate::families::gemma3::PRESETS)
    },
    // Paged by default, as mlx-node's AGENT_PAGED_MODEL_TYPES (attention layers in the pool,
    // short-convolution state per sequence).
    Family::new("lfm2", &["lfm2"], crate::families::lfm2::load, crate::families::lfm2::PRESETS),
    Family::new("lfm2_moe", &["lfm2_moe"], crate::families::lfm2::load, crate::families::lfm2::MOE_PRESETS),
    // InternVL (Qianfan-OCR, InternVL-Chat, transformers' native layout) with its vision tower.
    Family {
        kind: FamilyKind::Vlm,
        kv_default: KvDefault::Flat,
        ..Family::new("internvl", &["internvl", "internvl_chat", "qianfan-ocr", "qianfan_ocr"], crate::families::internvl::load, crate::families::internvl::PRESETS)
    },
];

/// Look up a family by canonical type.
pub fn family(model_type: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.model_type == model_type)
}

/// Check the table's own invariants (unique types and aliases, exactly one default).
pub fn validate_registry() -> std::result::Result<(), String> {
    let (mut types, mut aliases) = (HashSet::new(), HashSet::new());
    let mut defaults = 0;
    for f in FAMILIES {
        if !types.insert(f.model_type) {
            return Err(format!("Duplicate canonical model type \"{}\" in model family registry", f.model_type));
        }
        for a in f.raw_model_types {
            if !aliases.insert(*a) {
                return Err(format!("Duplicate model_type alias \"{a}\""));
            }
        }
        defaults += f.default_for_nullish_model_type as usize;
    }
    if defaults != 1 {
        return Err("Model family registry must declare exactly one nullish-model_type default".into());
    }
    Ok(())
}

/// Detect the canonical family of the checkpoint in `dir` from its config.json.
pub fn detect_model_type(dir: &Path) -> Result<&'static Family> {
    let raw = std::fs::read_to_string(dir.join("config.json")).map_err(|_| ModelError::ConfigNotFound(dir.to_path_buf()))?;
    let v: Value = serde_json::from_str(&raw)
        .map_err(|e| ModelError::MalformedConfig { path: dir.to_path_buf(), reason: format!("invalid JSON: {e}") })?;
    detect_from_value(dir, &v)
}

/// [`detect_model_type`] on an already-parsed config.
pub fn detect_from_value(dir: &Path, v: &Value) -> Result<&'static Family> {
    let malformed = |reason: &str| ModelError::MalformedConfig { path: dir.to_path_buf(), reason: reason.into() };
    let obj = v.as_object().ok_or_else(|| malformed("root must be a JSON object"))?;
    let mt = obj.get("model_type");
    let uses_default = matches!(mt, None | Some(Value::Null));
    let label = match mt {
        None => "<missing>".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    let architectures: HashSet<String> = match obj.get("architectures") {
        None | Some(Value::Null) => HashSet::new(),
        Some(Value::String(s)) => [s.clone()].into(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_str().map(String::from)).collect(),
        Some(_) => return Err(malformed("\"architectures\" must be an array or a string")),
    };
    let base = if uses_default {
        FAMILIES.iter().find(|f| f.default_for_nullish_model_type)
    } else {
        mt.and_then(|m| m.as_str()).and_then(|m| FAMILIES.iter().find(|f| f.raw_model_types.contains(&m)))
    };
    let ctx = ProbeContext { model_type: base.map(|b| b.model_type), architectures: &architectures, config: v, has_media_tower: media_tower_in(dir) };
    FAMILIES
        .iter()
        .find(|f| f.architecture_probe.is_some_and(|p| p(&ctx)))
        .or(base)
        .ok_or(ModelError::UnsupportedModelType { path: dir.to_path_buf(), model_type: label })
}
