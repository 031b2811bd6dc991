//! GGUF -> Hugging Face checkpoint directory: `config.json` from the metadata, tensors under
//! HF names (llama.cpp's Q/K row permutation undone for `llama`, Gemma's `+1` on norms undone),
//! `tokenizer.json` / `tokenizer_config.json` / `generation_config.json`, safetensors in f32, bf16
//! or f16. Or config and tokenizer taken from an authoritative HF directory (`config_from`).
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use serde_json::{json, Value};

use super::{tokenizer, GgmlType, GgufFile, GgufHeader, TensorInfo};
use crate::output::{io, OutDtype, SafetensorsWriter, StagedDir, TensorSpec};
use crate::ConvertError;

/// Architectures this converter understands.
pub const ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"];

/// Options of [`convert`].
#[derive(Debug, Clone, Default)]
pub struct GgufToHfOptions {
    /// Element type of the written tensors.
    pub dtype: OutDtype,
    /// Take `config.json`, the tokenizer files and the chat template from this HF directory
    /// instead of rebuilding them from the (lossy) GGUF metadata.
    pub config_from: Option<PathBuf>,
}

/// One step of a conversion, for progress display.
#[derive(Debug, Clone)]
pub struct Progress<'a> {
    pub index: usize,
    pub total: usize,
    pub tensor: &'a str,
    pub bytes: u64,
}

/// What a conversion wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ConvertSummary {
    pub architecture: String,
    pub model_type: String,
    pub output: PathBuf,
    pub tensors: usize,
    pub bytes_written: u64,
    pub dtype: OutDtype,
    pub seconds: f64,
    /// Where the written `chat_template` came from (`None`: none written, or `--config-from`).
    pub chat_template: Option<tokenizer::ChatTemplateSource>,
}

/// Shape facts of the model, read from the metadata.
#[derive(Debug, Clone)]
struct Dims {
    arch: String,
    n_head: usize,
    n_head_kv: usize,
}

fn meta_u64(h: &GgufHeader, arch: &str, key: &str) -> Result<u64, ConvertError> {
    Ok(h.get_u64(&format!("{arch}.{key}"))?)
}

fn meta_opt_u64(h: &GgufHeader, arch: &str, key: &str) -> Result<Option<u64>, ConvertError> {
    let k = format!("{arch}.{key}");
    Ok(h.get(&k).map(|_| h.get_u64(&k)).transpose()?)
}

fn meta_opt_f64(h: &GgufHeader, arch: &str, key: &str) -> Result<Option<f64>, ConvertError> {
    let k = format!("{arch}.{key}");
    Ok(h.get(&k).map(|_| h.get_f64(&k)).transpose()?)
}

/// f32 metadata holds the decimal the converter wrote (1e-6 stored as 9.99999997e-07); print the
/// shortest decimal that rounds to the same f32, as the HF config had it.
fn f32_decimal(v: f64) -> Value {
    let f = v as f32;
    if f as f64 == v {
        json!(f.to_string().parse::<f64>().unwrap_or(v))
    } else {
        json!(v)
    }
}

/// `config.json` for the GGUF's architecture.
fn build_config(h: &GgufHeader, vocab_size: usize, tok: Option<&tokenizer::HfTokenizer>, dtype: OutDtype) -> Result<(Value, Dims), ConvertError> {
    let arch = h.architecture()?.to_string();
    if !ARCHITECTURES.contains(&arch.as_str()) {
        return Err(ConvertError::UnsupportedArchitecture { arch, supported: ARCHITECTURES.join(", ") });
    }
    if h.tensor("rope_freqs.weight").is_some() {
        return Err(ConvertError::NeedsConfig {
            reason: "the file carries rope_freqs (llama3-style rope scaling), whose parameters the metadata does not state".into(),
        });
    }
    let a = arch.as_str();
    let hidden = meta_u64(h, a, "embedding_length")?;
    let layers = meta_u64(h, a, "block_count")?;
    let n_head = meta_u64(h, a, "attention.head_count")?;
    let n_head_kv = meta_opt_u64(h, a, "attention.head_count_kv")?.unwrap_or(n_head);
    if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
        return Err(ConvertError::BadMetadata(format!("{n_head} attention heads cannot share {n_head_kv} key/value heads")));
    }
    let head_dim = match meta_opt_u64(h, a, "attention.key_length")? {
        Some(d) => d,
        None => match meta_opt_u64(h, a, "rope.dimension_count")? {
            Some(d) if a == "llama" => d,
            _ => hidden / n_head,
        },
    };
    let eps = meta_opt_f64(h, a, "attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6);
    let theta = meta_opt_f64(h, a, "rope.freq_base")?.unwrap_or(10000.0);
    let ctx = meta_opt_u64(h, a, "context_length")?.unwrap_or(2048);
    let inter = meta_opt_u64(h, a, "feed_forward_length")?;
    let tied = h.tensor("output.weight").is_none();
    let mut c = serde_json::Map::new();
    let (arch_name, model_type) = match a {
        "llama" => ("LlamaForCausalLM", "llama"),
        "qwen2" => ("Qwen2ForCausalLM", "qwen2"),
        "qwen3" => ("Qwen3ForCausalLM", "qwen3"),
        "qwen3moe" => ("Qwen3MoeForCausalLM", "qwen3_moe"),
        _ => ("Gemma3ForCausalLM", "gemma3_text"),
    };
    c.insert("architectures".into(), json!([arch_name]));
    c.insert("model_type".into(), json!(model_type));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("num_hidden_layers".into(), json!(layers));
    c.insert("num_attention_heads".into(), json!(n_head));
    c.insert("num_key_value_heads".into(), json!(n_head_kv));
    c.insert("head_dim".into(), json!(head_dim));
    c.insert("rms_norm_eps".into(), f32_decimal(eps));
    c.insert("rope_theta".into(), f32_decimal(theta));
    c.insert("max_position_embeddings".into(), json!(ctx));
    c.insert("vocab_size".into(), json!(meta_opt_u64(h, a, "vocab_size")?.unwrap_or(vocab_size as u64)));
    c.insert("tie_word_embeddings".into(), json!(tied));
    c.insert("torch_dtype".into(), json!(dtype.torch_name()));
    if let Some(i) = inter {
        c.insert("intermediate_size".into(), json!(i));
    }
    let has_bias = h.tensor("blk.0.attn_q.bias").is_some();
    match a {
        "llama" => {
            c.insert("hidden_act".into(), json!("silu"));
            c.insert("attention_bias".into(), json!(has_bias));
            c.insert("mlp_bias".into(), json!(h.tensor("blk.0.ffn_up.bias").is_some()));
            c.insert("rope_scaling".into(), Value::Null);
        }
        "qwen2" => {
            c.insert("hidden_act".into(), json!("silu"));
            c.insert("use_sliding_window".into(), json!(false));
        }
        "qwen3" => {
            c.insert("hidden_act".into(), json!("silu"));
            c.insert("attention_bias".into(), json!(has_bias));
        }
        "qwen3moe" => {
            c.insert("hidden_act".into(), json!("silu"));
            c.insert("attention_bias".into(), json!(has_bias));
            c.insert("num_experts".into(), json!(meta_u64(h, a, "expert_count")?));
            c.insert("num_experts_per_tok".into(), json!(meta_u64(h, a, "expert_used_count")?));
            c.insert("moe_intermediate_size".into(), json!(meta_u64(h, a, "expert_feed_forward_length")?));
            c.insert("norm_topk_prob".into(), json!(true));
            c.insert("decoder_sparse_step".into(), json!(1));
            c.insert("mlp_only_layers".into(), json!([]));
        }
        _ => {
            // gemma3: five sliding-window layers, then one global, as Gemma 3 is built
            let window = meta_opt_u64(h, a, "attention.sliding_window")?;
            let pattern = 6u64;
            let types: Vec<&str> =
                (0..layers).map(|i| if window.is_some() && (i + 1) % pattern != 0 { "sliding_attention" } else { "full_attention" }).collect();
            c.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            c.insert("query_pre_attn_scalar".into(), json!(head_dim));
            c.insert("sliding_window".into(), json!(window));
            c.insert("layer_types".into(), json!(types));
            c.insert("rope_local_base_freq".into(), json!(10000.0));
            c.insert("rope_scaling".into(), Value::Null);
            c.insert("attention_bias".into(), json!(false));
            c.insert("attn_logit_softcapping".into(), Value::Null);
            c.insert("final_logit_softcapping".into(), Value::Null);
        }
    }
    if let Some(t) = tok {
        for (k, v) in [("bos_token_id", t.bos_token_id), ("eos_token_id", t.eos_token_id), ("pad_token_id", t.pad_token_id)] {
            if let Some(v) = v {
                c.insert(k.into(), json!(v));
            }
        }
    }
    Ok((Value::Object(c), Dims { arch, n_head: n_head as usize, n_head_kv: n_head_kv as usize }))
}

/// The HF name(s) of a GGUF tensor: `None` when the tensor has no HF counterpart.
fn hf_name(arch: &str, gguf: &str) -> Option<String> {
    let top = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (stem, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let gemma = arch == "gemma3";
    let hf = match stem {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "attn_norm" => "input_layernorm",
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" if gemma => "post_attention_layernorm",
        "post_ffw_norm" if gemma => "post_feedforward_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "ffn_gate_inp" if arch == "qwen3moe" => "mlp.gate",
        "ffn_gate_exps" if arch == "qwen3moe" => "mlp.experts.{e}.gate_proj",
        "ffn_up_exps" if arch == "qwen3moe" => "mlp.experts.{e}.up_proj",
        "ffn_down_exps" if arch == "qwen3moe" => "mlp.experts.{e}.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// One output tensor: where its values come from and what is done to them.
struct Plan<'a> {
    name: String,
    src: &'a TensorInfo,
    shape: Vec<usize>,
    /// For a stacked expert tensor, which expert (a slice of the first axis).
    expert: Option<usize>,
    /// Undo llama.cpp's Q/K permutation with this many heads.
    unpermute: Option<usize>,
    /// Gemma stores norm weights as `1 + w`.
    minus_one: bool,
}

/// transformers' `reverse_permute_weights`: rows grouped as (head, dim/2, 2) back to (head, 2, dim/2).
fn reverse_permute(data: &[f32], rows: usize, cols: usize, n_head: usize) -> Result<Vec<f32>, ConvertError> {
    if n_head == 0 || rows % (2 * n_head) != 0 {
        return Err(ConvertError::BadMetadata(format!("{rows} rows cannot be split into {n_head} rotary heads")));
    }
    let half = rows / n_head / 2;
    let mut out = vec![0f32; data.len()];
    // reshape(n_head, half, 2, cols).swapaxes(1, 2): out[h, j, i] = in[h, i, j]
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                let src = (h * half * 2 + i * 2 + j) * cols;
                let dst = (h * 2 * half + j * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    Ok(out)
}

fn plan<'a>(h: &'a GgufHeader, dims: &Dims) -> Result<Vec<Plan<'a>>, ConvertError> {
    let mut plans = Vec::new();
    for t in &h.tensors {
        let name = hf_name(&dims.arch, &t.name)
            .ok_or_else(|| ConvertError::UnmappedTensor { tensor: t.name.clone(), arch: dims.arch.clone() })?;
        if !t.ty.can_dequantize() {
            return Err(super::GgufError::UnsupportedTensorType { tensor: t.name.clone(), ty: t.ty }.into());
        }
        let shape = t.shape();
        let minus_one = dims.arch == "gemma3" && name.ends_with("norm.weight");
        if name.contains("{e}") {
            if shape.len() != 3 {
                return Err(ConvertError::BadMetadata(format!("{}: stacked experts with shape {shape:?}", t.name)));
            }
            for e in 0..shape[0] {
                plans.push(Plan { name: name.replace("{e}", &e.to_string()), src: t, shape: shape[1..].to_vec(), expert: Some(e), unpermute: None, minus_one });
            }
            continue;
        }
        let unpermute = match (dims.arch.as_str(), t.name.rsplit_once('.').map(|x| x.0).and_then(|s| s.rsplit_once('.')).map(|x| x.1)) {
            ("llama", Some("attn_q")) => Some(dims.n_head),
            ("llama", Some("attn_k")) => Some(dims.n_head_kv),
            _ => None,
        };
        plans.push(Plan { name, src: t, shape, expert: None, unpermute, minus_one });
    }
    Ok(plans)
}

/// Copy the HF files that describe the model from `dir`, checking they fit the GGUF.
fn copy_config(from: &Path, out: &StagedDir, h: &GgufHeader, dims: &Dims) -> Result<Value, ConvertError> {
    let cfg_path = from.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
    let cfg: Value = serde_json::from_str(&text).map_err(|e| ConvertError::BadConfig { path: cfg_path.clone(), msg: e.to_string() })?;
    let text_cfg = cfg.get("text_config").unwrap_or(&cfg);
    let a = dims.arch.as_str();
    for (key, meta) in [("hidden_size", "embedding_length"), ("num_hidden_layers", "block_count"), ("num_attention_heads", "attention.head_count")] {
        let want = meta_u64(h, a, meta)?;
        let got = text_cfg.get(key).and_then(Value::as_u64);
        if got != Some(want) {
            return Err(ConvertError::ConfigMismatch { key: key.into(), config: got.map_or("absent".into(), |g| g.to_string()), gguf: want.to_string() });
        }
    }
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json"] {
        let p = from.join(name);
        if p.exists() {
            let dst = out.path().join(name);
            std::fs::copy(&p, &dst).map_err(io(&p))?;
        }
    }
    Ok(cfg)
}

/// Convert a GGUF file into a Hugging Face checkpoint directory at `out` (written under a
/// temporary name and renamed into place).
pub fn convert(input: &Path, out: &Path, opts: &GgufToHfOptions, mut progress: impl FnMut(Progress<'_>)) -> Result<ConvertSummary, ConvertError> {
    let t0 = Instant::now();
    let file = GgufFile::open(input)?;
    let h = &file.header;
    let staged = StagedDir::new(out)?;
    let tok = match &opts.config_from {
        Some(_) => None,
        None => Some(tokenizer::build(h)?),
    };
    let vocab_size = tok.as_ref().map_or(0, |t| t.vocab_size);
    let (config, dims) = match &opts.config_from {
        None => build_config(h, vocab_size, tok.as_ref(), opts.dtype)?,
        Some(dir) => {
            let arch = h.architecture()?.to_string();
            if !ARCHITECTURES.contains(&arch.as_str()) {
                return Err(ConvertError::UnsupportedArchitecture { arch, supported: ARCHITECTURES.join(", ") });
            }
            let n_head = meta_u64(h, &arch, "attention.head_count")? as usize;
            let n_head_kv = meta_opt_u64(h, &arch, "attention.head_count_kv")?.map_or(n_head, |v| v as usize);
            let dims = Dims { arch, n_head, n_head_kv };
            (copy_config(dir, &staged, h, &dims)?, dims)
        }
    };
    let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or_default().to_string();
    if let Some(t) = &tok {
        staged.write("config.json", &serde_json::to_vec_pretty(&config)?)?;
        staged.write("tokenizer.json", &serde_json::to_vec(&t.tokenizer_json)?)?;
        staged.write("tokenizer_config.json", &serde_json::to_vec_pretty(&t.tokenizer_config)?)?;
        let mut gen = serde_json::Map::new();
        for (k, v) in [("bos_token_id", t.bos_token_id), ("eos_token_id", t.eos_token_id), ("pad_token_id", t.pad_token_id)] {
            if let Some(v) = v {
                gen.insert(k.into(), json!(v));
            }
        }
        if !gen.is_empty() {
            staged.write("generation_config.json", &serde_json::to_vec_pretty(&Value::Object(gen))?)?;
        }
    }

    let plans = plan(h, &dims)?;
    let specs = plans
        .iter()
        .map(|p| TensorSpec {
            name: p.name.clone(),
            dtype: opts.dtype.safetensors_name(),
            n_bytes: p.shape.iter().product::<usize>() as u64 * opts.dtype.size(),
            shape: p.shape.clone(),
        })
        .collect();
    let st_path = staged.path().join("model.safetensors");
    let mut writer = SafetensorsWriter::create(&st_path, specs, &[("format", "pt")])?;
    let total = plans.len();
    let mut bytes_written = 0u64;
    let mut buf = Vec::new();
    let mut last: Option<(&str, Vec<f32>)> = None;
    for (index, p) in plans.iter().enumerate() {
        // Stacked experts share one source tensor: dequantize it once.
        let full = match &last {
            Some((n, v)) if *n == p.src.name => v,
            _ => {
                let v = super::dequantize(p.src.ty, file.tensor_bytes(p.src), p.src.n_elements() as usize)
                    .map_err(|ty| super::GgufError::UnsupportedTensorType { tensor: p.src.name.clone(), ty })?;
                last = Some((p.src.name.as_str(), v));
                &last.as_ref().unwrap().1
            }
        };
        let n: usize = p.shape.iter().product();
        let mut values: Vec<f32> = match p.expert {
            Some(e) => full[e * n..(e + 1) * n].to_vec(),
            None => full.clone(),
        };
        if let Some(heads) = p.unpermute {
            let cols = if p.shape.len() > 1 { p.shape[1..].iter().product() } else { 1 };
            values = reverse_permute(&values, p.shape[0], cols, heads)?;
        }
        if p.minus_one {
            values.iter_mut().for_each(|v| *v -= 1.0);
        }
        buf.clear();
        opts.dtype.encode(&values, &mut buf);
        writer.write_tensor(&p.name, &buf)?;
        bytes_written += buf.len() as u64;
        progress(Progress { index, total, tensor: &p.name, bytes: buf.len() as u64 });
    }
    writer.finish()?;
    let output = staged.commit()?;
    Ok(ConvertSummary {
        architecture: dims.arch,
        model_type,
        output,
        tensors: total,
        bytes_written,
        dtype: opts.dtype,
        seconds: t0.elapsed().as_secs_f64(),
        chat_template: tok.as_ref().and_then(|t| t.chat_template),
    })
}

impl GgmlType {
    /// The type's name as ggml spells it (`Q4_K`).
    pub fn name(self) -> String {
        format!("{self:?}")
    }
}
