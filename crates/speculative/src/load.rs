//! Drafters from checkpoints: the draft kind is read from the draft's config.json.
use crate::assistant::AssistantDrafter;
use crate::block::{BlockDrafter, BlockNet};
use crate::drafter::{DraftModel, Drafter};
use mlx_models::families::gemma4::Gemma4Assistant;
use mlx_models::{load_model, KvCacheMode, LoadOptions, Model, ModelError, QuantizedWeights, Result};
use std::path::{Path, PathBuf};

/// What a draft checkpoint is, from its config.json.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftKind {
    /// Any causal LM the registry loads (it must share the target's vocabulary).
    Model,
    /// Google's Gemma 4 assistant draft (`model_type` `gemma4_assistant`).
    Gemma4Assistant,
    /// A DSpark block draft (an architecture named `*DSpark*`, e.g. `Gemma4DSparkModel`).
    DSpark,
    /// A DFlash block draft (an architecture named `*DFlash*`, or a `dflash_config`).
    DFlash,
}

impl DraftKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DraftKind::Model => "draft model",
            DraftKind::Gemma4Assistant => "gemma4_assistant",
            DraftKind::DSpark => "DSpark",
            DraftKind::DFlash => "DFlash",
        }
    }
}

/// The kind of the draft checkpoint in `dir`.
pub fn draft_kind(dir: &Path) -> Result<DraftKind> {
    Ok(kind_of(&raw_config(dir)?))
}

/// `dir/config.json` as JSON.
fn raw_config(dir: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("config.json"))
        .map_err(|_| ModelError::ConfigNotFound(dir.to_path_buf()))?;
    serde_json::from_str(&text).map_err(|e| ModelError::MalformedConfig {
        path: dir.to_path_buf(),
        reason: e.to_string(),
    })
}

/// The kind a draft config.json describes.
pub(crate) fn kind_of(raw: &serde_json::Value) -> DraftKind {
    let archs: Vec<&str> = raw
        .get("architectures")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    if raw.get("model_type").and_then(|m| m.as_str()) == Some("gemma4_assistant") {
        DraftKind::Gemma4Assistant
    } else if archs.iter().any(|a| a.contains("DSpark")) {
        DraftKind::DSpark
    } else if archs.iter().any(|a| a.contains("DFlash")) || raw.get("dflash_config").is_some() {
        DraftKind::DFlash
    } else {
        DraftKind::Model
    }
}

/// `<target>/draft/` when it holds a checkpoint (a draft shipped inside the target's directory).
pub fn embedded_draft_dir(target: &Path) -> Option<PathBuf> {
    let d = target.join("draft");
    d.join("config.json").is_file().then_some(d)
}

/// Load the drafter in `dir` with the target's load options (a flat cache of its own; on a GPU
/// a quantized draft model loads dequantized unless the options say
/// [`QuantizedWeights::Keep`]). Plain draft models load here; `gemma4_assistant`, DSpark and DFlash drafts read their target's
/// states, so they need [`load_drafter_for`].
pub fn load_drafter(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn Drafter>> {
    load(dir, opts, None)
}

/// [`load_drafter`] for `target`: plain draft models, `gemma4_assistant` drafts (for a Gemma 4
/// target), DSpark and DFlash block drafts ([`BlockDrafter`]).
pub fn load_drafter_for(
    dir: &Path,
    opts: &LoadOptions,
    target: &Model,
) -> Result<Box<dyn Drafter>> {
    load(dir, opts, Some(target))
}

fn load(dir: &Path, opts: &LoadOptions, target: Option<&Model>) -> Result<Box<dyn Drafter>> {
    let raw = raw_config(dir)?;
    match (kind_of(&raw), target) {
        (DraftKind::Model, _) => {
            let gpu = mlx_array::default_device()? == mlx_array::Device::Gpu;
            let quantized_draft = raw.get("quantization").is_some();
            // On a GPU a quantized draft is dequantized by default: a draft forward of several
            // rows (catching up, the first draft of a cycle after the target's token) runs the
            // CUDA backend's quantized matrix product, which took tens of seconds at each new
            // shape on first use for SmolLM2-135M 4-bit, whose drafts there were also accepted far
            // less often than mlx-lm's from the same weights (BENCHMARKS.md), while a small draft's forward is
            // bound by kernel launches, not by reading its weights
            let quantized = draft_weights(opts.quantized, gpu, quantized_draft);
            let opts = LoadOptions {
                kv_cache: KvCacheMode::Flat,
                quantized,
                ..opts.clone()
            };
            let draft = DraftModel::new(load_model(dir, &opts)?.into_lm()?);
            // On the CPU a packed (quantized) draft catches up in pieces of at most
            // CPU_PACKED_NARROW_MAX_ROWS tokens: its packed kernels take them, where a longer
            // forward dequantizes every weight (pieces win below ~100 tokens, see the constant)
            let packed = quantized_draft && opts.quantized != QuantizedWeights::Dequantize;
            Ok(Box::new(if packed && !gpu {
                draft.with_catch_up_pieces(Some(mlx_array::ops::CPU_PACKED_NARROW_MAX_ROWS))
            } else {
                draft
            }))
        }
        (DraftKind::Gemma4Assistant, Some(t)) => Ok(Box::new(AssistantDrafter::new(
            t.clone(),
            Gemma4Assistant::load(dir, opts.dtype)?,
        )?)),
        (DraftKind::DSpark | DraftKind::DFlash, Some(t)) => Ok(Box::new(BlockDrafter::new(
            t.clone(),
            BlockNet::load(dir, opts.dtype)?,
        )?)),
        (k, None) => Err(ModelError::UnsupportedOption(format!(
            "{}: a {} draft reads its target's states: load it with load_drafter_for",
            dir.display(),
            k.as_str()
        ))),
    }
}

/// How a draft model's quantized weights load: as asked, except that the default
/// ([`QuantizedWeights::Auto`]) dequantizes a quantized draft on a GPU (see `load`).
fn draft_weights(asked: QuantizedWeights, gpu: bool, quantized_draft: bool) -> QuantizedWeights {
    match asked {
        QuantizedWeights::Auto if gpu && quantized_draft => QuantizedWeights::Dequantize,
        q => q,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quantized_draft_dequantizes_on_a_gpu_by_default_only() {
        use QuantizedWeights::*;
        assert_eq!(draft_weights(Auto, true, true), Dequantize);
        assert_eq!(draft_weights(Keep, true, true), Keep, "asked to keep: kept");
        assert_eq!(draft_weights(Auto, false, true), Auto, "the CPU keeps its packed kernels");
        assert_eq!(draft_weights(Auto, true, false), Auto);
    }
}
