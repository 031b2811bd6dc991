//! LFM2 and LFM2-MoE hybrid causal LMs (mirrors mlx-lm `models/lfm2.py`, `models/lfm2_moe.py`
//! and HF `Lfm2ForCausalLM` / `Lfm2MoeForCausalLM`).
//!
//! Each layer is a gated short convolution (`conv`) or grouped-query attention with q/k layer norms
//! (`full_attention`), chosen by `full_attn_idxs` / `layer_types`, followed by a SwiGLU feed-forward
//! (`w1`/`w3`/`w2`). LFM2-MoE replaces the feed-forward of layers `>= num_dense_layers` with a
//! sigmoid-routed top-k expert block. `model.embedding_norm` is the *final* norm.
//!
//! Caches: attention layers keep K/V ([`LayerKind::Attention`], the only layers a paged cache would
//! hold); conv layers keep one recurrent slot, the last `conv_L_cache - 1` gated inputs `[B, K-1, H]`.
use super::moe::{ExpertLayout, SwitchGlu};
use crate::cache::{Cache, CacheSpec, LayerKind};
use crate::config::{default_f32, default_true, default_usize};
use crate::layers::decoder::{ExpertBlock, FeedForward, HybridBlock, HybridStack, Mixer, RecurrentMixer};
use crate::layers::{Activation, Attention, AttentionConfig, Embedding, GatedMlp, Linear, LmHead, RmsNorm, Rope, RopeScaling};
use crate::runtime::{ForwardOutput, Logits, ModelInfo, ModelRuntime};
use crate::weights::{Vb, Weights};
use crate::{ModelError, Result};
use mlx_array::{Array, DType, Quantized};
use crate::registry::{Built, LoadContext, Preset};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `config.json` of an LFM2 or LFM2-MoE checkpoint (hub style and transformers-5 style).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Lfm2Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default = "default_usize::<128_000>")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub norm_eps: f32,
    #[serde(default)]
    pub conv_bias: bool,
    #[serde(default = "default_usize::<3>", rename = "conv_L_cache")]
    pub conv_l_cache: usize,
    #[serde(default = "default_f32::<1_000_000>")]
    pub rope_theta: f32,
    /// `rope_scaling` (or a scaled `rope_parameters`).
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub full_attn_idxs: Option<Vec<usize>>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Dense feed-forward width (LFM2: before the `block_*` adjustment; transformers 5 writes only
    /// this, the hub also `block_ff_dim`).
    #[serde(default)]
    pub intermediate_size: Option<usize>,
    #[serde(default)]
    pub block_dim: Option<usize>,
    #[serde(default)]
    pub block_ff_dim: Option<usize>,
    #[serde(default = "default_usize::<256>")]
    pub block_multiple_of: usize,
    #[serde(default = "default_multiplier")]
    pub block_ffn_dim_multiplier: Option<f32>,
    #[serde(default = "default_true")]
    pub block_auto_adjust_ff_dim: bool,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub tie_embedding: Option<bool>,
    // LFM2-MoE.
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default)]
    pub num_experts: Option<usize>,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub use_expert_bias: bool,
    #[serde(default)]
    pub num_dense_layers: usize,
    #[serde(default = "default_f32::<1>")]
    pub routed_scaling_factor: f32,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
}

fn default_eps() -> f32 {
    1e-5
}
fn default_multiplier() -> Option<f32> {
    Some(1.0)
}

/// LFM2's feed-forward width rule: `int(2·ff/3)`, times the multiplier, rounded up to a multiple
/// of `multiple_of` (LFM2-350M: 6656 → 4608), when `auto_adjust` is set; `ff` otherwise.
pub fn effective_ff_dim(ff: usize, multiple_of: usize, multiplier: Option<f32>, auto_adjust: bool) -> usize {
    if !auto_adjust {
        return ff;
    }
    let mut d = 2 * ff / 3;
    if let Some(m) = multiplier {
        d = (m as f64 * d as f64) as usize;
    }
    let m = multiple_of.max(1);
    d.div_ceil(m) * m
}

impl Lfm2Config {
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }
    pub fn tied(&self) -> bool {
        self.tie_word_embeddings.or(self.tie_embedding).unwrap_or(true)
    }
    /// Which layers are attention layers: `full_attn_idxs` when given (as mlx-lm), else `layer_types`.
    pub fn attention_layers(&self) -> std::result::Result<Vec<bool>, String> {
        let n = self.num_hidden_layers;
        let mut is_attn = vec![false; n];
        if let Some(idx) = &self.full_attn_idxs {
            for &i in idx {
                if i >= n {
                    return Err(format!("full_attn_idxs entry {i} out of range for {n} layers"));
                }
                is_attn[i] = true;
            }
        } else if let Some(types) = &self.layer_types {
            if types.len() != n {
                return Err(format!("layer_types has {} entries for {n} layers", types.len()));
            }
            for (i, t) in types.iter().enumerate() {
                is_attn[i] = match t.as_str() {
                    "full_attention" => true,
                    "conv" => false,
                    other => return Err(format!("unknown layer type {other:?} (expected \"conv\" or \"full_attention\")")),
                };
            }
        } else {
            return Err("neither full_attn_idxs nor layer_types is given".into());
        }
        Ok(is_attn)
    }
    /// Dense feed-forward width of LFM2 layers (after the `block_*` adjustment).
    pub fn dense_ff_dim(&self, moe: bool) -> Option<usize> {
        if moe {
            // Lfm2Moe's dense layers use intermediate_size as is.
            return self.intermediate_size;
        }
        let ff = self.block_ff_dim.or(self.intermediate_size)?;
        Some(effective_ff_dim(ff, self.block_multiple_of, self.block_ffn_dim_multiplier, self.block_auto_adjust_ff_dim))
    }
    /// Checks the config before any tensor is read.
    /// The rope of the attention layers: `rope_theta` over the whole head, scaled as
    /// `rope_scaling` asks.
    pub fn rope(&self) -> std::result::Result<Rope, String> {
        Rope::scaled(self.head_dim(), self.rope_theta, self.rope_scaling.as_ref(), self.max_position_embeddings)
    }

    pub fn validate(&self, moe: bool) -> std::result::Result<(), String> {
        self.rope()?;
        let h = self.num_attention_heads;
        let kv = self.kv_heads();
        if h == 0 || kv == 0 || !h.is_multiple_of(kv) {
            return Err(format!("num_attention_heads {h} must be a positive multiple of num_key_value_heads {kv}"));
        }
        if self.hidden_size == 0 || !self.hidden_size.is_multiple_of(h) || !self.head_dim().is_multiple_of(2) {
            return Err(format!("hidden_size {} must be a positive multiple of num_attention_heads {h} with an even head_dim", self.hidden_size));
        }
        if self.num_hidden_layers == 0 || self.vocab_size == 0 || self.conv_l_cache == 0 {
            return Err("num_hidden_layers, vocab_size and conv_L_cache must be positive".into());
        }
        if let Some(d) = self.block_dim {
            if d != self.hidden_size {
                return Err(format!("block_dim {d} differs from hidden_size {}", self.hidden_size));
            }
        }
        let attn = self.attention_layers()?;
        if !attn.iter().any(|a| *a) {
            return Err("LFM2 needs at least one full_attention layer".into());
        }
        if self.dense_ff_dim(moe).is_none_or(|d| d == 0) && (!moe || self.num_dense_layers > 0) {
            return Err("missing or zero intermediate_size / block_ff_dim".into());
        }
        if moe && self.num_dense_layers < self.num_hidden_layers {
            let (e, k) = (self.num_experts.unwrap_or(0), self.num_experts_per_tok.unwrap_or(0));
            if e == 0 || k == 0 || k > e {
                return Err(format!("num_experts_per_tok {k} must be in 1..=num_experts {e}"));
            }
            if self.moe_intermediate_size.unwrap_or(0) == 0 {
                return Err("missing or zero moe_intermediate_size".into());
            }
        }
        Ok(())
    }
}

/// Gated short convolution: `out_proj(C · conv(B · x))` with a depthwise causal conv of width K.
#[derive(Clone)]
struct ShortConv {
    in_proj: Linear,
    out_proj: Linear,
    /// MLX layout `[H, K, 1]`.
    weight: Array,
    bias: Option<Array>,
    hidden: usize,
    k: usize,
}

crate::layers::layer_arrays!(ShortConv { in_proj, out_proj, weight, bias });

impl ShortConv {
    fn load(vb: &Vb, cfg: &Lfm2Config) -> Result<Self> {
        let (h, k) = (cfg.hidden_size, cfg.conv_l_cache);
        if let Some(g) = crate::layers::parallel::group(vb) {
            return Self::load_sharded(vb, cfg, g.rank(), g.size());
        }
        // HF stores [H, 1, K]; mlx-lm's converted checkpoints [H, K, 1].
        let w = vb.get_either("conv.weight", &[&[h, 1, k], &[h, k, 1]], crate::weights::Init::WEIGHT)?;
        let weight = if w.shape() == [h, 1, k] && k > 1 { w.transpose(&[0, 2, 1])? } else { w };
        let bias = if cfg.conv_bias { Some(vb.get("conv.bias", &[h])?) } else { None };
        Ok(ShortConv {
            in_proj: Linear::load(&vb.pp("in_proj"), h, 3 * h, cfg.conv_bias)?,
            out_proj: Linear::load(&vb.pp("out_proj"), h, h, cfg.conv_bias)?,
            weight,
            bias,
            hidden: h,
            k,
        })
    }

    /// Tensor parallel: this rank's `H / N` channels of B, C and x (rows of each third of
    /// `in_proj`), of the depthwise conv, and the matching inputs of `out_proj` (summed over the
    /// ranks).
    fn load_sharded(vb: &Vb, cfg: &Lfm2Config, r: usize, n: usize) -> Result<Self> {
        let (h, k) = (cfg.hidden_size, cfg.conv_l_cache);
        let local = crate::layers::parallel::per_rank(vb, "conv channels", h)?;
        let ip = vb.pp("in_proj");
        let b = if cfg.conv_bias { Some(ip.get_shard_as("bias", &[3 * h], &[3, h], 1, r, n)?.reshape(&[(3 * local) as i32])?) } else { None };
        // [3, local, ..] back to [3 * local, ..] rows
        let rows = |a: Array| -> Result<Array> {
            let last = a.shape()[2] as i32;
            Ok(a.reshape(&[(3 * local) as i32, last])?)
        };
        let in_proj = if ip.is_quantized() {
            let q = ip.quantized_shard_as(&[3 * h, h], &[3, h, h], 1, r, n)?;
            let q = Quantized { weight: rows(q.weight)?, scales: rows(q.scales)?, biases: q.biases.map(rows).transpose()?, mode: q.mode };
            match vb.weights().dequantize_to {
                Some(dt) => Linear::new(q.dequantize(Some(dt))?, b)?,
                None => Linear::quantized(q, b),
            }
        } else {
            Linear::new(rows(ip.get_shard_as("weight", &[3 * h, h], &[3, h, h], 1, r, n)?)?, b)?
        };
        let cv = vb.pp("conv");
        let hf_layout = vb.weights().shape_of(&format!("{}.conv.weight", vb.prefix())).is_none_or(|s| s == [h, 1, k]);
        let weight = if hf_layout {
            let w = cv.get_shard("weight", &[h, 1, k], 0, r, n)?;
            if k > 1 { w.transpose(&[0, 2, 1])? } else { w }
        } else {
            cv.get_shard("weight", &[h, k, 1], 0, r, n)?
        };
        let bias = if cfg.conv_bias { Some(cv.get_shard("bias", &[h], 0, r, n)?) } else { None };
        Ok(ShortConv {
            in_proj,
            out_proj: Linear::load_parallel(&vb.pp("out_proj"), h, h, cfg.conv_bias, crate::layers::parallel::Shard::Input)?,
            weight,
            bias,
            hidden: local,
            k,
        })
    }

    /// `x`: `[B, L, H]`; `state` holds the last `K - 1` gated inputs of earlier calls.
    /// `valid`: see [`RecurrentMixer::forward_slots`] (padding positions feed zeros to the conv).
    /// With `packed`, `x` is a packed step (`[1, T, H]`): the projections and gates run over its
    /// tokens, the convolution over its rows.
    fn forward(&self, x: &Array, state: &mut Option<Array>, valid: Option<&Array>, packed: Option<&crate::batch::Ragged>) -> Result<Array> {
        let parts = self.in_proj.forward(x)?.split(3, -1)?;
        let (b, c, xx) = (&parts[0], &parts[1], &parts[2]);
        let bx = b.mul(xx)?;
        let bx = packed.map_or(Ok(bx.clone()), |g| g.to_rows(&bx, 1))?;
        let bx = crate::batch::zero_padding(&bx, valid)?;
        let keep = self.k - 1;
        let prev = match state.take() {
            Some(s) => s,
            None => Array::zeros(&[bx.dim(0)?, keep, self.hidden], bx.dtype())?,
        };
        let full = crate::batch::conv_input(&prev, &bx, valid)?;
        let t = full.dim(1)?;
        *state = Some(full.slice_axis(1, t - keep, t)?);
        let mut conv = full.conv1d(&self.weight, 1, 0, 1, self.hidden)?;
        if let Some(bias) = &self.bias {
            conv = conv.add(bias)?;
        }
        if let Some(g) = packed {
            conv = g.to_packed(&conv)?;
        }
        self.out_proj.forward(&c.mul(&conv)?)
    }
}

/// Sigmoid-routed top-k experts (LFM2-MoE): `expert_bias` picks the experts, the unbiased
/// sigmoid scores weight them (renormalized with a 1e-6 guard when `norm_topk_prob`, then scaled
/// by `routed_scaling_factor`). The experts are the generic [`SwitchGlu`] (`gather_mm`, tokens
/// sorted by expert for larger batches; on the CPU, long prompts run one product per chosen
/// expert).
#[derive(Clone)]
struct MoeBlock {
    gate: Linear,
    expert_bias: Option<Array>,
    experts: SwitchGlu,
    top_k: usize,
    norm_topk_prob: bool,
    scaling: f32,
}

crate::layers::layer_arrays!(MoeBlock { gate, expert_bias, experts });

impl MoeBlock {
    fn load(vb: &Vb, cfg: &Lfm2Config) -> Result<Self> {
        let h = cfg.hidden_size;
        let e = cfg.num_experts.expect("validated");
        let i = cfg.moe_intermediate_size.expect("validated");
        // Per-expert `experts.N.w1/w3/w2` (what transformers writes), or mlx-lm's stacked
        // `switch_mlp.{gate,up,down}_proj`.
        let experts = if vb.contains("switch_mlp.gate_proj.weight") {
            SwitchGlu::load_switch_mlp(&vb.pp("switch_mlp"), e, h, i, Activation::Silu)?
        } else {
            SwitchGlu::load(&vb.pp("experts"), e, h, i, ["w1", "w3", "w2"], Activation::Silu, ExpertLayout::PerExpert)?
        };
        let expert_bias = if cfg.use_expert_bias { Some(vb.get("expert_bias", &[e])?.astype(DType::F32)?) } else { None };
        Ok(MoeBlock {
            gate: Linear::load(&vb.pp("gate"), h, e, false)?,
            expert_bias,
            experts,
            top_k: cfg.num_experts_per_tok.expect("validated"),
            norm_topk_prob: cfg.norm_topk_prob,
            scaling: cfg.routed_scaling_factor,
        })
    }
}

impl ExpertBlock for MoeBlock {
    /// `x: [B, L, H]` → `[B, L, H]`.
    fn forward_experts(&self, x: &Array) -> Result<Array> {
        let dims = x.dims().to_vec();
        let flat = x.reshape(&[-1, dims[2]])?;
        let k = self.top_k;
        let scores = self.gate.forward(&flat)?.sigmoid()?; // [T, E]
        let e = scores.dim(1)?;
        let select = match &self.expert_bias {
            Some(bias) => scores.astype(DType::F32)?.add(bias)?,
            None => scores.clone(),
        };
        // the choice is a constant to gradients ([`super::moe::route_topk_probs`])
        let inds = mlx_array::grad::stop_gradient(&select.argpartition((e - k) as i32, 1)?.slice_axis(1, e - k, e)?)?; // [T, k]
        let mut w = scores.take_along_axis(&inds, 1)?;
        if self.norm_topk_prob {
            w = w.div(&w.sum(&[1], true)?.add_scalar(1e-6)?)?;
        }
        if self.scaling != 1.0 {
            w = w.mul_scalar(self.scaling)?;
        }
        Ok(self.experts.forward(&flat, &inds, &w.astype(x.dtype())?)?.reshape(&dims)?)
    }
}

impl RecurrentMixer for ShortConv {
    /// The last `K - 1` gated inputs.
    const SLOTS: usize = 1;
    fn forward_slots(&self, x: &Array, slots: &mut [Option<Array>], i: usize, valid: Option<&Array>) -> Result<Array> {
        match slots.first_mut() {
            Some(state) => self.forward(x, state, valid, None),
            None => Err(ModelError::Cache(format!("layer {i} (short conv) has no recurrent state slot"))),
        }
    }
    fn forward_packed(&self, x: &Array, slots: &mut [Option<Array>], i: usize, valid: Option<&Array>, g: &crate::batch::Ragged) -> Result<Array> {
        match slots.first_mut() {
            Some(state) => self.forward(x, state, valid, Some(g)),
            None => Err(ModelError::Cache(format!("layer {i} (short conv) has no recurrent state slot"))),
        }
    }
}

type Block = HybridBlock<ShortConv, MoeBlock>;

/// LFM2 / LFM2-MoE causal LM.
pub struct Lfm2Model {
    cfg: Lfm2Config,
    stack: HybridStack<ShortConv, MoeBlock>,
    info: ModelInfo,
    /// KV heads of this rank's cache (all of them unless the load is tensor parallel).
    kv_heads: usize,
}

fn dense_names(vb: &Vb) -> [&'static str; 3] {
    if vb.contains("gate_proj.weight") { ["gate_proj", "up_proj", "down_proj"] } else { ["w1", "w3", "w2"] }
}

impl Lfm2Model {
    /// `model_type`: `lfm2` or `lfm2_moe`.
    pub fn new(weights: &Weights, cfg: Lfm2Config, model_type: &str, eos: Vec<u32>) -> Result<Self> {
        let path = weights.path().to_path_buf();
        let moe = model_type == "lfm2_moe";
        cfg.validate(moe).map_err(|reason| ModelError::MalformedConfig { path: path.clone(), reason })?;
        let is_attn = cfg.attention_layers().expect("validated");
        let (h, d, eps) = (cfg.hidden_size, cfg.head_dim(), cfg.norm_eps);
        let acfg = AttentionConfig { qk_norm: Some(eps), o_name: "out_proj", ..AttentionConfig::new(h, cfg.num_attention_heads, cfg.kv_heads(), d) };
        let rope = cfg.rope().map_err(|reason| ModelError::MalformedConfig { path: weights.path().to_path_buf(), reason })?;
        let root = weights.root();
        let mv = root.pp("model");
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let lv = mv.pp("layers").pp(i);
                let op = if is_attn[i] {
                    Mixer::Attention(Attention::load(&lv.pp("self_attn"), acfg.clone(), rope.clone(), ["q_layernorm", "k_layernorm"])?)
                } else {
                    Mixer::Recurrent(ShortConv::load(&lv.pp("conv"), &cfg)?)
                };
                let fv = lv.pp("feed_forward");
                let ffn = if moe && i >= cfg.num_dense_layers {
                    FeedForward::Experts(MoeBlock::load(&fv, &cfg)?)
                } else {
                    let ff = cfg.dense_ff_dim(moe).expect("validated");
                    FeedForward::Dense(GatedMlp::load_named(&fv, dense_names(&fv), h, ff, Activation::Silu)?)
                };
                Ok(Block {
                    mixer_norm: RmsNorm::load(&lv.pp("operator_norm"), h, eps, 0.0)?,
                    mixer: op,
                    ffn_norm: RmsNorm::load(&lv.pp("ffn_norm"), h, eps, 0.0)?,
                    ffn,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = Embedding::load(&mv.pp("embed_tokens"), cfg.vocab_size, h)?;
        let lm_head = LmHead::load(&root, "model", &embed, cfg.tied(), h, cfg.vocab_size)?;
        let info = ModelInfo::decoder(if moe { "lfm2_moe" } else { "lfm2" }, cfg.vocab_size, h, cfg.num_hidden_layers, cfg.max_position_embeddings, eos, cfg.bos_token_id);
        let norm = RmsNorm::load(&mv.pp("embedding_norm"), h, eps, 0.0)?;
        let kv_heads = crate::layers::parallel::per_rank(&mv, "KV heads", cfg.kv_heads())?;
        Ok(Lfm2Model { stack: HybridStack { embed, layers, norm, lm_head }, cfg, info, kv_heads })
    }

}

impl ModelRuntime for Lfm2Model {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn cache_spec(&self) -> CacheSpec {
        self.stack.cache_spec(LayerKind::Attention { kv_heads: self.kv_heads, head_dim: self.cfg.head_dim() }, 1)
    }
    fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        self.stack.forward(tokens, cache, logits, hidden)
    }
    crate::layers::decoder::hybrid_stack_taps!();
}

/// The registry's constructor (`lfm2` and `lfm2_moe`).
pub(crate) fn load(c: &LoadContext) -> Result<Built> {
    Ok(Built::Lm(Box::new(Lfm2Model::new(c.weights, c.parse()?, c.family.model_type, c.eos.clone())?)))
}

/// An LFM2 / LFM2-MoE config.json. `tiny`: hidden 64, 4 layers (conv, attention, conv,
/// attention), vocab 512 (MoE: 4 experts of 32, top 2, one dense layer). `small`: LFM2-350M's
/// layer (hidden 1024, 16/8 heads, ff 6656 -> 4608) in 8 layers, conv:attention 5:3 (MoE:
/// LFM2-8B-A1B's mix shrunk, 2 dense layers of 4608, then 16 experts of 256, top 4).
fn shape(small: bool, moe: bool) -> Value {
    let c = "conv";
    let (h, heads, kv, vocab, max_pos) = if small { (1024, 16, 8, 32768, 128000) } else { (64, 4, 2, 512, 4096) };
    let types = if small { serde_json::json!([c, c, "full_attention", c, c, "full_attention", c, "full_attention"]) } else { serde_json::json!([c, "full_attention", c, "full_attention"]) };
    let (model_type, arch) = if moe { ("lfm2_moe", "Lfm2MoeForCausalLM") } else { ("lfm2", "Lfm2ForCausalLM") };
    let mut v = serde_json::json!({
        "model_type": model_type, "architectures": [arch],
        "vocab_size": vocab, "hidden_size": h, "num_hidden_layers": if small { 8 } else { 4 }, "num_attention_heads": heads,
        "num_key_value_heads": kv, "max_position_embeddings": max_pos, "norm_eps": 1e-5,
        "conv_bias": false, "conv_L_cache": 3, "rope_theta": 1000000.0, "layer_types": types,
        "tie_word_embeddings": true, "bos_token_id": 486, "eos_token_id": 488
    });
    let extra = match (small, moe) {
        (false, true) => serde_json::json!({"intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": true, "use_expert_bias": true, "num_dense_layers": 1}),
        (false, false) => serde_json::json!({"intermediate_size": 192, "block_dim": 64, "block_ff_dim": 192, "block_multiple_of": 32,
            "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": true}),
        (true, true) => serde_json::json!({"intermediate_size": 4608, "moe_intermediate_size": 256, "num_experts": 16,
            "num_experts_per_tok": 4, "norm_topk_prob": true, "use_expert_bias": true, "num_dense_layers": 2}),
        (true, false) => serde_json::json!({"intermediate_size": 6656, "block_dim": 1024, "block_ff_dim": 6656, "block_multiple_of": 256,
            "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": true}),
    };
    v.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
    v
}

pub(crate) const PRESETS: &[Preset] = &[("tiny", || shape(false, false)), ("small", || shape(true, false))];
pub(crate) const MOE_PRESETS: &[Preset] = &[("tiny", || shape(false, true)), ("small", || shape(true, true))];

#[cfg(test)]
mod tests {
    use super::effective_ff_dim;

    #[test]
    fn ff_dim_rule() {
        assert_eq!(effective_ff_dim(6656, 256, Some(1.0), true), 4608); // LFM2-350M
        assert_eq!(effective_ff_dim(192, 32, Some(1.0), true), 128); // tiny fixture
        assert_eq!(effective_ff_dim(192, 32, None, false), 192);
    }
}
