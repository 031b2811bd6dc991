//! The loader registry: one ordered table of families (the rules of mlx-node's `model-loader.js`).
//!
//! A base family is chosen from `model_type` (a raw alias, or the single default for a missing or
//! `null` model_type: qwen3); then architecture probes refine it in table order (Harrier = a
//! `qwen3` config whose architectures name `Qwen3Model` and not `Qwen3ForCausalLM`). Config
//! validation fails closed: a root that is not an object, or `architectures` that is neither an
//! array nor a string, is rejected rather than silently routed to the default.
use crate::{ModelError, Result};
use serde_json::Value;
use std::collections::HashSet;
use std::path::Path;

/// What a family can be used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FamilyKind {
    /// Chat-capable, with training support planned (Qwen families).
    Trainable,
    /// Chat-capable.
    Loadable,
    /// Embeddings only: cannot become a chat session.
    Embedding,
}

/// What a probe sees of a config.
pub struct ProbeContext<'a> {
    /// The base family's canonical type, if any.
    pub model_type: Option<&'a str>,
    pub architectures: &'a HashSet<String>,
}

/// One row of the registry.
pub struct Family {
    pub model_type: &'static str,
    pub kind: FamilyKind,
    pub raw_model_types: &'static [&'static str],
    pub architecture_probe: Option<fn(&ProbeContext) -> bool>,
    pub accepts_draft_model: bool,
    pub default_for_nullish_model_type: bool,
}

/// The table, in probe order.
pub static FAMILIES: &[Family] = &[
    // First in probe order: the unified architecture is authoritative (as in mlx-node's loader). The draft
    // option is accepted and recorded; speculative decoding comes with the speculative crate.
    Family {
        model_type: "gemma4",
        kind: FamilyKind::Loadable,
        raw_model_types: &["gemma4", "gemma4_text", "gemma4_unified"],
        architecture_probe: Some(|c| c.architectures.contains("Gemma4UnifiedForConditionalGeneration")),
        accepts_draft_model: true,
        default_for_nullish_model_type: false,
    },
    Family {
        model_type: "harrier",
        kind: FamilyKind::Embedding,
        raw_model_types: &["harrier"],
        architecture_probe: Some(|c| {
            c.model_type == Some("qwen3") && c.architectures.contains("Qwen3Model") && !c.architectures.contains("Qwen3ForCausalLM")
        }),
        accepts_draft_model: false,
        default_for_nullish_model_type: false,
    },
    Family {
        model_type: "qwen3",
        kind: FamilyKind::Trainable,
        raw_model_types: &["qwen3"],
        architecture_probe: None,
        accepts_draft_model: false,
        default_for_nullish_model_type: true,
    },
    Family {
        model_type: "qwen3_5",
        kind: FamilyKind::Trainable,
        raw_model_types: &["qwen3_5", "qwen3_5_text"],
        architecture_probe: None,
        accepts_draft_model: false,
        default_for_nullish_model_type: false,
    },
    Family {
        model_type: "qwen3_5_moe",
        kind: FamilyKind::Trainable,
        raw_model_types: &["qwen3_5_moe", "qwen3_5_moe_text"],
        architecture_probe: None,
        accepts_draft_model: false,
        default_for_nullish_model_type: false,
    },
    Family {
        model_type: "llama",
        kind: FamilyKind::Loadable,
        raw_model_types: &["llama", "mistral"],
        architecture_probe: None,
        accepts_draft_model: false,
        default_for_nullish_model_type: false,
    },
    Family {
        model_type: "qwen2",
        kind: FamilyKind::Loadable,
        raw_model_types: &["qwen2"],
        architecture_probe: None,
        accepts_draft_model: false,
        default_for_nullish_model_type: false,
    },
    Family {
        model_type: "gemma3",
        kind: FamilyKind::Loadable,
        raw_model_types: &["gemma3", "gemma3_text"],
        architecture_probe: None,
        accepts_draft_model: false,
        default_for_nullish_model_type: false,
    },
    Family {
        model_type: "lfm2",
        kind: FamilyKind::Loadable,
        raw_model_types: &["lfm2"],
        architecture_probe: None,
        accepts_draft_model: false,
        default_for_nullish_model_type: false,
    },
    Family {
        model_type: "lfm2_moe",
        kind: FamilyKind::Loadable,
        raw_model_types: &["lfm2_moe"],
        architecture_probe: None,
        accepts_draft_model: false,
        default_for_nullish_model_type: false,
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
    let ctx = ProbeContext { model_type: base.map(|b| b.model_type), architectures: &architectures };
    FAMILIES
        .iter()
        .find(|f| f.architecture_probe.is_some_and(|p| p(&ctx)))
        .or(base)
        .ok_or(ModelError::UnsupportedModelType { path: dir.to_path_buf(), model_type: label })
}
