//! MLX quantization of a Hugging Face checkpoint directory, written in mlx-lm's layout
//! (`mlx_lm.convert -q`): each quantized layer's `.weight` becomes packed `uint32` with `.scales`
//! (and `.biases` for affine), and config.json gains `quantization` / `quantization_config`
//! (`group_size`, `bits`, `mode`, and per-layer entries where a layer differs from them).
//!
//! Which layers: those mlx-lm's `quantize_model` quantizes, decided here from tensor names and
//! shapes: linear and embedding weights (2-D `*.weight`) and stacked MoE expert weights (3-D,
//! under `experts` / `switch_mlp`) whose last dimension is a multiple of the group size; not
//! norms, convolutions, or vision/audio towers. MoE routers (`mlp.gate`,
//! `shared_expert_gate`) get 8 bits in groups of 64 as mlx-lm's MoE models ask. Mixed recipes
//! (`mixed_2_6`, `mixed_3_4`, `mixed_3_6`, `mixed_4_6`) follow mlx-lm's
//! `mixed_quant_predicate_builder`. The packed tensors are MLX's own `quantize` output.
//!
//! Families whose mlx-lm model stores tensors differently from transformers are written in
//! mlx-lm's layout, as its `sanitize` leaves them (`MlxLmLayout`): Gemma 4 (`gemma4_text`, and
//! `gemma4`'s language model) splits the fused `experts.gate_up_proj` into
//! `experts.switch_glu.{gate,up}_proj.weight`, renames `experts.down_proj`, quantizes
//! `router.proj` at 8 bits in groups of 64, and drops what mlx-lm drops.
//!
//! The output is streamed: one tensor is read, quantized and evaluated at a time, and the weights
//! are written in shards as mlx-lm's `save_model` writes them (`model-0000k-of-0000n.safetensors`
//! up to [`QuantizeOptions::max_shard_bytes`] each, `model.safetensors` when one shard holds
//! everything, and `model.safetensors.index.json` in both cases), so peak memory is about one
//! shard.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mlx_array::io::Checkpoint;
use mlx_array::{Array, DType, QuantMode};
use serde::Serialize;
use serde_json::{json, Value};

use crate::output::{io, OutDtype, ShardedWriter, StagedDir, DEFAULT_MAX_SHARD_BYTES};
use crate::ConvertError;

/// A mixed-precision recipe of mlx-lm (`--quant-predicate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Recipe {
    Mixed2_6,
    Mixed3_4,
    Mixed3_6,
    Mixed4_6,
}

impl Recipe {
    /// (low bits, high bits).
    fn bits(self) -> (u8, u8) {
        match self {
            Recipe::Mixed2_6 => (2, 6),
            Recipe::Mixed3_4 => (3, 4),
            Recipe::Mixed3_6 => (3, 6),
            Recipe::Mixed4_6 => (4, 6),
        }
    }
}

impl std::str::FromStr for Recipe {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "mixed_2_6" => Recipe::Mixed2_6,
            "mixed_3_4" => Recipe::Mixed3_4,
            "mixed_3_6" => Recipe::Mixed3_6,
            "mixed_4_6" => Recipe::Mixed4_6,
            _ => return Err(format!("unknown recipe {s:?} (mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6)")),
        })
    }
}

/// What `quantize` writes.
#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    /// The default mode of every quantized layer (mlx-lm's default: affine, 4 bits, groups of 64).
    pub mode: QuantMode,
    /// A mixed recipe (affine only; its bits replace `mode`'s, its group size is `mode`'s).
    pub recipe: Option<Recipe>,
    /// dtype of the tensors left unquantized, and of the tensors quantized from (`None`: as stored).
    pub dtype: Option<OutDtype>,
    /// Largest shard in bytes (mlx-lm's default: 5 GiB); a tensor larger than this gets a shard
    /// of its own. Peak memory is about one shard.
    pub max_shard_bytes: u64,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        QuantizeOptions { mode: QuantMode::Affine { bits: 4, group_size: 64 }, recipe: None, dtype: None, max_shard_bytes: DEFAULT_MAX_SHARD_BYTES }
    }
}

/// What a quantization wrote.
#[derive(Debug, Clone, Serialize)]
pub struct QuantizeSummary {
    pub output: PathBuf,
    pub mode: String,
    pub bits: u32,
    pub group_size: u32,
    pub recipe: Option<Recipe>,
    /// Layers quantized, and tensors copied as they were.
    pub quantized: usize,
    pub kept: usize,
    /// Bits written per parameter of the input (packed weights, scales and biases counted), as
    /// mlx-lm reports it.
    pub bits_per_weight: f64,
    pub bytes_written: u64,
    /// The weight files written (`model.safetensors`, or `model-0000k-of-0000n.safetensors`).
    pub shards: Vec<String>,
    pub seconds: f64,
}

/// One tensor done (for progress bars).
pub struct QuantizeProgress<'a> {
    pub index: usize,
    pub total: usize,
    pub tensor: &'a str,
}

fn mode_json(m: QuantMode) -> Value {
    json!({"group_size": m.group_size(), "bits": m.bits(), "mode": m.name()})
}

/// The layer (module path) of a `*.weight` tensor that mlx-lm would quantize, or `None`.
pub fn quantizable_layer<'a>(name: &'a str, shape: &[usize], group_size: u32) -> Option<&'a str> {
    let layer = name.strip_suffix(".weight")?;
    let tower = ["vision_tower", "vision_model", "visual", "multi_modal_projector", "audio_tower", "embed_vision", "embed_audio"];
    // convolutions (LFM2's `conv.conv`, Qwen3.5's `conv1d`) are not linear layers; the linear
    // projections around them (`conv.in_proj`) are
    let conv = layer.rsplit('.').next().is_some_and(|last| last.contains("conv"));
    if tower.iter().any(|t| layer.split('.').any(|p| p == *t)) || layer.contains("norm") || conv {
        return None;
    }
    let experts = layer.contains("experts") || layer.contains("switch_mlp");
    let ok_rank = shape.len() == 2 || (shape.len() == 3 && experts);
    (ok_rank && shape.last().is_some_and(|&d| d > 0 && d % group_size as usize == 0)).then_some(layer)
}

/// mlx-lm's mixed predicate: the bits of `layer` under `recipe` for a model of `num_layers`.
fn mixed_bits(recipe: Recipe, layer: &str, layer_location: usize, num_layers: usize) -> u8 {
    let (low, high) = recipe.bits();
    let index = layer.split('.').nth(layer_location).and_then(|p| p.parse::<usize>().ok()).unwrap_or(0);
    let n = num_layers;
    let more = index < n / 8 || index >= 7 * n / 8 || (index as i64 - (n / 8) as i64).rem_euclid(3) == 2;
    if (layer.contains("v_proj") || layer.contains("v_a_proj") || layer.contains("v_b_proj")) && more {
        return high;
    }
    if layer.contains("down_proj") && more {
        return high;
    }
    if layer.contains("lm_head") {
        return high;
    }
    low
}

/// MoE routers mlx-lm's MoE models (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, LFM2-MoE) keep at
/// 8 bits in groups of 64.
fn is_router(layer: &str) -> bool {
    layer.ends_with("mlp.gate") || layer.ends_with("shared_expert_gate") || layer.ends_with("feed_forward.gate")
}

/// The tensor layout mlx-lm's model of a family saves, where it differs from transformers'.
#[derive(Debug, Clone, PartialEq)]
enum LayoutKind {
    /// Tensors keep their names.
    AsStored,
    /// mlx-lm's `gemma4_text` (`sanitize`, `quant_predicate`), and `gemma4`'s (also
    /// `gemma4_unified`'s), which first renames `model.language_model.` to
    /// `language_model.model.` and drops the vision and audio towers.
    Gemma4 {
        /// Layers from here on are KV-shared: mlx-lm drops their k/v projections and k norm.
        first_kv_shared: usize,
        multimodal: bool,
    },
    /// mlx-lm's `lfm2_moe`: `w1`/`w2`/`w3` named `gate_proj`/`down_proj`/`up_proj`, each MoE
    /// layer's experts stacked into `feed_forward.switch_mlp.*`, conv weights as `[C, K, 1]`;
    /// `expert_bias` keeps its stored dtype.
    Lfm2Moe { num_experts: usize },
    /// mlx-lm's `qwen3_5` and `qwen3_5_moe` (the `...ForConditionalGeneration` checkpoints):
    /// everything under `language_model.`, vision tower and `mtp.*` dropped, fused experts split
    /// into `mlp.switch_mlp.*`, conv1d weights as `[C, K, 1]`, and, when the checkpoint's conv
    /// weights are transformers' `[C, 1, K]`, the (1+w) norms stored as `w + 1`. `A_log` keeps
    /// its stored dtype (mlx-lm's `cast_predicate`).
    Qwen35 { norms_as_deltas: bool },
}

/// A family's mlx-lm layout applied tensor by tensor; tensors mlx-lm stacks (LFM2-MoE's
/// experts) are held until their group is complete.
struct MlxLmLayout {
    kind: LayoutKind,
    /// Stacked tensor name -> its parts so far.
    pending: BTreeMap<String, Vec<Option<Array>>>,
}

const QWEN35_NORMS: [&str; 5] = [".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight", ".k_norm.weight"];

impl MlxLmLayout {
    /// The layout of the checkpoint whose config is `config` and whose tensors are `infos`.
    fn of(config: &serde_json::Map<String, Value>, infos: &[(usize, mlx_array::io::TensorInfo)]) -> Self {
        let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or("");
        let text = config.get("text_config").and_then(Value::as_object).unwrap_or(config);
        let num = |k: &str| text.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
        let kind = match model_type {
            // mlx-lm reads `gemma4_unified` with its `gemma4` model
            "gemma4" | "gemma4_unified" | "gemma4_text" => {
                let layers = num("num_hidden_layers");
                LayoutKind::Gemma4 { first_kv_shared: layers - num("num_kv_shared_layers").min(layers), multimodal: model_type != "gemma4_text" }
            }
            "lfm2_moe" => LayoutKind::Lfm2Moe { num_experts: num("num_experts") },
            "qwen3_5" | "qwen3_5_moe" => LayoutKind::Qwen35 {
                norms_as_deltas: infos.iter().any(|(_, t)| t.name.contains("conv1d.weight") && t.shape.last() != Some(&1)),
            },
            _ => LayoutKind::AsStored,
        };
        MlxLmLayout { kind, pending: BTreeMap::new() }
    }

    /// Whether the stored tensor `name` keeps its stored dtype in mlx-lm's output (the model's
    /// `cast_predicate`).
    fn keeps_dtype(&self, name: &str) -> bool {
        match self.kind {
            LayoutKind::Qwen35 { .. } => name.ends_with("A_log"),
            LayoutKind::Lfm2Moe { .. } => name.contains("expert_bias"),
            _ => false,
        }
    }

    /// The tensors mlx-lm saves for the stored tensor `name` (none: dropped, or held until its
    /// stack is complete), lazily.
    fn tensors(&mut self, name: &str, a: Array) -> Result<Vec<(String, Array)>, ConvertError> {
        match self.kind.clone() {
            LayoutKind::AsStored => Ok(vec![(name.to_string(), a)]),
            LayoutKind::Gemma4 { first_kv_shared, multimodal } => gemma4_tensors(name, a, first_kv_shared, multimodal),
            LayoutKind::Lfm2Moe { num_experts } => self.lfm2_moe_tensors(name, a, num_experts),
            LayoutKind::Qwen35 { norms_as_deltas } => qwen35_tensors(name, a, norms_as_deltas),
        }
    }

    fn lfm2_moe_tensors(&mut self, name: &str, mut a: Array, num_experts: usize) -> Result<Vec<(String, Array)>, ConvertError> {
        let mut name = name.replace("w1.weight", "gate_proj.weight").replace("w2.weight", "down_proj.weight").replace("w3.weight", "up_proj.weight");
        let shape = a.shape();
        if name.contains("conv.weight") && shape.len() == 3 && shape[2] > shape[1] {
            a = a.transpose(&[0, 2, 1])?;
        }
        // model.layers.L.feed_forward.experts.E.PROJ.weight -> model.layers.L.feed_forward.switch_mlp.PROJ.weight
        if let Some((base, rest)) = name.split_once(".feed_forward.experts.") {
            let (e, proj) = rest.split_once('.').ok_or_else(|| ConvertError::BadTensor { name: name.clone(), msg: "expert tensor without a projection".into() })?;
            let e: usize = e.parse().map_err(|_| ConvertError::BadTensor { name: name.clone(), msg: format!("expert index {e:?}") })?;
            if e >= num_experts {
                return Err(ConvertError::BadTensor { name, msg: format!("expert {e} of a config with {num_experts} experts") });
            }
            let stacked = format!("{base}.feed_forward.switch_mlp.{proj}");
            let parts = self.pending.entry(stacked.clone()).or_insert_with(|| vec![None; num_experts]);
            if parts[e].replace(a).is_some() {
                return Err(ConvertError::BadTensor { name, msg: "expert stored twice".into() });
            }
            if parts.iter().any(Option::is_none) {
                return Ok(vec![]);
            }
            let parts: Vec<Array> = self.pending.remove(&stacked).unwrap_or_default().into_iter().flatten().collect();
            let refs: Vec<&Array> = parts.iter().collect();
            name = stacked;
            return Ok(vec![(name, mlx_array::ops::stack(&refs, 0)?)]);
        }
        Ok(vec![(name, a)])
    }

    /// Tensors held for a stack that never completed: an error naming the first.
    fn finish(&self) -> Result<(), ConvertError> {
        match self.pending.iter().next() {
            None => Ok(()),
            Some((name, parts)) => {
                let have = parts.iter().filter(|p| p.is_some()).count();
                Err(ConvertError::BadTensor { name: name.clone(), msg: format!("{have} of {} experts stored", parts.len()) })
            }
        }
    }

    /// mlx-lm's `quant_predicate` asks 8 bits in groups of 64 for this layer.
    fn is_router(&self, layer: &str) -> bool {
        match self.kind {
            LayoutKind::Gemma4 { .. } => layer.ends_with("router.proj"),
            _ => is_router(layer),
        }
    }
}

fn gemma4_tensors(name: &str, a: Array, first_kv_shared: usize, multimodal: bool) -> Result<Vec<(String, Array)>, ConvertError> {
    let mut name = name.to_string();
    if multimodal {
        let (had_model, rest) = match name.strip_prefix("model.") {
            Some(r) => (true, r),
            None => (false, name.as_str()),
        };
        const TOWERS: [&str; 6] = ["vision_tower", "multi_modal_projector", "audio_tower", "embed_audio", "embed_vision", "vision_embedder"];
        if TOWERS.iter().any(|t| rest.starts_with(t)) {
            return Ok(vec![]);
        }
        if had_model {
            name = match rest.strip_prefix("language_model.") {
                Some(r) => format!("language_model.model.{r}"),
                None => rest.to_string(),
            };
        }
    }
    let dropped = ["self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min"];
    if dropped.iter().any(|d| name.contains(d)) {
        return Ok(vec![]);
    }
    if [".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm"].iter().any(|p| name.contains(p)) {
        let layer = name.split("layers.").nth(1).and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
        if layer.is_some_and(|i| i >= first_kv_shared) {
            return Ok(vec![]);
        }
    }
    if let Some(base) = name.strip_suffix(".experts.gate_up_proj") {
        let (gate, up) = split_gate_up(&name, &a)?;
        return Ok(vec![(format!("{base}.experts.switch_glu.gate_proj.weight"), gate), (format!("{base}.experts.switch_glu.up_proj.weight"), up)]);
    }
    if let Some(base) = name.strip_suffix(".experts.down_proj") {
        return Ok(vec![(format!("{base}.experts.switch_glu.down_proj.weight"), a)]);
    }
    Ok(vec![(name, a)])
}

fn qwen35_tensors(name: &str, mut a: Array, norms_as_deltas: bool) -> Result<Vec<(String, Array)>, ConvertError> {
    if name.starts_with("vision_tower") || name.starts_with("model.visual") || name.contains("mtp.") {
        return Ok(vec![]);
    }
    let name = match name.strip_prefix("model.language_model") {
        Some(rest) => format!("language_model.model{rest}"),
        None if name.starts_with("language_model.") => name.to_string(),
        None => format!("language_model.{name}"),
    };
    if let Some(base) = name.strip_suffix(".mlp.experts.gate_up_proj") {
        let (gate, up) = split_gate_up(&name, &a)?;
        return Ok(vec![(format!("{base}.mlp.switch_mlp.gate_proj.weight"), gate), (format!("{base}.mlp.switch_mlp.up_proj.weight"), up)]);
    }
    if let Some(base) = name.strip_suffix(".mlp.experts.down_proj") {
        return Ok(vec![(format!("{base}.mlp.switch_mlp.down_proj.weight"), a)]);
    }
    let shape = a.shape();
    if name.contains("conv1d.weight") && shape.len() == 3 && shape[2] != 1 {
        a = a.transpose(&[0, 2, 1])?;
    }
    if norms_as_deltas && shape.len() == 1 && QWEN35_NORMS.iter().any(|n| name.ends_with(n)) {
        // in the stored dtype, as mlx-lm adds it before casting
        a = a.add_scalar(1.0)?;
    }
    Ok(vec![(name, a)])
}

/// A fused `[.., 2I, H]` expert projection split into its gate rows and its up rows.
fn split_gate_up(name: &str, a: &Array) -> Result<(Array, Array), ConvertError> {
    let shape = a.shape();
    if shape.len() < 2 || shape[shape.len() - 2] % 2 != 0 {
        return Err(ConvertError::BadTensor { name: name.to_string(), msg: format!("fused gate_up_proj of shape {shape:?} has no even [.., 2I, H] split") });
    }
    let half = shape[shape.len() - 2] / 2;
    let axis = shape.len() as i32 - 2;
    Ok((a.slice_axis(axis, 0, half)?, a.slice_axis(axis, half, 2 * half)?))
}

/// Quantize the checkpoint in `input` into `output` (staged and renamed into place).
pub fn quantize_dir(input: &Path, output: &Path, opts: &QuantizeOptions, mut progress: impl FnMut(QuantizeProgress<'_>)) -> Result<QuantizeSummary, ConvertError> {
    let t0 = Instant::now();
    let cfg_path = input.join("config.json");
    let raw = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
    let mut config: Value = serde_json::from_str(&raw).map_err(|e| ConvertError::BadConfig { path: cfg_path.clone(), msg: e.to_string() })?;
    let obj = config.as_object_mut().ok_or_else(|| ConvertError::BadConfig { path: cfg_path.clone(), msg: "root is not an object".into() })?;
    if obj.contains_key("quantization") || obj.get("quantization_config").is_some_and(|q| !q.is_null()) {
        return Err(ConvertError::AlreadyQuantized(input.to_path_buf()));
    }
    let group_size = opts.mode.group_size();
    if opts.recipe.is_some() && !matches!(opts.mode, QuantMode::Affine { .. }) {
        return Err(ConvertError::BadOption(format!("mixed recipes are affine only, not {}", opts.mode.name())));
    }
    let ckpts = open_weights(input)?;
    let infos: Vec<(usize, mlx_array::io::TensorInfo)> = ckpts.iter().enumerate().flat_map(|(i, c)| c.tensors().into_iter().map(move |t| (i, t))).collect();
    let float_dtype = opts.dtype.map(|d| match d {
        OutDtype::F32 => DType::F32,
        OutDtype::Bf16 => DType::BF16,
        OutDtype::F16 => DType::F16,
    });

    // mlx-lm's mixed recipe locates the layer index from the first down_proj path.
    let num_layers = {
        let text = obj.get("text_config").and_then(Value::as_object).unwrap_or(obj);
        text.get("num_hidden_layers").or_else(|| obj.get("num_hidden_layers")).and_then(Value::as_u64).unwrap_or(0) as usize
    };
    let layer_location = match opts.recipe {
        None => 0,
        Some(_) => {
            let first = infos.iter().map(|(_, t)| t).find(|t| t.name.contains("down_proj")).ok_or_else(|| ConvertError::BadOption("mixed recipes need down_proj layers".into()))?;
            first.name.split('.').position(|p| p.chars().all(|c| c.is_ascii_digit()) && !p.is_empty()).unwrap_or(0)
        }
    };
    let mut qcfg = serde_json::Map::new();
    if let Value::Object(m) = mode_json(opts.mode) {
        qcfg.extend(m);
    }

    let staged = StagedDir::new(output)?;
    // Each tensor is quantized, evaluated and handed to the shard writer before the next is
    // read: what is resident is the shard being filled, not the model.
    let mut out = ShardedWriter::new(staged.path(), opts.max_shard_bytes)?;
    let (mut quantized, mut kept, mut weight_elems) = (0usize, 0usize, 0u64);
    let total = infos.len();
    let mut layout = MlxLmLayout::of(obj, &infos);
    for (index, (file, info)) in infos.iter().enumerate() {
        // in the stored dtype: the layout's arithmetic (Qwen3.5's norms) runs there, as mlx-lm's
        // sanitize does, before the cast
        let stored = ckpts[*file].load(&info.name, None)?;
        let keep_dtype = layout.keeps_dtype(&info.name);
        for (name, a) in layout.tensors(&info.name, stored)? {
            let a = match float_dtype {
                Some(d) if a.dtype().is_float() && a.dtype() != d && !keep_dtype => a.astype(d)?,
                _ => a,
            };
            let shape = a.shape();
            // what is written, quantized layers counted unpacked (tensors the layout drops are not)
            weight_elems += a.size() as u64;
            let layer = if a.dtype().is_float() { quantizable_layer(&name, &shape, group_size) } else { None };
            let Some(layer) = layer.map(str::to_string) else {
                out.add(name, a)?;
                kept += 1;
                continue;
            };
            let router = layout.is_router(&layer);
            let mode = if router {
                QuantMode::Affine { bits: 8, group_size: 64 }
            } else if let Some(r) = opts.recipe {
                QuantMode::Affine { bits: mixed_bits(r, &layer, layer_location, num_layers), group_size }
            } else {
                opts.mode
            };
            // The router's own group may not divide its width: then it stays unquantized.
            if shape.last().is_some_and(|&d| d % mode.group_size() as usize != 0) {
                out.add(name, a)?;
                kept += 1;
                continue;
            }
            if router {
                // as mlx-lm's predicates write them: no mode key
                qcfg.insert(layer.clone(), json!({"group_size": 64, "bits": 8}));
            } else if mode != opts.mode || opts.recipe.is_some() {
                qcfg.insert(layer.clone(), mode_json(mode));
            }
            let q = a.quantize(mode)?;
            out.add(name, q.weight)?;
            out.add(format!("{layer}.scales"), q.scales)?;
            if let Some(b) = q.biases {
                out.add(format!("{layer}.biases"), b)?;
            }
            quantized += 1;
        }
        progress(QuantizeProgress { index, total, tensor: &info.name });
    }
    layout.finish()?;
    if quantized == 0 {
        return Err(ConvertError::BadOption(format!("no layer of {} can be quantized in groups of {group_size}", input.display())));
    }
    let obj = config.as_object_mut().expect("checked");
    obj.insert("quantization".into(), Value::Object(qcfg.clone()));
    obj.insert("quantization_config".into(), Value::Object(qcfg));
    if let Some(d) = opts.dtype {
        obj.insert("torch_dtype".into(), json!(d.torch_name()));
    }

    // mlx-lm's `total_parameters` counts a quantized layer's weight as its unpacked size: the
    // input's element count.
    let written = out.finish(weight_elems)?;
    staged.write("config.json", &serde_json::to_vec_pretty(&config)?)?;
    copy_side_files(input, &staged)?;
    let bytes_written = written.total_size;
    let bits_per_weight = if weight_elems > 0 { bytes_written as f64 * 8.0 / weight_elems as f64 } else { 0.0 };
    let output = staged.commit()?;
    let (bits, group_size) = match opts.recipe {
        Some(r) => (r.bits().0 as u32, group_size),
        None => (opts.mode.bits(), group_size),
    };
    Ok(QuantizeSummary {
        output,
        mode: opts.mode.name().into(),
        bits,
        group_size,
        recipe: opts.recipe,
        quantized,
        kept,
        bits_per_weight,
        bytes_written,
        shards: written.files,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The weights of a checkpoint directory: its index when there is one, else its
/// `model*.safetensors` files (as mlx-lm and our loader read them; other safetensors files, such
/// as reference outputs, are not weights).
fn open_weights(dir: &Path) -> Result<Vec<Checkpoint>, ConvertError> {
    let index = dir.join(mlx_array::io::INDEX_FILE);
    if index.exists() {
        return Ok(vec![Checkpoint::open(&index)?]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors")))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ConvertError::BadOption(format!("{} has no model*.safetensors weights", dir.display())));
    }
    files.iter().map(|f| Checkpoint::open(f).map_err(Into::into)).collect()
}

/// The tokenizer, template, generation and processor files of a checkpoint.
const SIDE_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
];

/// Tokenizer, template and generation files travel with the weights.
fn copy_side_files(input: &Path, staged: &StagedDir) -> Result<(), ConvertError> {
    let entries = std::fs::read_dir(input).map_err(io(input))?;
    let mut names: BTreeMap<String, PathBuf> = BTreeMap::new();
    for e in entries {
        let e = e.map_err(io(input))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if SIDE_FILES.contains(&name.as_str()) && e.path().is_file() {
            names.insert(name, e.path());
        }
    }
    for (name, p) in names {
        let dst = staged.path().join(&name);
        std::fs::copy(&p, &dst).map_err(io(&p))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_layers_are_quantized() {
        assert_eq!(quantizable_layer("model.layers.0.self_attn.q_proj.weight", &[64, 64], 64), Some("model.layers.0.self_attn.q_proj"));
        assert_eq!(quantizable_layer("model.embed_tokens.weight", &[512, 64], 64), Some("model.embed_tokens"));
        assert_eq!(quantizable_layer("model.layers.0.input_layernorm.weight", &[64], 64), None);
        assert_eq!(quantizable_layer("model.layers.0.self_attn.q_proj.bias", &[64], 64), None);
        assert_eq!(quantizable_layer("model.layers.0.mlp.down_proj.weight", &[64, 96], 64), None);
        assert_eq!(quantizable_layer("model.layers.0.conv.conv.weight", &[64, 1, 3], 64), None);
        assert_eq!(quantizable_layer("model.layers.0.conv.in_proj.weight", &[192, 64], 64), Some("model.layers.0.conv.in_proj"));
        assert_eq!(quantizable_layer("model.layers.0.mlp.switch_mlp.up_proj.weight", &[4, 64, 64], 64), Some("model.layers.0.mlp.switch_mlp.up_proj"));
        assert_eq!(quantizable_layer("model.vision_tower.blocks.0.attn.qkv.weight", &[64, 64], 64), None);
    }

    fn names(layout: &mut MlxLmLayout, name: &str, shape: &[usize]) -> Result<Vec<(String, Vec<usize>)>, ConvertError> {
        let a = Array::zeros(shape, DType::F32).unwrap();
        Ok(layout.tensors(name, a)?.into_iter().map(|(n, a)| (n, a.shape())).collect())
    }

    fn layout(cfg: Value) -> MlxLmLayout {
        MlxLmLayout::of(cfg.as_object().unwrap(), &[])
    }

    /// Gemma 4 tensors as mlx-lm's `sanitize` leaves them: fused experts split, towers and
    /// KV-shared layers' k/v projections dropped, `model.language_model.` moved to
    /// `language_model.model.`; other families keep their names.
    #[test]
    fn gemma4_tensors_in_mlx_lm_layout() {
        let cfg = |t: &str| json!({"model_type": t, "text_config": {"num_hidden_layers": 6, "num_kv_shared_layers": 2}});
        let mut text = layout(cfg("gemma4_text"));
        assert_eq!(text.kind, LayoutKind::Gemma4 { first_kv_shared: 4, multimodal: false });
        assert_eq!(layout(cfg("qwen3_moe")).kind, LayoutKind::AsStored);
        assert_eq!(
            names(&mut text, "model.layers.0.experts.gate_up_proj", &[4, 64, 32]).unwrap(),
            vec![("model.layers.0.experts.switch_glu.gate_proj.weight".into(), vec![4, 32, 32]), ("model.layers.0.experts.switch_glu.up_proj.weight".into(), vec![4, 32, 32])]
        );
        assert_eq!(names(&mut text, "model.layers.0.experts.down_proj", &[4, 32, 16]).unwrap(), vec![("model.layers.0.experts.switch_glu.down_proj.weight".into(), vec![4, 32, 16])]);
        assert!(names(&mut text, "model.layers.4.self_attn.k_proj.weight", &[8, 8]).unwrap().is_empty());
        assert_eq!(names(&mut text, "model.layers.3.self_attn.k_proj.weight", &[8, 8]).unwrap().len(), 1);
        assert!(names(&mut text, "model.layers.0.self_attn.rotary_emb.inv_freq", &[8]).unwrap().is_empty());
        assert!(matches!(names(&mut text, "model.layers.0.experts.gate_up_proj", &[4, 3, 8]), Err(ConvertError::BadTensor { .. })));
        assert!(matches!(names(&mut text, "model.layers.0.experts.gate_up_proj", &[4]), Err(ConvertError::BadTensor { .. })));
        let mut mm = layout(cfg("gemma4"));
        assert_eq!(layout(cfg("gemma4_unified")).kind, mm.kind);
        assert_eq!(names(&mut mm, "model.language_model.norm.weight", &[8]).unwrap(), vec![("language_model.model.norm.weight".into(), vec![8])]);
        assert!(names(&mut mm, "model.vision_tower.x.weight", &[8, 8]).unwrap().is_empty());
        assert!(names(&mut mm, "model.embed_vision.embedding_projection.weight", &[8, 8]).unwrap().is_empty());
        assert!(text.is_router("model.layers.0.router.proj") && !text.is_router("model.layers.0.mlp.gate"));
        assert!(layout(cfg("qwen3_moe")).is_router("model.layers.0.mlp.gate"));
    }

    /// LFM2-MoE: experts stacked into `switch_mlp` once all are stored (a missing one is an
    /// error at the end), `w1`/`w2`/`w3` renamed, conv weights `[C, K, 1]`.
    #[test]
    fn lfm2_moe_experts_are_stacked() {
        let mut l = layout(json!({"model_type": "lfm2_moe", "num_experts": 3}));
        for e in 0..2 {
            assert!(names(&mut l, &format!("model.layers.1.feed_forward.experts.{e}.w1.weight"), &[8, 16]).unwrap().is_empty());
        }
        assert!(matches!(l.finish(), Err(ConvertError::BadTensor { .. })), "an incomplete stack");
        assert_eq!(names(&mut l, "model.layers.1.feed_forward.experts.2.w1.weight", &[8, 16]).unwrap(), vec![("model.layers.1.feed_forward.switch_mlp.gate_proj.weight".into(), vec![3, 8, 16])]);
        l.finish().unwrap();
        assert_eq!(names(&mut l, "model.layers.0.feed_forward.w2.weight", &[16, 8]).unwrap(), vec![("model.layers.0.feed_forward.down_proj.weight".into(), vec![16, 8])]);
        assert_eq!(names(&mut l, "model.layers.0.conv.conv.weight", &[16, 1, 3]).unwrap(), vec![("model.layers.0.conv.conv.weight".into(), vec![16, 3, 1])]);
        assert!(matches!(names(&mut l, "model.layers.1.feed_forward.experts.3.w1.weight", &[8, 16]), Err(ConvertError::BadTensor { .. })));
    }

    /// Qwen3.5: everything under `language_model.`, tower and MTP dropped, experts split, and
    /// with transformers' conv layout the (1+w) norms stored as `w + 1`.
    #[test]
    fn qwen35_tensors_in_mlx_lm_layout() {
        let mut q = MlxLmLayout { kind: LayoutKind::Qwen35 { norms_as_deltas: true }, pending: BTreeMap::new() };
        assert_eq!(names(&mut q, "model.language_model.layers.0.mlp.experts.down_proj", &[4, 8, 16]).unwrap(), vec![("language_model.model.layers.0.mlp.switch_mlp.down_proj.weight".into(), vec![4, 8, 16])]);
        assert_eq!(names(&mut q, "lm_head.weight", &[8, 8]).unwrap()[0].0, "language_model.lm_head.weight");
        assert!(names(&mut q, "model.visual.blocks.0.attn.qkv.weight", &[8, 8]).unwrap().is_empty());
        assert!(names(&mut q, "mtp.fc.weight", &[8, 16]).unwrap().is_empty());
        assert_eq!(names(&mut q, "model.language_model.layers.0.linear_attn.conv1d.weight", &[16, 1, 4]).unwrap()[0].1, vec![16, 4, 1]);
        let norm = q.tensors("model.language_model.norm.weight", Array::from_slice(&[0.5f32, -1.0], &[2]).unwrap()).unwrap();
        assert_eq!(norm[0].1.to_vec::<f32>().unwrap(), vec![1.5, 0.0]);
        assert!(q.keeps_dtype("model.language_model.layers.0.linear_attn.A_log"));
    }

    #[test]
    fn mixed_recipe_matches_mlx_lm_choices() {
        // 16 layers: more bits for 0, 1 (< 2), 14, 15 (>= 14) and every third from 2 (4, 7, 10, 13)
        let more: Vec<usize> = (0..16).filter(|&i| mixed_bits(Recipe::Mixed4_6, &format!("model.layers.{i}.mlp.down_proj"), 2, 16) == 6).collect();
        assert_eq!(more, vec![0, 1, 4, 7, 10, 13, 14, 15]);
        assert_eq!(mixed_bits(Recipe::Mixed3_6, "model.layers.4.self_attn.q_proj", 2, 16), 3);
        assert_eq!(mixed_bits(Recipe::Mixed2_6, "lm_head", 2, 16), 6);
    }
}
