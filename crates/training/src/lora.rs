//! LoRA (low-rank adapters) over a [`ParameterTree`], in mlx-lm's layout.
//!
//! [`apply_lora`] adds, for every targeted linear projection `prefix` (a float or quantized
//! `prefix.weight`), the tensors `prefix.lora_a` (`[in, r]`, uniform in `±1/sqrt(in)`) and
//! `prefix.lora_b` (`[r, out]`, zeros), both f32 and trainable, and freezes every other
//! parameter (a quantized base stays packed: QLoRA). The model then computes
//! `y = base(x) + scale * ((dropout(x) A) B)` in those projections
//! ([`mlx_models::LoraSettings`]), as mlx-lm's `LoRALinear` does.
//!
//! Targets follow mlx-lm's `linear_to_lora_layers`: the last `num_layers` decoder layers
//! (`<= 0`: all of them), and in each the projections whose path inside the layer is one of
//! `keys` (`self_attn.q_proj`, `mlp.down_proj`, ...); without keys, every linear projection of
//! the layer. A key may also name a projection outside the layers by its full name (`lm_head`).
//! Stacked expert weights (mlx-lm's `SwitchLinear`) and embeddings are not adapted.
//!
//! Files, as mlx-lm reads and writes them: `adapters.safetensors` holds `{prefix}.lora_a` and
//! `{prefix}.lora_b`; `adapter_config.json` holds `fine_tune_type` (`"lora"`), `num_layers` and
//! `lora_parameters` (`rank`, `scale`, `dropout`, `keys`). [`fuse_lora`] folds the adapters
//! into the base weights (`W + scale * Bᵀ Aᵀ`, dequantizing and requantizing a quantized base
//! with its own mode, as `mlx_lm.fuse` does) and [`save_model`] writes a model directory in
//! Hugging Face's layout.
use crate::error::{io_err, Result, TrainError};
use crate::state;
use mlx_array::random::Key;
use mlx_array::{Array, DType, Quantized};
use mlx_models::weights::QuantSpec;
use mlx_models::{LoraSettings, ParameterTree};
use std::collections::BTreeMap;
use std::path::Path;

pub const ADAPTERS_FILE: &str = "adapters.safetensors";
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";

/// LoRA settings. Defaults are mlx-lm's: rank 8, scale 20, no dropout, the last 16 layers,
/// every linear projection of a layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    /// Multiplies the adapter's product (mlx-lm's `scale`; `alpha / rank` in PEFT's terms).
    pub scale: f32,
    pub dropout: f32,
    /// Adapt the last `num_layers` decoder layers; `<= 0`: all.
    pub num_layers: i64,
    /// Projection paths inside a layer (or full names outside); `None`: every linear one.
    pub keys: Option<Vec<String>>,
    /// Seeds the initial `lora_a` draws.
    pub seed: u64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig { rank: 8, scale: 20.0, dropout: 0.0, num_layers: 16, keys: None, seed: 0 }
    }
}

impl LoraConfig {
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(TrainError::Config("LoRA rank must be >= 1".into()));
        }
        if !self.scale.is_finite() {
            return Err(TrainError::Config("LoRA scale must be finite".into()));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(TrainError::Config("LoRA dropout must lie in [0, 1)".into()));
        }
        if self.keys.as_ref().is_some_and(|k| k.is_empty()) {
            return Err(TrainError::Config("LoRA keys: an empty list targets nothing".into()));
        }
        Ok(())
    }

    /// The settings models are built with (dropout off until a trainer sets a seed).
    pub fn settings(&self) -> LoraSettings {
        LoraSettings { scale: self.scale, dropout: self.dropout, dropout_seed: None }
    }
}

/// A linear projection of the tree: its name (without `.weight`) and shape.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearTarget {
    pub prefix: String,
    pub in_dim: usize,
    pub out_dim: usize,
}

/// `model.layers.3.self_attn.q_proj` -> (`model.layers`, 3, `self_attn.q_proj`).
fn split_layer(module: &str) -> Option<(&str, usize, &str)> {
    let mut from = 0;
    while let Some(i) = module[from..].find("layers.") {
        let at = from + i;
        if at == 0 || module.as_bytes()[at - 1] == b'.' {
            let rest = &module[at + "layers.".len()..];
            if let Some((idx, tail)) = rest.split_once('.') {
                if let Ok(n) = idx.parse::<usize>() {
                    return Some((&module[..at + "layers".len()], n, tail));
                }
            }
        }
        from = at + 1;
    }
    None
}

/// The tree's linear projections: float 2-D `weight`s and quantized ones (with `scales`),
/// embeddings excepted, by name.
pub fn linear_projections(tree: &ParameterTree) -> Result<Vec<LinearTarget>> {
    let quant = QuantSpec::from_config(tree.config()).map_err(TrainError::Config)?;
    let mut out = Vec::new();
    for (name, p) in tree.iter() {
        let Some(prefix) = name.strip_suffix(".weight") else {
            continue;
        };
        if prefix.rsplit('.').next().is_some_and(|last| last.contains("embed")) {
            continue;
        }
        // expert projections are stacked at load (mlx-lm's SwitchLinear): not adapted
        let parts: Vec<&str> = prefix.split('.').collect();
        if parts.windows(2).any(|w| w[0] == "experts" && w[1].parse::<usize>().is_ok()) || parts.iter().any(|p| *p == "switch_mlp" || *p == "experts") {
            continue;
        }
        let shape = p.array.shape();
        let [rows, cols] = shape[..] else { continue };
        if tree.get(&format!("{prefix}.scales")).is_some() {
            let q = quant.as_ref().ok_or_else(|| TrainError::Config(format!("{prefix} is quantized but config.json has no quantization")))?;
            let mode = match q.layers.get(prefix) {
                Some(Some(m)) => *m,
                Some(None) => continue,
                None => q.default,
            };
            out.push(LinearTarget { prefix: prefix.to_string(), in_dim: cols * 32 / mode.bits() as usize, out_dim: rows });
        } else if p.array.dtype().is_float() {
            out.push(LinearTarget { prefix: prefix.to_string(), in_dim: cols, out_dim: rows });
        }
    }
    Ok(out)
}

/// The projections `config` targets (see the module docs), sorted by name.
pub fn lora_targets(tree: &ParameterTree, config: &LoraConfig) -> Result<Vec<LinearTarget>> {
    let all = linear_projections(tree)?;
    let layers = all.iter().filter_map(|t| split_layer(&t.prefix).map(|(_, n, _)| n + 1)).max().unwrap_or(0);
    let first = if config.num_layers <= 0 { 0 } else { layers.saturating_sub(config.num_layers as usize) };
    let targets: Vec<LinearTarget> = all
        .into_iter()
        .filter(|t| match (split_layer(&t.prefix), &config.keys) {
            (Some((_, n, tail)), keys) => n >= first && keys.as_ref().is_none_or(|k| k.iter().any(|k| k == tail)),
            (None, Some(keys)) => keys.contains(&t.prefix),
            (None, None) => false,
        })
        .collect();
    if let Some(keys) = &config.keys {
        for k in keys {
            if !targets.iter().any(|t| t.prefix == *k || split_layer(&t.prefix).is_some_and(|(_, _, tail)| tail == k)) {
                return Err(TrainError::Config(format!("LoRA key {k:?} names no linear projection of the targeted layers")));
            }
        }
    }
    if targets.is_empty() {
        return Err(TrainError::Config("LoRA targets no linear projection".into()));
    }
    Ok(targets)
}

fn name_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Add fresh adapters for the projections `config` targets, freeze everything else and set the
/// tree's LoRA settings. Returns the targets.
pub fn apply_lora(tree: &mut ParameterTree, config: &LoraConfig) -> Result<Vec<LinearTarget>> {
    config.validate()?;
    if tree.lora().is_some() {
        return Err(TrainError::InvalidInput("the tree has LoRA adapters already".into()));
    }
    let targets = lora_targets(tree, config)?;
    tree.freeze(|_| true);
    for t in &targets {
        let bound = 1.0 / (t.in_dim as f32).sqrt();
        let a = mlx_array::random::uniform(&[t.in_dim, config.rank], -bound, bound, DType::F32, &Key::new(config.seed ^ name_hash(&t.prefix))?)?;
        let b = Array::zeros(&[config.rank, t.out_dim], DType::F32)?;
        tree.insert(&format!("{}.lora_a", t.prefix), a, true)?;
        tree.insert(&format!("{}.lora_b", t.prefix), b, true)?;
    }
    tree.set_lora(Some(config.settings()));
    Ok(targets)
}

/// The adapter tensors of the tree (`*.lora_a`, `*.lora_b`), by name.
pub fn adapter_tensors(tree: &ParameterTree) -> Vec<(String, Array)> {
    tree.iter().filter(|(n, _)| n.ends_with(".lora_a") || n.ends_with(".lora_b")).map(|(n, p)| (n.to_string(), p.array.clone())).collect()
}

/// `adapter_config.json` as mlx-lm writes it (the fields its loader reads, and the keys).
pub fn adapter_config_json(tree: &ParameterTree, config: &LoraConfig) -> serde_json::Value {
    let targets: Vec<String> = adapter_tensors(tree).iter().filter_map(|(n, _)| n.strip_suffix(".lora_a").map(str::to_string)).collect();
    let mut keys: Vec<String> = match &config.keys {
        Some(k) => k.clone(),
        None => targets.iter().map(|p| split_layer(p).map_or(p.as_str(), |(_, _, tail)| tail).to_string()).collect(),
    };
    keys.sort();
    keys.dedup();
    serde_json::json!({
        "fine_tune_type": "lora",
        "model": tree.dir().to_string_lossy(),
        "num_layers": config.num_layers,
        "seed": config.seed,
        "lora_parameters": { "rank": config.rank, "scale": config.scale, "dropout": config.dropout, "keys": keys },
    })
}

/// Write `adapters.safetensors` and `adapter_config.json` into `dir` (which must exist), each
/// atomically.
pub fn write_adapter_files(dir: &Path, tree: &ParameterTree, config: &LoraConfig) -> Result<()> {
    let tensors = adapter_tensors(tree);
    if tensors.is_empty() {
        return Err(TrainError::InvalidInput("the tree has no LoRA adapters".into()));
    }
    let refs: Vec<(&str, &Array)> = tensors.iter().map(|(n, a)| (n.as_str(), a)).collect();
    mlx_array::io::save_safetensors(dir.join(ADAPTERS_FILE), &refs, None)?;
    let path = dir.join(ADAPTER_CONFIG_FILE);
    let text = serde_json::to_string_pretty(&adapter_config_json(tree, config)).map_err(|e| TrainError::State { path: path.clone(), msg: e.to_string() })?;
    mlx_array::io::write_atomic(&path, (text + "\n").as_bytes())?;
    Ok(())
}

/// Save the adapters to the directory `dir` (created or replaced atomically).
pub fn save_adapters(dir: &Path, tree: &ParameterTree, config: &LoraConfig) -> Result<()> {
    state::write_dir_atomically(dir, |tmp| write_adapter_files(tmp, tree, config))
}

/// Read `adapter_config.json` of `dir` (mlx-lm's or ours).
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join(ADAPTER_CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let bad = |msg: String| TrainError::State { path: path.clone(), msg };
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    match v.get("fine_tune_type").and_then(|t| t.as_str()).unwrap_or("lora") {
        "lora" => {}
        other => return Err(bad(format!("fine_tune_type {other:?}: only \"lora\" adapters are supported"))),
    }
    let p = v.get("lora_parameters").ok_or_else(|| bad("no lora_parameters".into()))?;
    let num = |k: &str| p.get(k).and_then(|x| x.as_f64()).ok_or_else(|| bad(format!("lora_parameters.{k} must be a number")));
    let rank = p.get("rank").and_then(|x| x.as_u64()).ok_or_else(|| bad("lora_parameters.rank must be a positive integer".into()))? as usize;
    let keys = match p.get("keys") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::Array(a)) => Some(a.iter().map(|k| k.as_str().map(str::to_string).ok_or_else(|| bad("lora_parameters.keys must be strings".into()))).collect::<Result<Vec<_>>>()?),
        Some(_) => return Err(bad("lora_parameters.keys must be a list".into())),
    };
    let num_layers = v.get("num_layers").and_then(|n| n.as_i64()).ok_or_else(|| bad("num_layers must be an integer".into()))?;
    let seed = v.get("seed").and_then(|s| s.as_u64()).unwrap_or(0);
    let cfg = LoraConfig { rank, scale: num("scale")? as f32, dropout: p.get("dropout").and_then(|x| x.as_f64()).unwrap_or(0.0) as f32, num_layers, keys, seed };
    cfg.validate().map_err(|e| bad(e.to_string()))?;
    Ok(cfg)
}

/// Load the adapters saved in `dir` (mlx-lm's files or ours) into `tree`: every tensor of
/// `adapters.safetensors` is added (trainable, everything else frozen), each pair checked
/// against its projection's shape and the config's rank. Returns the config.
pub fn load_adapters(tree: &mut ParameterTree, dir: &Path) -> Result<LoraConfig> {
    let config = read_adapter_config(dir)?;
    if tree.lora().is_some() {
        return Err(TrainError::InvalidInput("the tree has LoRA adapters already".into()));
    }
    let path = dir.join(ADAPTERS_FILE);
    let bad = |msg: String| TrainError::State { path: path.clone(), msg };
    let tensors = mlx_array::io::load_safetensors(&path, None)?;
    let linears: BTreeMap<String, LinearTarget> = linear_projections(tree)?.into_iter().map(|t| (t.prefix.clone(), t)).collect();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    for name in &names {
        let (prefix, leaf) = name.rsplit_once('.').ok_or_else(|| bad(format!("{name}: not an adapter tensor")))?;
        let t = linears.get(prefix).ok_or_else(|| bad(format!("{name}: {prefix} is not a linear projection of the model")))?;
        let want = match leaf {
            "lora_a" => [t.in_dim, config.rank],
            "lora_b" => [config.rank, t.out_dim],
            _ => return Err(bad(format!("{name}: not an adapter tensor (lora_a or lora_b)"))),
        };
        let a = &tensors[*name];
        if a.shape() != want || !a.dtype().is_float() {
            return Err(bad(format!("{name}: {} {:?}, expected float {want:?}", a.dtype(), a.shape())));
        }
        let other = format!("{prefix}.{}", if leaf == "lora_a" { "lora_b" } else { "lora_a" });
        if !tensors.contains_key(&other) {
            return Err(bad(format!("{name} without {other}")));
        }
    }
    if names.is_empty() {
        return Err(bad("no adapter tensors".into()));
    }
    tree.freeze(|_| true);
    for name in names {
        tree.insert(name, tensors[name].clone(), true)?;
    }
    tree.set_lora(Some(config.settings()));
    Ok(config)
}

/// The tree with its adapters folded into the base weights (`W + scale * Bᵀ Aᵀ`, in the
/// weight's dtype; a quantized base is dequantized, summed and quantized again in its mode,
/// as `mlx_lm.fuse` does) and the adapter tensors removed.
pub fn fuse_lora(tree: &ParameterTree) -> Result<ParameterTree> {
    let settings = tree.lora().cloned().ok_or_else(|| TrainError::InvalidInput("the tree has no LoRA adapters".into()))?;
    let quant = QuantSpec::from_config(tree.config()).map_err(TrainError::Config)?;
    let mut out = tree.clone();
    let prefixes: Vec<String> = tree.iter().filter_map(|(n, _)| n.strip_suffix(".lora_a").map(str::to_string)).collect();
    for prefix in prefixes {
        let a = out.remove(&format!("{prefix}.lora_a")).ok_or_else(|| TrainError::InvalidInput(format!("no {prefix}.lora_a")))?.array;
        let b = out.remove(&format!("{prefix}.lora_b")).ok_or_else(|| TrainError::InvalidInput(format!("no {prefix}.lora_b")))?.array;
        let wname = format!("{prefix}.weight");
        let w = out.get(&wname).ok_or_else(|| TrainError::InvalidInput(format!("no {wname}")))?.array.clone();
        let delta = b.transpose(&[1, 0])?.mul_scalar(settings.scale)?.matmul(&a.transpose(&[1, 0])?)?;
        if let Some(scales) = out.get(&format!("{prefix}.scales")).map(|p| p.array.clone()) {
            let q = quant.as_ref().ok_or_else(|| TrainError::Config(format!("{prefix} is quantized but config.json has no quantization")))?;
            let mode = match q.layers.get(&prefix) {
                Some(Some(m)) => *m,
                _ => q.default,
            };
            let biases = out.get(&format!("{prefix}.biases")).map(|p| p.array.clone());
            let base = Quantized { weight: w, scales, biases, mode }.dequantize(None)?;
            let fused = base.add(&delta.astype(base.dtype())?)?.quantize(mode)?;
            out.set(&wname, fused.weight)?;
            out.set(&format!("{prefix}.scales"), fused.scales)?;
            if let Some(b) = fused.biases {
                out.set(&format!("{prefix}.biases"), b)?;
            }
        } else {
            let fused = w.add(&delta.astype(w.dtype())?)?;
            out.set(&wname, fused)?;
        }
    }
    out.set_lora(None);
    out.freeze(|_| true);
    Ok(out)
}

/// Write the tree as a model directory in Hugging Face's layout, atomically:
/// `model.safetensors` (floats in `dtype` when given), the source checkpoint's config.json
/// (dtype entries updated) and tokenizer files. A tree with adapters is refused: fuse it first.
pub fn save_model(tree: &ParameterTree, dir: &Path, dtype: Option<DType>) -> Result<()> {
    if tree.lora().is_some() || !adapter_tensors(tree).is_empty() {
        return Err(TrainError::InvalidInput("the tree has LoRA adapters: fuse them (fuse_lora) or save them (save_adapters)".into()));
    }
    let arrays: Vec<(String, Array)> = tree.iter().map(|(n, p)| (n.to_string(), p.array.clone())).collect();
    let params: Vec<(&str, &Array)> = arrays.iter().map(|(n, a)| (n.as_str(), a)).collect();
    state::write_dir_atomically(dir, |tmp| state::write_model_files(tmp, state::MODEL_FILE, &params, dtype, tree.dir()))
}

#[cfg(test)]
mod tests {
    use super::split_layer;

    #[test]
    fn layer_paths() {
        assert_eq!(split_layer("model.layers.3.self_attn.q_proj"), Some(("model.layers", 3, "self_attn.q_proj")));
        assert_eq!(split_layer("language_model.model.layers.12.mlp.gate_proj"), Some(("language_model.model.layers", 12, "mlp.gate_proj")));
        assert_eq!(split_layer("model.sublayers.3.x"), None);
        assert_eq!(split_layer("lm_head"), None);
        assert_eq!(split_layer("model.layers.x.y"), None);
    }
}
