//! Qwen3.5 dense (`qwen3_5`) and MoE (`qwen3_5_moe`) causal LMs: hybrid stacks of GatedDeltaNet
//! linear-attention layers ([`super::gated_delta`]) and gated full-attention layers (mirrors
//! transformers' `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` and mlx-lm's `qwen3_5.py`).
//!
//! - Layer `i` is full attention when `layer_types[i] == "full_attention"` (or, without
//!   `layer_types`, when `(i + 1) % full_attention_interval == 0`), otherwise GatedDeltaNet.
//! - Full attention: `q_proj` is 2× wide (query and a sigmoid output gate per head), q/k RMSNorm,
//!   rotary on the first `partial_rotary_factor · head_dim` dims (text-only M-RoPE is plain RoPE).
//! - Every RMSNorm except the gated one inside GatedDeltaNet is `x · (1 + w)`; the `1 + w` is formed
//!   once at load, in f32.
//! - MoE checkpoints: each layer whose index is not in `mlp_only_layers` and for which
//!   `(i + 1) % decoder_sparse_step == 0` has a [`SparseMoe`] block (top-k softmax routing,
//!   renormalized unless `norm_topk_prob` is false, plus the sigmoid-gated shared expert); other
//!   layers a dense MLP of `intermediate_size`. Experts load from the fused hub layout or the
//!   per-expert layout transformers writes.
//! - Checkpoint layouts: text-only (`model.layers.*`), ConditionalGeneration
//!   (`model.language_model.*`) and mlx-lm's saved form (`language_model.model.*`, conv1d
//!   weights `[C, K, 1]`, the 1 of the (1 + w) norms already added, MoE experts stacked in
//!   `switch_mlp`; plain or quantized). Vision-tower tensors (`model.visual.*`) are skipped and
//!   reported in [`Qwen35Model::load_notes`].
//! - MTP head: `mtp.*` tensors in the checkpoint, or the sidecars mlx-node names (`mtp.safetensors`,
//!   `mtp/weights.safetensors`, `mlx_lm_extra_tensors.mtp_file` for dense, and an mlx-vlm
//!   `mtp-drafter/` directory whose bare keys are read as `mtp.*`), are loaded and kept as
//!   [`Qwen35Model::mtp_weights`]; built into the head [`ModelRuntime::mtp_forward`] runs (for
//!   speculative drafts; the plain forward pass does not use it). A checkpoint without them loads;
//!   one whose MTP tensors do not build (missing or extra tensors) loads too, with the reason in
//!   [`Qwen35Model::load_notes`] and returned by `mtp_forward`.
//!
//! ## Caches and chat sessions
//! Full-attention layers use [`crate::cache::LayerCache::Kv`]; GatedDeltaNet layers a
//! [`crate::cache::LayerCache::Recurrent`] with two slots (the last `K - 1` conv inputs, and the f32 delta-rule
//! state `[B, Hv, Dk, Dv]`). A recurrent state summarizes *all* tokens seen so far and cannot be
//! rolled back, so [`Cache::trim`] refuses it. What the shared session code therefore does:
//! - **reused**: a new turn whose prompt extends exactly the tokens already in the cache (the usual
//!   continue: the previous prompt + reply, then the new messages) only prefills the appended
//!   tokens; the states continue from where they are, which is exact.
//! - **recomputed**: anything else (a prompt that diverges inside the cached tokens, an edit of
//!   history, a restart with a shorter prefix) resets the cache and prefills the whole prompt,
//!   because the state at the divergence point was not saved.
use super::gated_delta::{self, GatedDeltaConfig, GatedDeltaNet};
use super::moe::{SparseMoe, SparseMoeConfig};
use crate::cache::{Cache, CacheSpec, LayerKind};
use crate::config::{default_f32, default_true, default_usize, DecoderConfig};
use crate::layers::decoder::{FeedForward, HybridBlock, HybridStack, Mixer};
use crate::layers::{Activation, Attention, AttentionConfig, Embedding, GatedMlp, LmHead, RmsNorm, Rope, RopeScaling};
use crate::runtime::{ForwardOutput, Logits, ModelInfo, ModelRuntime};
use crate::weights::Weights;
use crate::{ModelError, Result};
use mlx_array::{Array, DType};
use crate::registry::{Built, LoadContext, Preset};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// The decoder settings of a Qwen3.5 (dense or MoE) checkpoint, from [`crate::config::text_config`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Qwen35Config {
    #[serde(flatten)]
    pub decoder: DecoderConfig,
    /// Dense MLP width (dense models, and `mlp_only_layers` of MoE models).
    #[serde(default)]
    pub intermediate_size: usize,
    pub num_key_value_heads: usize,
    #[serde(default = "default_f32::<10_000_000>")]
    pub rope_theta: f32,
    #[serde(default = "default_partial")]
    pub partial_rotary_factor: f32,
    /// `rope_scaling` (or a scaled `rope_parameters`) over the rotated dims.
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default = "default_usize::<262144>")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default = "default_usize::<4>")]
    pub full_attention_interval: usize,
    #[serde(default = "default_usize::<4>")]
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    // MoE (absent or 0 for dense checkpoints).
    #[serde(default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
    #[serde(default = "default_true")]
    pub norm_topk_prob: bool,
    #[serde(default = "default_usize::<1>")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    // MTP head size (either name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtp_num_hidden_layers: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_nextn_predict_layers: Option<usize>,
}

fn default_partial() -> f32 {
    0.25
}

crate::config::impl_deref!(Qwen35Config => decoder: DecoderConfig);

impl Qwen35Config {
    /// Rotary dims of the full-attention layers.
    pub fn rotary_dims(&self) -> usize {
        ((self.head_dim() as f32 * self.partial_rotary_factor) as usize) & !1
    }
    /// The rope of the full-attention layers: `rope_theta` over [`Self::rotary_dims`], scaled as
    /// `rope_scaling` asks.
    pub fn rope(&self) -> std::result::Result<Rope, String> {
        Rope::scaled(self.rotary_dims(), self.rope_theta, self.rope_scaling.as_ref(), self.max_position_embeddings)
    }
    /// Whether layer `i` is full attention (else GatedDeltaNet).
    pub fn is_full_attention(&self, i: usize) -> bool {
        match &self.layer_types {
            Some(t) => t.get(i).is_some_and(|s| s == "full_attention"),
            None => (i + 1).is_multiple_of(self.full_attention_interval.max(1)),
        }
    }
    /// Whether layer `i` has a sparse MoE block (else a dense MLP).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.num_experts > 0 && !self.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }
    /// The gated full-attention layers' settings (q/k norms with offset `norm_offset`: 1 for the hub
    /// layout's norm deltas, 0 where the 1 is already added).
    pub(crate) fn attention(&self, norm_offset: f32) -> AttentionConfig {
        AttentionConfig {
            bias: self.attention_bias,
            o_bias: self.attention_bias,
            qk_norm: Some(self.rms_norm_eps),
            norm_offset,
            output_gate: true,
            ..AttentionConfig::new(self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim())
        }
    }
    /// The sparse MoE blocks' settings.
    pub(crate) fn sparse_moe(&self, act: Activation) -> SparseMoeConfig {
        SparseMoeConfig {
            hidden: self.hidden_size,
            num_experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            moe_intermediate: self.moe_intermediate_size,
            shared_intermediate: self.shared_expert_intermediate_size,
            norm_topk_prob: self.norm_topk_prob,
            act,
        }
    }
    /// Declared MTP layers (`mtp_num_hidden_layers`, else `num_nextn_predict_layers`, else 0).
    pub fn mtp_layers(&self) -> usize {
        self.mtp_num_hidden_layers.or(self.num_nextn_predict_layers).unwrap_or(0)
    }
    pub fn gated_delta(&self) -> GatedDeltaConfig {
        GatedDeltaConfig {
            hidden: self.hidden_size,
            num_k_heads: self.linear_num_key_heads,
            num_v_heads: self.linear_num_value_heads,
            head_k_dim: self.linear_key_head_dim,
            head_v_dim: self.linear_value_head_dim,
            conv_kernel: self.linear_conv_kernel_dim,
            eps: self.rms_norm_eps,
        }
    }
    /// Checks the config before any tensor is read.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.decoder.validate(self.num_key_value_heads)?;
        self.rope()?;
        let (hk, hv) = (self.linear_num_key_heads, self.linear_num_value_heads);
        if hk == 0 || hv % hk != 0 || self.linear_key_head_dim == 0 || self.linear_value_head_dim == 0 || self.linear_conv_kernel_dim == 0 {
            return Err(format!("linear_num_value_heads {hv} must be a multiple of linear_num_key_heads {hk}, head dims and conv kernel positive"));
        }
        if let Some(t) = &self.layer_types {
            if t.len() != self.num_hidden_layers {
                return Err(format!("layer_types has {} entries for {} layers", t.len(), self.num_hidden_layers));
            }
            if let Some(bad) = t.iter().find(|s| *s != "full_attention" && *s != "linear_attention") {
                return Err(format!("unknown layer type {bad:?}"));
            }
        }
        let any_moe = (0..self.num_hidden_layers).any(|i| self.is_moe_layer(i));
        let any_dense = (0..self.num_hidden_layers).any(|i| !self.is_moe_layer(i));
        if any_moe && (self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts || self.moe_intermediate_size == 0) {
            return Err(format!("MoE needs 1 <= num_experts_per_tok ({}) <= num_experts ({}) and moe_intermediate_size > 0", self.num_experts_per_tok, self.num_experts));
        }
        if any_dense && self.intermediate_size == 0 {
            return Err("intermediate_size must be positive for dense MLP layers".into());
        }
        Ok(())
    }
}

pub(crate) type Block = HybridBlock<GatedDeltaNet, SparseMoe>;

/// Decoder layer `i` at `lv` around its `mixer`: the norms (offset `off`) and the feed-forward,
/// sparse where the config puts experts in layer `i` (MTP layer `i` follows the same rule, as
/// vLLM builds it).
pub(crate) fn block(lv: &crate::weights::Vb, cfg: &Qwen35Config, i: usize, off: f32, mixer: Mixer<GatedDeltaNet>, moe_cfg: &SparseMoeConfig) -> Result<Block> {
    let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
    let ffn = if cfg.is_moe_layer(i) {
        FeedForward::Experts(SparseMoe::load(&lv.pp("mlp"), moe_cfg)?)
    } else {
        FeedForward::Dense(GatedMlp::load(&lv.pp("mlp"), h, cfg.intermediate_size, moe_cfg.act)?)
    };
    Ok(Block { mixer_norm: RmsNorm::load(&lv.pp("input_layernorm"), h, eps, off)?, mixer, ffn_norm: RmsNorm::load(&lv.pp("post_attention_layernorm"), h, eps, off)?, ffn })
}

/// A Qwen3.5 (dense or MoE) causal LM.
pub struct Qwen35Model {
    cfg: Qwen35Config,
    pub(crate) stack: HybridStack<GatedDeltaNet, SparseMoe>,
    info: ModelInfo,
    mtp: HashMap<String, Array>,
    /// The MTP head built from `mtp`, or why it could not be.
    mtp_head: std::result::Result<Option<super::qwen3_5_mtp::Mtp>, String>,
    notes: Vec<String>,
    /// KV heads of this rank's cache (all of them unless the load is tensor parallel).
    kv_heads: usize,
}

impl Qwen35Model {
    /// `family`: `qwen3_5` or `qwen3_5_moe` (the canonical type reported in [`ModelInfo`]).
    /// `raw` is the (text) config JSON, read for the MTP sidecar setting.
    pub fn new(weights: &Weights, cfg: Qwen35Config, raw: &serde_json::Value, eos: Vec<u32>, family: &str) -> Result<Self> {
        let path = weights.path().to_path_buf();
        cfg.validate().map_err(|reason| ModelError::MalformedConfig { path: path.clone(), reason })?;
        let root = weights.root();
        let prefix = weights.decoder_prefix();
        let vb = root.pp(prefix);
        // mlx-lm's saved layout (what `mlx_lm.convert` writes): conv1d weights `[C, K, 1]` and the
        // (1 + w) norms stored with the 1 added.
        let mlx_layout = (0..cfg.num_hidden_layers)
            .find(|&i| !cfg.is_full_attention(i))
            .and_then(|i| weights.shape_of(&format!("{prefix}.layers.{i}.linear_attn.conv1d.weight")))
            .is_some_and(|s| s.len() == 3 && s[2] == 1 && s[1] > 1);
        let off = if mlx_layout { 0.0 } else { 1.0 };
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let act = Activation::parse(&cfg.hidden_act).expect("validated");
        let acfg = cfg.attention(off);
        let moe_cfg = cfg.sparse_moe(act);
        let rope = cfg.rope().map_err(|reason| ModelError::MalformedConfig { path: weights.path().to_path_buf(), reason })?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let lv = vb.pp("layers").pp(i);
                let mixer = if cfg.is_full_attention(i) {
                    Mixer::Attention(Attention::load(&lv.pp("self_attn"), acfg.clone(), rope.clone(), ["q_norm", "k_norm"])?)
                } else {
                    Mixer::Recurrent(GatedDeltaNet::load(&lv.pp("linear_attn"), cfg.gated_delta())?)
                };
                block(&lv, &cfg, i, off, mixer, &moe_cfg)
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = Embedding::load(&vb.pp("embed_tokens"), cfg.vocab_size, h)?;
        let lm_head = LmHead::load(&root, prefix, &embed, cfg.tie_word_embeddings, h, cfg.vocab_size)?;
        let mut notes = Vec::new();
        let visual = weights.set_aside_names().into_iter().filter(|n| n.starts_with("model.visual.") || n.starts_with("visual.")).count();
        if visual > 0 {
            notes.push(format!("skipped {visual} vision-tower tensors (model.visual.*): text-only model"));
        }
        let mtp = load_mtp(weights, raw, family, embed.dtype(), &mut notes)?;
        let mtp_head = if mtp.is_empty() {
            Ok(None)
        } else {
            super::qwen3_5_mtp::Mtp::load(&mtp, &cfg, off, &path).map(Some).map_err(|e| {
                let msg = format!("MTP head not built: {e}");
                notes.push(msg.clone());
                msg
            })
        };
        let info = ModelInfo::decoder(family, cfg.vocab_size, h, cfg.num_hidden_layers, cfg.max_position_embeddings, eos, cfg.bos_token_id);
        let norm = RmsNorm::load(&vb.pp("norm"), h, eps, off)?;
        let kv_heads = crate::layers::parallel::per_rank(&vb, "KV heads", cfg.num_key_value_heads)?;
        Ok(Qwen35Model { stack: HybridStack { embed, layers, norm, lm_head }, cfg, info, mtp, mtp_head, notes, kv_heads })
    }

    pub fn config(&self) -> &Qwen35Config {
        &self.cfg
    }
    /// Whether the checkpoint (or a sidecar) shipped MTP head tensors.
    pub fn has_mtp_weights(&self) -> bool {
        !self.mtp.is_empty()
    }
    /// The MTP tensors, keyed `mtp.*` (unused by [`ModelRuntime::forward`]).
    pub fn mtp_weights(&self) -> &HashMap<String, Array> {
        &self.mtp
    }
    /// What loading skipped or found (vision tower, MTP sidecars).
    pub fn load_notes(&self) -> &[String] {
        &self.notes
    }

}

/// MTP tensors: `mtp.*` in the checkpoint, then the sidecar files (see the module docs).
fn load_mtp(weights: &Weights, raw: &serde_json::Value, family: &str, dtype: DType, notes: &mut Vec<String>) -> Result<HashMap<String, Array>> {
    let root = weights.root();
    let mut mtp: HashMap<String, Array> = HashMap::new();
    let names: Vec<String> = weights.names().into_iter().filter(|n| n.starts_with("mtp.")).collect();
    for n in names {
        mtp.insert(n.clone(), root.get_any(&n)?);
    }
    let dir = weights.path();
    // Sidecars (mlx-node's loader rules): only dense qwen3_5 has them (top-level mtp.safetensors, nested
    // mtp/weights.safetensors, a config-declared relative file); MoE stores MTP inline.
    let mut sidecars: Vec<std::path::PathBuf> = Vec::new();
    if family == "qwen3_5" {
        sidecars.push(dir.join("mtp.safetensors"));
        sidecars.push(dir.join("mtp/weights.safetensors"));
        if let Some(f) = raw.get("mlx_lm_extra_tensors").and_then(|e| e.get("mtp_file")).and_then(|f| f.as_str()) {
            let p = Path::new(f.trim());
            // Relative and contained in the checkpoint directory only.
            if !f.trim().is_empty() && p.is_relative() && !p.components().any(|c| matches!(c, std::path::Component::ParentDir)) {
                sidecars.push(dir.join(p));
            }
        }
    }
    for p in sidecars {
        if p.is_file() {
            let t = mlx_array::io::load_safetensors(&p, Some(dtype))?;
            notes.push(format!("loaded {} MTP tensors from {}", t.len(), p.display()));
            for (k, v) in t {
                let k = if k.starts_with("mtp.") { k } else { format!("mtp.{k}") };
                mtp.entry(k).or_insert(v);
            }
        }
    }
    let drafter = dir.join("mtp-drafter");
    if drafter.is_dir() {
        let mut files: Vec<_> = std::fs::read_dir(&drafter)
            .map_err(|e| ModelError::io(&drafter, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        for p in files {
            let t = mlx_array::io::load_safetensors(&p, Some(dtype))?;
            notes.push(format!("loaded {} MTP drafter tensors from {}", t.len(), p.display()));
            for (k, v) in t {
                let k = if k.starts_with("mtp.") { k } else { format!("mtp.{k}") };
                mtp.entry(k).or_insert(v);
            }
        }
    }
    Ok(mtp)
}

impl ModelRuntime for Qwen35Model {
    fn has_mtp_weights(&self) -> bool {
        Qwen35Model::has_mtp_weights(self)
    }
    fn mtp_layers(&self) -> usize {
        self.mtp_head.as_ref().ok().and_then(|m| m.as_ref()).map_or(0, |m| m.num_layers())
    }
    fn mtp_cache_spec(&self) -> Option<CacheSpec> {
        self.mtp_head.as_ref().ok().and_then(|m| m.as_ref()).map(|m| m.cache_spec())
    }
    fn mtp_forward(&self, tokens: &Array, hidden: &Array, cache: &mut Cache, layer: usize) -> Result<(Array, Array)> {
        match &self.mtp_head {
            Ok(Some(m)) => m.forward(&self.stack.embed, &self.stack.lm_head, tokens, hidden, cache, layer),
            Ok(None) => Err(ModelError::UnsupportedOption(format!("{} has no MTP head weights", self.info.model_type))),
            Err(e) => Err(ModelError::UnsupportedOption(e.clone())),
        }
    }
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn cache_spec(&self) -> CacheSpec {
        self.stack.cache_spec(LayerKind::Attention { kv_heads: self.kv_heads, head_dim: self.cfg.head_dim() }, gated_delta::SLOTS)
    }
    fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        self.stack.forward(tokens, cache, logits, hidden)
    }
    crate::layers::decoder::hybrid_stack_taps!();
}

/// The registry's constructor (`qwen3_5` and `qwen3_5_moe`).
pub(crate) fn load(c: &LoadContext) -> Result<Built> {
    Ok(Built::Lm(Box::new(Qwen35Model::new(c.weights, c.parse()?, &c.text, c.eos.clone(), c.family.model_type)?)))
}

/// A text-only Qwen3.5 config.json: 3 GatedDeltaNet layers per gated full-attention layer, a
/// quarter rotary; with `experts` `(count, top_k, width, shared width)` every layer is sparse.
fn shape(h: usize, layers: usize, heads: usize, d: usize, inter: usize, lin: (usize, usize, usize), vocab: usize, tied: bool, experts: Option<(usize, usize, usize, usize)>) -> Value {
    let types: Vec<&str> = (0..layers).map(|i| if (i + 1) % 4 == 0 { "full_attention" } else { "linear_attention" }).collect();
    let (model_type, arch) = if experts.is_some() { ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM") } else { ("qwen3_5_text", "Qwen3_5ForCausalLM") };
    let mut v = serde_json::json!({
        "model_type": model_type, "architectures": [arch],
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": d, "vocab_size": vocab,
        "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "tie_word_embeddings": tied, "max_position_embeddings": if vocab > 512 { 262144 } else { 4096 }, "eos_token_id": 488,
        "layer_types": types, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": lin.2, "linear_value_head_dim": lin.2, "linear_num_key_heads": lin.0, "linear_num_value_heads": lin.1
    });
    if let Some((e, k, w, sw)) = experts {
        let o = v.as_object_mut().expect("object");
        for (key, x) in [("num_experts", e), ("num_experts_per_tok", k), ("moe_intermediate_size", w), ("shared_expert_intermediate_size", sw)] {
            o.insert(key.into(), x.into());
        }
        o.insert("norm_topk_prob".into(), true.into());
    }
    v
}

/// `tiny`: hidden 64, 4 layers, vocab 512, untied; `small`: hidden 1024, 8 layers, head 256,
/// linear attention 8 key / 16 value heads of 128, vocab 32k.
pub(crate) const PRESETS: &[Preset] = &[
    ("tiny", || shape(64, 4, 4, 32, 128, (2, 4, 16), 512, false, None)),
    ("small", || shape(1024, 8, 8, 256, 3072, (8, 16, 128), 32768, true, None)),
];

/// `tiny`: the tiny shape with 8 experts of 32, top 2, a shared expert of 48; `small`: 16
/// experts of 256, top 4, a shared expert of 512; `35b_a3b`: Qwen3.5-35B-A3B's text shape
/// (hidden 2048, 40 layers, 16 heads of 256 with 2 KV heads, linear attention 16 key / 32
/// value heads of 128, 256 experts of 512 with top 8 and a shared expert of 512, vocab 248320,
/// untied): about 35B parameters, 70 GB in bf16 (the multi-GPU expert-parallel benchmark).
pub(crate) const MOE_PRESETS: &[Preset] = &[
    ("tiny", || shape(64, 4, 4, 32, 0, (2, 4, 16), 512, false, Some((8, 2, 32, 48)))),
    ("small", || shape(1024, 8, 8, 256, 0, (8, 16, 128), 32768, true, Some((16, 4, 256, 512)))),
    ("35b_a3b", || shape(2048, 40, 16, 256, 0, (16, 32, 128), 248320, false, Some((256, 8, 512, 512)))),
];
