//! Gemma 4 causal LM: `gemma4_text` (Gemma4ForCausalLM), the text decoder of `gemma4`
//! (Gemma4ForConditionalGeneration, keys under `model.language_model.`) and `gemma4_unified`.
//! Mirrors mlx-lm `models/gemma4_text.py` and HF `models/gemma4/modeling_gemma4.py`.
//!
//! What differs from a plain decoder:
//! - RMSNorm is `x * w` (not Gemma 1-3's `1 + w`); `v_norm` has no scale; attention scale is 1.
//! - Embeddings are scaled by `sqrt(hidden)`; logits are soft-capped (`final_logit_softcapping`).
//! - `layer_types`: sliding layers use `head_dim`, rope θ 1e4 and a rotating cache of
//!   `sliding_window` positions; full layers use `global_head_dim` and "proportional" rope
//!   (θ 1e6, only the first `partial_rotary_factor` of the frequencies rotate).
//! - Per-layer input embeddings (PLE): `embed_tokens_per_layer` plus a projection of the embedded
//!   tokens, gated into each layer's output.
//! - KV sharing: the last `num_kv_shared_layers` layers have no k/v projections and attend over
//!   the K/V of the last non-shared layer of the same type (fetched in the same forward).
//! - `attention_k_eq_v`: full layers have no `v_proj` (V is the un-normed K, with
//!   `num_global_key_value_heads` heads).
//! - `use_double_wide_mlp`: KV-shared layers have a 2x wide MLP.
//! - MoE layers (`enable_moe_block`): a dense MLP plus a top-k routed expert block
//!   (`router.{proj,scale,per_expert_scale}`, fused `experts.gate_up_proj [E, 2I, H]`,
//!   `experts.down_proj [E, H, I]`; mlx-lm's `experts.switch_glu.{gate,up,down}_proj`, float or
//!   MLX-quantized, e.g. `mlx_lm.convert -q` output with its 8-bit `router.proj`), dispatched with
//!   `gather_mm` (`gather_qmm` for packed experts).
//!
//! Caches: flat (rotating for sliding layers) or the kv-paged block pool (`KvCacheMode`; Auto
//! follows `use_block_paged_cache`), both through [`Cache::begin_forward_with`]. KV-shared layers have
//! no storage: they reuse the K/V their anchor fetched earlier in the same forward call.
use super::gemma3::GemmaConfig;
use super::moe::{ExpertLayout, SwitchGlu};
use crate::cache::{Cache, CacheSpec, LayerCache, LayerKind, LayerKv};
use crate::config::default_usize;
use crate::layers::{causal_mask, last_query_mask, mask_window, sdpa, Activation, Embedding, FusedLinear, GatedMlp, Linear, LmHead, RmsNorm, Rope};
use crate::runtime::{check_cache_layers, check_tokens, ForwardOutput, Logits, ModelInfo, ModelRuntime, Rows};
use crate::weights::{Init, Vb, Weights};
use crate::{ModelError, Result};
use mlx_array::{ops, Array, AttentionMask};
use crate::registry::{Built, LoadContext, Preset};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Per-layer overrides as transformers 5 saves them (`per_layer_config`), instead of the hub's
/// `global_head_dim` / `num_global_key_value_heads`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Gemma4LayerOverride {
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
}

/// The decoder settings of a Gemma 4 checkpoint (`config.json`, or its `text_config`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Gemma4Config {
    #[serde(flatten)]
    pub base: GemmaConfig,
    pub global_head_dim: Option<usize>,
    #[serde(default = "default_usize::<262144>")]
    pub vocab_size: usize,
    pub vocab_size_per_layer_input: Option<usize>,
    pub num_global_key_value_heads: Option<usize>,
    pub num_kv_shared_layers: Option<usize>,
    pub hidden_size_per_layer_input: Option<usize>,
    pub rope_theta: Option<f32>,
    pub rope_local_base_freq: Option<f32>,
    pub global_partial_rotary_factor: Option<f32>,
    #[serde(default = "default_usize::<512>")]
    pub sliding_window: usize,
    #[serde(default = "default_usize::<5>")]
    pub sliding_window_pattern: usize,
    #[serde(default)]
    pub attention_k_eq_v: bool,
    #[serde(default)]
    pub use_double_wide_mlp: bool,
    #[serde(default)]
    pub enable_moe_block: bool,
    pub num_experts: Option<usize>,
    pub top_k_experts: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    pub per_layer_config: Option<HashMap<String, Gemma4LayerOverride>>,
    /// Every layer projects only queries and attends over K/V it is given (a `gemma4_assistant`
    /// draft network, [`Gemma4Assistant`]); never read from a config.
    #[serde(skip)]
    pub q_only: bool,
}

crate::config::impl_deref!(Gemma4Config => base: GemmaConfig);

/// Rope of one layer type, resolved from `rope_parameters` (or the hub's flat keys).
#[derive(Debug, Clone, PartialEq)]
struct RopeSpec {
    theta: f32,
    partial: f32,
    proportional: bool,
    factor: f32,
}

impl Gemma4Config {
    /// Parse from the whole `config.json`: the decoder settings come from `text_config` when
    /// present, and a ConditionalGeneration root's top-level `vocab_size` wins (as in mlx-lm).
    pub fn from_root(dir: &Path, root: &Value) -> Result<Self> {
        let mut text = crate::config::text_config(root);
        if root.get("text_config").is_some() {
            if let (Some(v), Some(obj)) = (root.get("vocab_size").cloned(), text.as_object_mut()) {
                if v.is_u64() {
                    obj.insert("vocab_size".into(), v);
                }
            }
        }
        crate::config::parse_checked(dir, &text, Gemma4Config::validate)
    }

    /// `sliding_attention` / `full_attention` per layer; generated from `sliding_window_pattern`
    /// (last layer full) when absent.
    pub fn layer_types(&self) -> Vec<String> {
        self.base.layer_types_or_pattern(self.sliding_window_pattern, true)
    }

    fn is_sliding(&self, i: usize) -> bool {
        self.layer_types()[i] == "sliding_attention"
    }

    fn first_shared(&self) -> usize {
        self.num_hidden_layers - self.num_kv_shared_layers.unwrap_or(0).min(self.num_hidden_layers)
    }

    fn is_kv_shared(&self, i: usize) -> bool {
        let f = self.first_shared();
        self.q_only || (f > 0 && i >= f)
    }

    fn full_override(&self) -> Option<&Gemma4LayerOverride> {
        let pl = self.per_layer_config.as_ref()?;
        let types = self.layer_types();
        (0..self.num_hidden_layers).filter(|&i| types[i] == "full_attention").find_map(|i| pl.get(&i.to_string()))
    }

    /// Head dim of layer `i` (`global_head_dim` on full layers).
    pub fn layer_head_dim(&self, i: usize) -> usize {
        if self.is_sliding(i) {
            return self.head_dim;
        }
        self.global_head_dim.or_else(|| self.full_override().and_then(|o| o.head_dim)).filter(|d| *d > 0).unwrap_or(self.head_dim)
    }

    fn k_eq_v(&self, i: usize) -> bool {
        self.attention_k_eq_v && !self.is_sliding(i)
    }

    /// KV heads of layer `i` (`num_global_key_value_heads` on k_eq_v full layers).
    pub fn layer_kv_heads(&self, i: usize) -> usize {
        if self.k_eq_v(i) {
            if let Some(n) = self.num_global_key_value_heads.or_else(|| self.full_override().and_then(|o| o.num_key_value_heads)) {
                return n;
            }
        }
        self.num_key_value_heads
    }

    /// Per-layer input width (0 = no PLE).
    pub fn ple_dim(&self) -> usize {
        self.hidden_size_per_layer_input.unwrap_or(0)
    }

    /// For each layer, the layer whose K/V it attends over (itself unless KV-shared).
    pub fn kv_sources(&self) -> Vec<usize> {
        let n = self.num_hidden_layers;
        let m = self.first_shared();
        let types = self.layer_types();
        let mut src: Vec<usize> = (0..n).collect();
        if m < n && m > 0 {
            let mut last_of: HashMap<&str, usize> = HashMap::new();
            for (i, t) in types.iter().enumerate().take(m) {
                last_of.insert(t.as_str(), i);
            }
            for (j, s) in src.iter_mut().enumerate().skip(m) {
                // validate() guarantees an anchor of the same type exists.
                *s = last_of[types[j].as_str()];
            }
        }
        src
    }

    fn rope_spec(&self, sliding: bool) -> RopeSpec {
        let key = if sliding { "sliding_attention" } else { "full_attention" };
        let p = self.rope_parameters.as_ref().and_then(|r| r.get(key));
        let num = |k: &str| p.and_then(|p| p.get(k)).and_then(|v| v.as_f64()).map(|v| v as f32);
        match p {
            Some(p) => RopeSpec {
                theta: num("rope_theta").unwrap_or(if sliding { 10_000.0 } else { 1_000_000.0 }),
                partial: num("partial_rotary_factor").unwrap_or(1.0),
                proportional: p.get("rope_type").and_then(|t| t.as_str()) == Some("proportional"),
                factor: num("factor").unwrap_or(1.0),
            },
            None if sliding => RopeSpec { theta: self.rope_local_base_freq.unwrap_or(10_000.0), partial: 1.0, proportional: false, factor: 1.0 },
            None => RopeSpec {
                theta: self.rope_theta.unwrap_or(1_000_000.0),
                partial: self.global_partial_rotary_factor.unwrap_or(0.25),
                proportional: true,
                factor: 1.0,
            },
        }
    }

    /// Checks the config before any tensor is read.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let n = self.num_hidden_layers;
        if self.hidden_size == 0 || n == 0 || self.vocab_size == 0 || self.num_attention_heads == 0 {
            return Err("hidden_size, num_hidden_layers, num_attention_heads and vocab_size must be positive".into());
        }
        let types = self.layer_types();
        self.check_layer_types(&types)?;
        for key in ["sliding_attention", "full_attention"] {
            let t = self.rope_parameters.as_ref().and_then(|r| r.get(key)).and_then(|p| p.get("rope_type")).and_then(|t| t.as_str());
            if let Some(t) = t.filter(|t| !matches!(*t, "default" | "proportional")) {
                return Err(format!("rope_parameters.{key}.rope_type {t:?} is not supported (default and proportional are)"));
            }
        }
        if self.sliding_window == 0 {
            return Err("sliding_window must be positive".into());
        }
        for i in 0..n {
            let (kv, d) = (self.layer_kv_heads(i), self.layer_head_dim(i));
            if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) || d % 2 != 0 {
                return Err(format!("layer {i}: {} heads over {kv} kv heads, head_dim {d} (must divide, even dim)", self.num_attention_heads));
            }
        }
        let m = self.first_shared();
        if m < n {
            if m == 0 {
                return Err("num_kv_shared_layers must leave at least one layer with its own K/V".into());
            }
            for j in m..n {
                if !types[..m].contains(&types[j]) {
                    return Err(format!("KV-shared layer {j} ({}) has no earlier non-shared layer of its type", types[j]));
                }
            }
        }
        self.activation()?;
        if self.enable_moe_block {
            match (self.num_experts, self.top_k_experts, self.moe_intermediate_size) {
                (Some(e), Some(k), Some(i)) if e > 0 && k > 0 && k <= e && i > 0 => {}
                _ => return Err("enable_moe_block needs num_experts, top_k_experts (<= num_experts) and moe_intermediate_size".into()),
            }
        }
        for s in [true, false] {
            let r = self.rope_spec(s);
            let d = if s { self.head_dim } else { (0..n).find(|&i| !self.is_sliding(i)).map_or(self.head_dim, |i| self.layer_head_dim(i)) };
            let rot = (d as f32 * r.partial) as usize;
            if rot == 0 || !rot.is_multiple_of(2) || rot > d {
                return Err(format!("rope rotates {rot} of {d} dims"));
            }
        }
        Ok(())
    }

    fn rope(&self, i: usize) -> Result<Rope> {
        let sliding = self.is_sliding(i);
        let r = self.rope_spec(sliding);
        let d = self.layer_head_dim(i);
        let rot = (d as f32 * r.partial) as usize;
        if r.proportional {
            // mlx-lm ProportionalRoPE: wavelengths factor * θ^(2j / d) for the rotated pairs, and
            // infinite wavelengths (no rotation) for the rest; rope over the full head dim.
            let mut f: Vec<f32> = (0..rot / 2).map(|j| r.factor * r.theta.powf((2 * j) as f32 / d as f32)).collect();
            f.resize(d / 2, f32::INFINITY);
            let mut rope = Rope::new(d, r.theta);
            rope.freqs = Some(Array::from_slice(&f, &[d / 2])?);
            Ok(rope)
        } else {
            Ok(Rope::new(rot, r.theta))
        }
    }
}

#[derive(Clone)]
struct Attn {
    /// `q_proj`, then (own-K/V layers) `k_proj`, then (unless k_eq_v) `v_proj`, as one product
    /// on the GPU.
    proj: FusedLinear,
    /// Own-K/V layers: the K norm (`None` on KV-shared layers, which project only queries).
    k_norm: Option<RmsNorm>,
    /// k_eq_v layers: V is the raw (un-normed) K projection.
    k_eq_v: bool,
    o: Linear,
    q_norm: RmsNorm,
    v_norm: RmsNorm,
    rope: Rope,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
}

crate::layers::layer_arrays!(Attn { proj, k_norm, o, q_norm, v_norm });

impl Attn {
    fn load(vb: &Vb, cfg: &Gemma4Config, i: usize) -> Result<Self> {
        let (h, d, nh, nkv) = (cfg.hidden_size, cfg.layer_head_dim(i), cfg.num_attention_heads, cfg.layer_kv_heads(i));
        let eps = cfg.rms_norm_eps;
        let own = !cfg.is_kv_shared(i);
        let k_eq_v = cfg.k_eq_v(i);
        let mut names = vec!["q_proj"];
        let mut outs = vec![nh * d];
        if own {
            names.push("k_proj");
            outs.push(nkv * d);
            if !k_eq_v {
                names.push("v_proj");
                outs.push(nkv * d);
            }
        }
        Ok(Attn {
            proj: FusedLinear::load_sharded(vb, &names, h, &outs, false)?,
            k_norm: if own { Some(RmsNorm::load(&vb.pp("k_norm"), d, eps, 0.0)?) } else { None },
            k_eq_v,
            o: Linear::load_parallel(&vb.pp("o_proj"), nh * d, h, false, crate::layers::parallel::Shard::Input)?,
            q_norm: RmsNorm::load(&vb.pp("q_norm"), d, eps, 0.0)?,
            v_norm: RmsNorm::unit(eps),
            rope: cfg.rope(i)?,
            // Tensor parallel: this rank's heads.
            n_heads: crate::layers::parallel::per_rank(vb, "attention heads", nh)?,
            n_kv: crate::layers::parallel::per_rank(vb, "KV heads", nkv)?,
            head_dim: d,
        })
    }

    fn own_kv(&self) -> bool {
        self.k_norm.is_some()
    }

    /// `x`: `[B, L, H]`. Own-K/V layers append to `cache` (flat or paged) and return the
    /// fetched K/V; KV-shared layers attend over `shared` (their anchor's fetched K/V). `last`:
    /// only the last position's output is returned (`[B, 1, H]`), and where the mask allows only
    /// it is queried; the K/V of all are cached.
    /// `batch`: the rows of a batch cache (per-row rope offsets and mask, [`crate::batch`]).
    #[allow(clippy::too_many_arguments)]
    fn forward(&self, x: &Array, cache: Option<&mut LayerKv>, shared: Option<&(Array, Array)>, offset: usize, mask: AttentionMask, last: bool, batch: Option<&crate::batch::BatchRows>) -> Result<(Array, (Array, Array))> {
        self.forward_blocks(x, cache, shared, offset, mask, None, last, batch)
    }

    /// [`Self::forward`] where `blocks` (one entry per position of `x`) marks the image soft
    /// tokens that attend to each other both ways under the sliding `mask`
    /// ([`vision_block_mask`]).
    #[allow(clippy::too_many_arguments)]
    fn forward_blocks(&self, x: &Array, cache: Option<&mut LayerKv>, shared: Option<&(Array, Array)>, offset: usize, mask: AttentionMask, blocks: Option<&[i32]>, last: bool, batch: Option<&crate::batch::BatchRows>) -> Result<(Array, (Array, Array))> {
        let (b, l) = (x.dims()[0], x.dims()[1]);
        let want_last = last && l > 1;
        // every query of an image block may see keys after it: no narrowing to the last query
        let narrowed = if want_last && blocks.is_none() { last_query_mask(mask) } else { None };
        let (last, mask) = (narrowed.is_some(), narrowed.unwrap_or(mask));
        let lq = if last { 1 } else { l };
        let heads = |a: &Array, n: usize, rows: i32| a.reshape(&[b, rows, n as i32, self.head_dim as i32]);
        let mut parts = if last {
            let xq = x.slice_axis(1, l as usize - 1, l as usize)?;
            let mut p = vec![self.proj.part(0, &xq)?];
            if self.own_kv() {
                p.push(self.proj.part(1, x)?);
                if !self.k_eq_v {
                    p.push(self.proj.part(2, x)?);
                }
            }
            p.into_iter()
        } else {
            self.proj.forward(x)?.into_iter()
        };
        let q = self.q_norm.forward(&heads(&parts.next().expect("q part"), self.n_heads, lq)?)?;
        let rope = |x: &Array, at: usize| -> Result<Array> {
            match batch {
                Some(r) => self.rope.forward_rows(x, &r.positions(at)?, r.longest()),
                None => self.rope.forward(x, at),
            }
        };
        let q = rope(&q.transpose(&[0, 2, 1, 3])?, if last { offset + l as usize - 1 } else { offset })?;
        let heads = |a: &Array, n: usize| heads(a, n, l);
        let (k, v) = match (&self.k_norm, shared) {
            (Some(k_norm), _) => {
                let raw = heads(&parts.next().expect("k part"), self.n_kv)?;
                let v = if self.k_eq_v { raw.clone() } else { heads(&parts.next().expect("v part"), self.n_kv)? };
                let k = rope(&k_norm.forward(&raw)?.transpose(&[0, 2, 1, 3])?, offset)?;
                let v = self.v_norm.forward(&v)?.transpose(&[0, 2, 1, 3])?;
                let cache = cache.ok_or_else(|| ModelError::Cache("Gemma 4 attention layer without a K/V cache".into()))?;
                cache.update_and_fetch(&k, &v)?
            }
            (None, Some((k, v))) => (k.clone(), v.clone()),
            (None, None) => return Err(ModelError::Cache("KV-shared layer ran before its anchor".into())),
        };
        let block_mask = match (blocks, mask_window(mask)) {
            (None, _) => None,
            (Some(_), _) if batch.is_some() => return Err(ModelError::UnsupportedOption("image blocks attending both ways in a batch cache".into())),
            (Some(bl), Some(w)) => Some(vision_block_mask(bl, k.dims()[2] as usize, w)?),
            (Some(_), None) => return Err(ModelError::InvalidInput("image blocks attend both ways only under a sliding-window mask".into())),
        };
        let batch_mask = batch.map(|r| r.mask(lq as usize, k.dims()[2] as usize, mask_window(mask))).transpose()?;
        let mask = block_mask.as_ref().or(batch_mask.as_ref()).map_or(mask, AttentionMask::Array);
        let o = sdpa(&q, &k, &v, 1.0, mask)?.transpose(&[0, 2, 1, 3])?.reshape(&[b, lq, -1])?;
        let o = if want_last && !last { o.slice_axis(1, l as usize - 1, l as usize)? } else { o };
        Ok((self.o.forward(&o)?, (k, v)))
    }
}

impl Attn {
    /// [`Attn::forward`] of a packed step: each row's tokens at its own positions, against
    /// its own keys.
    fn forward_packed(&self, x: &Array, cache: Option<&mut LayerKv>, shared: Option<&(Array, Array)>, mask: AttentionMask, g: &crate::batch::Ragged) -> Result<(Array, (Array, Array))> {
        let t = x.dims()[1];
        let heads = |a: &Array, n: usize| a.reshape(&[1, t, n as i32, self.head_dim as i32]);
        let rope = |x: &Array, p: usize| self.rope.forward(x, p);
        let mut parts = self.proj.forward(x)?.into_iter();
        let q = self.q_norm.forward(&heads(&parts.next().expect("q part"), self.n_heads)?)?;
        let q = g.rope(&q.transpose(&[0, 2, 1, 3])?, rope)?;
        let (k, v) = match (&self.k_norm, shared) {
            (Some(k_norm), _) => {
                let raw = heads(&parts.next().expect("k part"), self.n_kv)?;
                let v = if self.k_eq_v { raw.clone() } else { heads(&parts.next().expect("v part"), self.n_kv)? };
                let k = g.rope(&k_norm.forward(&raw)?.transpose(&[0, 2, 1, 3])?, rope)?;
                let v = self.v_norm.forward(&v)?.transpose(&[0, 2, 1, 3])?;
                let cache = cache.ok_or_else(|| ModelError::Cache("Gemma 4 attention layer without a K/V cache".into()))?;
                cache.update_and_fetch(&g.to_rows(&k, 2)?, &g.to_rows(&v, 2)?)?
            }
            (None, Some((k, v))) => (k.clone(), v.clone()),
            (None, None) => return Err(ModelError::Cache("KV-shared layer ran before its anchor".into())),
        };
        let o = g.attend(&q, &k, &v, 1.0, mask_window(mask))?.transpose(&[0, 2, 1, 3])?.reshape(&[1, t, -1])?;
        Ok((self.o.forward(&o)?, (k, v)))
    }
}

/// The sliding-window mask of `blocks.len()` queries over `k` keys (the queries being the last
/// of the keys) with image soft tokens attending both ways, as transformers builds it for
/// `text_config.use_bidirectional_attention == "vision"`: query position `p` sees key position
/// `s` when `s > p - window` and either `s <= p` or both belong to the same block. `blocks`:
/// each query's block (one id per run of consecutive image soft tokens), -1 for every other
/// token. Boolean `[L, K]`, true = attend.
pub(crate) fn vision_block_mask(blocks: &[i32], k: usize, window: usize) -> Result<Array> {
    let l = blocks.len();
    let first = k.checked_sub(l).ok_or_else(|| ModelError::InvalidInput(format!("{l} queries over {k} keys")))?;
    let mut m = vec![false; l * k];
    for (i, &bq) in blocks.iter().enumerate() {
        let (p, row) = (first + i, &mut m[i * k..(i + 1) * k]);
        row[(p + 1).saturating_sub(window)..=p].fill(true);
        if bq >= 0 {
            let later = blocks[i + 1..].iter().take_while(|&&b| b == bq).count();
            row[p + 1..=p + later].fill(true);
        }
    }
    Ok(Array::from_slice(&m, &[l, k])?)
}

/// Top-k routed experts (Gemma 4's router: RMS-normed input, softmax over the top k, scaled per
/// expert) over the shared [`SwitchGlu`].
#[derive(Clone)]
struct Experts {
    proj: Linear,
    /// `router.scale * hidden^-0.5`, the router's RMSNorm weight.
    router_norm: Array,
    per_expert_scale: Array,
    experts: SwitchGlu,
    top_k: usize,
    n_experts: usize,
    eps: f32,
}

crate::layers::layer_arrays!(Experts { proj, router_norm, per_expert_scale, experts });

impl Experts {
    fn load(vb: &Vb, cfg: &Gemma4Config, act: Activation) -> Result<Self> {
        let h = cfg.hidden_size;
        let (e, k, i) = (cfg.num_experts.unwrap(), cfg.top_k_experts.unwrap(), cfg.moe_intermediate_size.unwrap());
        let r = vb.pp("router");
        let scale = r.get_init("scale", &[h], Init::normal(1.0, 0.1))?;
        let router_norm = scale.mul_scalar((h as f32).powf(-0.5))?;
        let ex = vb.pp("experts");
        Ok(Experts {
            proj: Linear::load(&r.pp("proj"), h, e, false)?,
            router_norm,
            per_expert_scale: r.get_init("per_expert_scale", &[e], Init::normal(1.0, 0.1))?,
            // HF's fused `experts.{gate_up,down}_proj`, or mlx-lm's split (and possibly
            // quantized) `experts.switch_glu.{gate,up,down}_proj`.
            experts: if ex.contains("switch_glu.gate_proj.weight") {
                SwitchGlu::load_switch_mlp(&ex.pp("switch_glu"), e, h, i, act)?
            } else {
                SwitchGlu::load(&ex, e, h, i, ["gate_proj", "up_proj", "down_proj"], act, ExpertLayout::Fused)?
            },
            top_k: k,
            n_experts: e,
            eps: cfg.rms_norm_eps,
        })
    }

    /// `route`: the hidden state the router sees; `x`: the (pre-normed) expert input.
    fn forward(&self, route: &Array, x: &Array) -> Result<Array> {
        let (e, k) = (self.n_experts, self.top_k);
        let scores = self.proj.forward(&route.rms_norm(Some(&self.router_norm), self.eps)?)?;
        let idx = mlx_array::grad::stop_gradient(&scores.argpartition((e - k) as i32, -1)?.slice_axis(-1, e - k, e)?)?;
        let w = scores.take_along_axis(&idx, -1)?.softmax(-1, true)?.mul(&self.per_expert_scale.take(&idx, 0)?)?;
        let shape = x.dims();
        let h = shape[shape.len() - 1];
        let (xs, idx, w) = (x.reshape(&[-1, h])?, idx.reshape(&[-1, k as i32])?, w.reshape(&[-1, k as i32])?);
        Ok(self.experts.forward(&xs, &idx, &w)?.reshape(&shape)?)
    }
}

#[derive(Clone)]
struct Moe {
    experts: Experts,
    pre_norm_2: RmsNorm,
    post_norm_1: RmsNorm,
    post_norm_2: RmsNorm,
}

crate::layers::layer_arrays!(Moe { experts, pre_norm_2, post_norm_1, post_norm_2 });

#[derive(Clone)]
struct Ple {
    gate: Linear,
    proj: Linear,
    norm: RmsNorm,
}

crate::layers::layer_arrays!(Ple { gate, proj, norm });

#[derive(Clone)]
struct Block {
    input_norm: RmsNorm,
    attn: Attn,
    post_attn_norm: RmsNorm,
    pre_ffn_norm: RmsNorm,
    mlp: GatedMlp,
    post_ffn_norm: RmsNorm,
    moe: Option<Moe>,
    ple: Option<Ple>,
    layer_scalar: Array,
    act: Activation,
}

crate::layers::layer_arrays!(Block { input_norm, attn, post_attn_norm, pre_ffn_norm, mlp, post_ffn_norm, moe, ple, layer_scalar });

/// What a checkpointed layer's inputs are besides its hidden states
/// ([`Gemma4Model::hidden_checkpointed`]).
#[derive(Clone)]
struct CheckpointCtx {
    mask: AttentionMask<'static>,
    /// The layer's per-layer input follows the hidden states.
    ple: bool,
    /// The layer's K/V are returned too (KV-shared layers attend over them).
    anchor: bool,
}

impl Block {
    fn load(vb: &Vb, cfg: &Gemma4Config, i: usize) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let act = Activation::parse(&cfg.hidden_activation).expect("validated");
        let norm = |n: &str| RmsNorm::load(&vb.pp(n), h, eps, 0.0);
        let wide = cfg.use_double_wide_mlp && cfg.is_kv_shared(i);
        let inter = cfg.intermediate_size * if wide { 2 } else { 1 };
        let moe = if cfg.enable_moe_block {
            Some(Moe {
                experts: Experts::load(vb, cfg, act)?,
                pre_norm_2: norm("pre_feedforward_layernorm_2")?,
                post_norm_1: norm("post_feedforward_layernorm_1")?,
                post_norm_2: norm("post_feedforward_layernorm_2")?,
            })
        } else {
            None
        };
        let p = cfg.ple_dim();
        let ple = if p > 0 {
            Some(Ple {
                gate: Linear::load(&vb.pp("per_layer_input_gate"), h, p, false)?,
                proj: Linear::load(&vb.pp("per_layer_projection"), p, h, false)?,
                norm: norm("post_per_layer_input_norm")?,
            })
        } else {
            None
        };
        Ok(Block {
            input_norm: norm("input_layernorm")?,
            attn: Attn::load(&vb.pp("self_attn"), cfg, i)?,
            post_attn_norm: norm("post_attention_layernorm")?,
            pre_ffn_norm: norm("pre_feedforward_layernorm")?,
            mlp: GatedMlp::load(&vb.pp("mlp"), h, inter, act)?,
            post_ffn_norm: norm("post_feedforward_layernorm")?,
            moe,
            ple,
            layer_scalar: vb.get_init("layer_scalar", &[1], Init::normal(1.0, 0.0))?,
            act,
        })
    }

    fn ffn(&self, h: &Array) -> Result<Array> {
        let dense = self.mlp.forward(&self.pre_ffn_norm.forward(h)?)?;
        match &self.moe {
            None => Ok(dense),
            Some(m) => {
                let h1 = m.post_norm_1.forward(&dense)?;
                let h2 = m.post_norm_2.forward(&m.experts.forward(h, &m.pre_norm_2.forward(h)?)?)?;
                Ok(h1.add(&h2)?)
            }
        }
    }

    /// Layer `i`'s slice `[B, L, P]` of the per-layer inputs `[B, L, layers, P]` (PLE layers).
    fn per_layer_input(&self, ple: Option<&Array>, i: usize) -> Result<Option<Array>> {
        match (&self.ple, ple) {
            (Some(_), Some(inputs)) => Ok(Some(inputs.slice_axis(2, i, i + 1)?.squeeze(&[2])?)),
            _ => Ok(None),
        }
    }

    /// The layer's output from `h` (the residual stream after attention): the feed-forward
    /// residual, the gated per-layer input `pli` (`[B, L, P]`, PLE layers) and the layer scalar.
    fn finish(&self, h: &Array, pli: Option<&Array>) -> Result<Array> {
        let mut y = h.add(&self.post_ffn_norm.forward(&self.ffn(h)?)?)?;
        if let (Some(p), Some(pli)) = (&self.ple, pli) {
            let g = self.act.gated(&p.gate.forward(&y)?, pli)?;
            y = y.add(&p.norm.forward(&p.proj.forward(&g)?)?)?;
        }
        Ok(y.mul(&self.layer_scalar)?)
    }

    /// The whole layer over every position from 0, keeping no cache state: `xs` is the hidden
    /// states, then the per-layer input when `c.ple`, then (KV-shared layers) the anchor's K
    /// and V. Returns the output, and the layer's K and V when `c.anchor`.
    fn forward_checkpointed(&self, xs: &[Array], c: &CheckpointCtx) -> Result<Vec<Array>> {
        let x = &xs[0];
        let pli = if c.ple { xs.get(1) } else { None };
        let h = self.input_norm.forward(x)?;
        let (a, (k, v)) = if self.attn.own_kv() {
            let mut scratch = crate::kv::KvCache::new(None);
            self.attn.forward(&h, Some(&mut LayerKv::Flat(&mut scratch)), None, 0, c.mask, false, None)?
        } else {
            let at = 1 + c.ple as usize;
            let shared = match xs.get(at..at + 2) {
                Some([k, v]) => (k.clone(), v.clone()),
                _ => return Err(ModelError::InvalidInput("a checkpointed KV-shared layer without its anchor's K/V".into())),
            };
            self.attn.forward(&h, None, Some(&shared), 0, c.mask, false, None)?
        };
        let h = x.add(&self.post_attn_norm.forward(&a)?)?;
        let y = self.finish(&h, pli)?;
        Ok(if c.anchor { vec![y, k, v] } else { vec![y] })
    }
}

/// The loaded network (absent on a config-only [`Gemma4Model`]).
struct Net {
    embed: Embedding,
    embed_per_layer: Option<Embedding>,
    per_layer_model_projection: Option<Linear>,
    per_layer_projection_norm: Option<RmsNorm>,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: LmHead,
}

/// Gemma 4 causal LM (dense or MoE, with or without PLE and KV sharing).
pub struct Gemma4Model {
    cfg: Gemma4Config,
    info: ModelInfo,
    kv_src: Vec<usize>,
    net: Option<Net>,
    /// Tensor-parallel ranks (1 without a group): each rank's cache holds `1 / N` of the KV heads.
    tp_size: usize,
}


impl Gemma4Model {
    /// A model from its config only: it reports its info and cache layout, but every forward
    /// call fails with "Model not initialized" (use [`crate::load_model`]).
    pub fn from_config(cfg: Gemma4Config, eos: Vec<u32>) -> Result<Self> {
        cfg.validate().map_err(|reason| ModelError::MalformedConfig { path: PathBuf::from("<config>"), reason })?;
        let info = ModelInfo::decoder("gemma4", cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.max_position_embeddings, eos, cfg.bos_token_id);
        Ok(Gemma4Model { kv_src: cfg.kv_sources(), cfg, info, net: None, tp_size: 1 })
    }

    /// Build from loaded weights (speculative decoding, with any draft, is the
    /// `mlx-speculative` crate's).
    pub fn new(weights: &Weights, cfg: Gemma4Config, eos: Vec<u32>) -> Result<Self> {
        let mut m = Self::from_config(cfg, eos).map_err(|e| match e {
            ModelError::MalformedConfig { reason, .. } => ModelError::MalformedConfig { path: weights.path().to_path_buf(), reason },
            e => e,
        })?;
        m.tp_size = weights.tensor_parallel().map_or(1, |g| g.size());
        let cfg = &m.cfg;
        let root = weights.root();
        let vb = root.pp(weights.decoder_prefix());
        let (h, n, p) = (cfg.hidden_size, cfg.num_hidden_layers, cfg.ple_dim());
        let embed = Embedding::load(&vb.pp("embed_tokens"), cfg.vocab_size, h)?;
        let (embed_per_layer, per_layer_model_projection, per_layer_projection_norm) = if p > 0 {
            let pv = cfg.vocab_size_per_layer_input.unwrap_or(cfg.vocab_size);
            (
                Some(Embedding::load(&vb.pp("embed_tokens_per_layer"), pv, n * p)?),
                Some(Linear::load(&vb.pp("per_layer_model_projection"), h, n * p, false)?),
                Some(RmsNorm::load(&vb.pp("per_layer_projection_norm"), p, cfg.rms_norm_eps, 0.0)?),
            )
        } else {
            (None, None, None)
        };
        let layers = (0..n).map(|i| Block::load(&vb.pp("layers").pp(i), cfg, i)).collect::<Result<Vec<_>>>()?;
        let lm_head = LmHead::load(&root, weights.decoder_prefix(), &embed, cfg.tie_word_embeddings, h, cfg.vocab_size)?.with_softcap(cfg.final_logit_softcapping);
        m.net = Some(Net {
            norm: RmsNorm::load(&vb.pp("norm"), h, cfg.rms_norm_eps, 0.0)?,
            embed,
            embed_per_layer,
            per_layer_model_projection,
            per_layer_projection_norm,
            layers,
            lm_head,
        });
        Ok(m)
    }

    pub fn config(&self) -> &Gemma4Config {
        &self.cfg
    }

    /// The scaled input embeddings of `tokens` (`[B, L]` ids → `[B, L, H]`), as the first layer
    /// sees them (a `gemma4_assistant` draft's token input).
    pub fn embed_scaled(&self, tokens: &Array) -> Result<Array> {
        let net = self.net.as_ref().ok_or_else(|| ModelError::Cache("Gemma 4 model built from its config only has no weights".into()))?;
        check_tokens(tokens)?;
        Ok(net.embed.forward(tokens)?.mul_scalar((self.cfg.hidden_size as f32).sqrt())?)
    }

    /// The layers whose K/V a `gemma4_assistant` draft attends over: the last layer with its own
    /// K/V of each type, `(sliding, full)`.
    pub fn assistant_kv_layers(&self) -> Result<(usize, usize)> {
        let last_own = |sliding: bool| (0..self.cfg.num_hidden_layers).rev().find(|&i| !self.cfg.is_kv_shared(i) && self.cfg.is_sliding(i) == sliding);
        match (last_own(true), last_own(false)) {
            (Some(s), Some(f)) => Ok((s, f)),
            _ => Err(ModelError::UnsupportedOption("Gemma 4 assistant drafting needs a target with both sliding and full attention layers".into())),
        }
    }

    /// The K/V of [`Gemma4Model::assistant_kv_layers`] in a flat (not paged) `cache`, in temporal
    /// order: `(sliding, full)`, each `(keys, values)` `[B, kv_heads, T, D]`. The sliding layer
    /// gives its last `sliding_window` held positions, the full layer every position.
    pub fn assistant_kv(&self, cache: &mut Cache) -> Result<((Array, Array), (Array, Array))> {
        if cache.is_paged() {
            return Err(ModelError::UnsupportedOption("Gemma 4 assistant drafting reads a flat cache, not a paged one".into()));
        }
        let (s, f) = self.assistant_kv_layers()?;
        let window = self.cfg.sliding_window;
        let mut read = |i: usize, keep: Option<usize>| -> Result<(Array, Array)> {
            let kv = cache.kv(i)?;
            let off = kv.offset();
            let n = keep.map_or(off, |w| kv.stored().min(w));
            kv.span(off - n, off)?.ok_or_else(|| ModelError::Cache(format!("layer {i}: the cache holds no K/V for the assistant to read")))
        };
        Ok((read(s, Some(window))?, read(f, None)?))
    }
    /// [`ModelRuntime::forward`] over input embeddings `embeds` `[B, L, H]` (the scaled token
    /// embeddings with media soft tokens merged in, [`super::gemma4_media::Gemma4Media::merge`]);
    /// `tokens` `[B, L]` feed only the per-layer inputs (media placeholders as the pad id).
    pub fn forward_embeddings(&self, tokens: &Array, embeds: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        self.forward_embeddings_blocks(tokens, embeds, None, cache, logits, hidden)
    }

    /// [`Self::forward_embeddings`] with image soft tokens attending to each other both ways in
    /// the sliding layers (`use_bidirectional_attention == "vision"`): `blocks` gives each of
    /// the `L` positions its image block (one id per run of consecutive image soft tokens) or
    /// -1 (`vision_block_mask`); full-attention layers stay causal.
    pub fn forward_embeddings_blocks(&self, tokens: &Array, embeds: &Array, blocks: Option<&[i32]>, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        let net = self.net.as_ref().ok_or_else(|| ModelError::InvalidInput("Model not initialized (weights not loaded)".into()))?;
        if let Some(b) = blocks {
            if b.len() != tokens.dims()[1] as usize || tokens.dims()[0] != 1 {
                return Err(ModelError::InvalidInput(format!("{} image-block ids for tokens {:?}", b.len(), tokens.shape())));
            }
        }
        let (h, _) = self.hidden(net, tokens, Some(embeds), blocks, cache, Rows::of(logits, hidden), &[])?;
        net.lm_head.output(h, logits, hidden)
    }

    /// Whether weights are loaded (false for [`Gemma4Model::from_config`]).
    pub fn is_initialized(&self) -> bool {
        self.net.is_some()
    }

    /// PLE inputs `[B, L, layers, P]` from the ids and the scaled embeddings.
    fn per_layer_inputs(&self, net: &Net, tokens: &Array, h: &Array) -> Result<Option<Array>> {
        let (Some(emb), Some(proj), Some(norm)) = (&net.embed_per_layer, &net.per_layer_model_projection, &net.per_layer_projection_norm) else {
            return Ok(None);
        };
        let (n, p) = (self.cfg.num_hidden_layers as i32, self.cfg.ple_dim() as i32);
        let (b, l) = (tokens.dims()[0], tokens.dims()[1]);
        let pv = emb.rows();
        // Ids outside the per-layer vocabulary read row 0 (as HF masks them).
        let ids = if pv < self.cfg.vocab_size {
            let bound = Array::scalar_as(pv as f32, tokens.dtype())?;
            let ok = tokens.lt(&bound)?;
            ops::where_(&ok, tokens, &Array::zeros(&[1], tokens.dtype())?)?
        } else {
            tokens.clone()
        };
        let tok = emb.forward(&ids)?.mul_scalar((p as f32).sqrt())?.reshape(&[b, l, n, p])?;
        let pr = proj.forward(h)?.mul_scalar((self.cfg.hidden_size as f32).powf(-0.5))?.reshape(&[b, l, n, p])?;
        let pr = norm.forward(&pr)?;
        Ok(Some(pr.add(&tok)?.mul_scalar(std::f32::consts::FRAC_1_SQRT_2)?))
    }

    /// Final-normed hidden states for the `rows` the caller needs: every position, only the
    /// last one (`[B, 1, H]`), or none (a prefill chunk: only the caches matter).
    ///
    /// Past the attention of the last layer that writes a cache (the last layer, or the last
    /// before the KV-shared ones, which write none) only the rows the caller reads are computed:
    /// the last position for `Rows::Last` (its query attends over the full K/V), nothing at all
    /// for `Rows::None`. mlx-lm gets the same saving by evaluating only the caches of the
    /// prompt's leading tokens.
    ///
    /// `embeds`: input embeddings `[B, L, H]` to use instead of the scaled token embeddings
    /// (media soft tokens merged in, [`super::gemma4_media`]); `tokens` then only feed the
    /// per-layer inputs, and a paged cache neither reuses nor shares blocks for them.
    /// `taps`: layers whose residual stream (after the layer scalar) is returned too; with taps
    /// every position is computed ([`ModelRuntime::forward_taps`]).
    /// `blocks`: image blocks attending both ways in sliding layers ([`Self::forward_embeddings_blocks`]).
    #[allow(clippy::too_many_arguments)]
    fn hidden(&self, net: &Net, tokens: &Array, embeds: Option<&Array>, blocks: Option<&[i32]>, cache: &mut Cache, rows: Rows, taps: &[usize]) -> Result<(Array, Vec<Array>)> {
        let rows = if taps.is_empty() { rows } else { Rows::All };
        let allow_prefix_skip = rows != Rows::All && embeds.is_none();
        check_tokens(tokens)?;
        if let Some(e) = embeds {
            let (t, h) = (tokens.dims(), self.cfg.hidden_size as i32);
            if e.ndim() != 3 || e.dims()[..2] != t[..2] || e.dims()[2] != h {
                return Err(ModelError::InvalidInput(format!("input embeddings {:?} for tokens {:?} (hidden {h})", e.shape(), tokens.shape())));
            }
        }
        let n = self.cfg.num_hidden_layers;
        check_cache_layers(cache, n)?;
        crate::runtime::check_taps(taps, n)?;
        let mut tapped = Vec::with_capacity(taps.len());
        for (i, &src) in self.kv_src.iter().enumerate() {
            let ok = match &cache.layers[i] {
                LayerCache::Kv(_) => src == i,
                LayerCache::Shared { anchor } => src != i && *anchor == src,
                LayerCache::Recurrent(_) => false,
            };
            if !ok {
                return Err(ModelError::Cache(format!("layer {i}: cache layout does not match the model's cache_spec")));
            }
        }
        if cache.gradient_checkpointing() {
            if !taps.is_empty() {
                return Err(ModelError::UnsupportedOption("gradient checkpointing: residual-stream taps".into()));
            }
            if blocks.is_some() {
                return Err(ModelError::UnsupportedOption("gradient checkpointing: image blocks attending both ways".into()));
            }
            crate::layers::decoder::check_checkpointed(cache, rows)?;
            return Ok((self.hidden_checkpointed(net, tokens, embeds)?, tapped));
        }
        // Paged caches may serve a prefix of `tokens` from the block pool: compute the rest.
        let (mut kvs, skipped) = cache.begin_forward_with(tokens, allow_prefix_skip)?;
        let batch = kvs.batch().filter(|r| !r.uniform());
        let total = tokens.dims()[1] as usize;
        let tokens = if skipped > 0 { tokens.slice_axis(1, skipped, total)? } else { tokens.clone() };
        let tokens = &tokens;
        let l = total - skipped;
        let mut blocks = blocks.map(|b| &b[skipped..]);
        let mut x = match embeds {
            Some(e) if skipped > 0 => e.slice_axis(1, skipped, total)?,
            Some(e) => e.clone(),
            None => net.embed.forward(tokens)?.mul_scalar((self.cfg.hidden_size as f32).sqrt())?,
        };
        let mut ple = self.per_layer_inputs(net, tokens, &x)?;
        let (mut full_mask, mut sliding_mask) = (causal_mask(l, None), causal_mask(l, Some(self.cfg.sliding_window)));
        let mut fetched: Vec<Option<(Array, Array)>> = vec![None; n];
        let mut offset = 0;
        // The last layer that writes a cache: past its mixer only the rows the caller reads matter.
        let last_own = if self.cfg.is_kv_shared(n - 1) { self.cfg.first_shared() - 1 } else { n - 1 };
        // A packed step ([`crate::batch::Ragged`]): past the cut, one token a row.
        let mut ragged = kvs.batch().and_then(|r| r.ragged()).cloned();
        for (i, layer) in net.layers.iter().enumerate() {
            let mask = if self.cfg.is_sliding(i) { sliding_mask } else { full_mask };
            let layer_blocks = if self.cfg.is_sliding(i) { blocks } else { None };
            let h = layer.input_norm.forward(&x)?;
            // Past the last cache-writing layer only the last position is read: query just it.
            let last_only = ragged.is_none() && i == last_own && rows.query_last_only(x.dim(1)?);
            let (a, kv) = if layer.attn.own_kv() {
                let mut c = kvs.layer(i)?;
                // Every layer of a sequence is at the same position (shared layers: the anchor's).
                offset = c.offset();
                match &ragged {
                    Some(g) => layer.attn.forward_packed(&h, Some(&mut c), None, mask, g)?,
                    None => layer.attn.forward_blocks(&h, Some(&mut c), None, offset, mask, layer_blocks, last_only, batch)?,
                }
            } else {
                match &ragged {
                    Some(g) => layer.attn.forward_packed(&h, None, fetched[self.kv_src[i]].as_ref(), mask, g)?,
                    None => layer.attn.forward_blocks(&h, None, fetched[self.kv_src[i]].as_ref(), offset, mask, layer_blocks, last_only, batch)?,
                }
            };
            fetched[i] = Some(kv);
            let mut h = Rows::residual(&x, last_only)?.add(&layer.post_attn_norm.forward(&a)?)?;
            if let (true, Some(g)) = (i == last_own, ragged.as_ref()) {
                match rows {
                    Rows::None => break,
                    // each row's last token (and its per-layer inputs) goes on
                    Rows::Last => {
                        h = g.last_tokens(&h)?;
                        ple = ple.map(|p| g.last_tokens(&p)).transpose()?;
                        ragged = Some(g.last_only());
                    }
                    Rows::All => {}
                }
            } else if i == last_own {
                if !rows.cut(&mut h)? {
                    break;
                }
                if h.dim(1)? < l {
                    // only the last position goes on: its per-layer inputs, masks and rope offset
                    ple = ple.map(|p| p.slice_axis(1, l - 1, l)).transpose()?;
                    (full_mask, sliding_mask) = (causal_mask(1, None), causal_mask(1, Some(self.cfg.sliding_window)));
                    blocks = None; // one query at the end: no key after it to see
                    offset += l - 1; // the one query left sits at the last position
                }
            }
            let pli = layer.per_layer_input(ple.as_ref(), i)?;
            x = layer.finish(&h, pli.as_ref())?;
            if taps.contains(&i) {
                tapped.push(x.clone());
            }
        }
        kvs.finish()?;
        // a packed step cut to each row's last token: [B, 1, H]
        let x = if ragged.is_some() && rows == Rows::Last { x.swap_axes(0, 1)? } else { x };
        Ok((net.norm.forward(&x)?, tapped))
    }

    /// [`Gemma4Model::hidden`] with every layer under [`mlx_array::grad::checkpoint`]
    /// ([`Cache::set_gradient_checkpointing`]): every position from 0, no cache written. A
    /// layer's checkpoint inputs are its hidden states, its slice of the per-layer inputs and,
    /// for a KV-shared layer, the K/V its anchor's checkpoint returned, so gradients reach the
    /// PLE projection and the anchor through them.
    fn hidden_checkpointed(&self, net: &Net, tokens: &Array, embeds: Option<&Array>) -> Result<Array> {
        let l = tokens.dims()[1] as usize;
        let mut x = match embeds {
            Some(e) => e.clone(),
            None => net.embed.forward(tokens)?.mul_scalar((self.cfg.hidden_size as f32).sqrt())?,
        };
        let ple = self.per_layer_inputs(net, tokens, &x)?;
        let masks = crate::layers::decoder::Masks::new(l, Some(self.cfg.sliding_window));
        let mut fetched: Vec<Option<(Array, Array)>> = vec![None; net.layers.len()];
        for (i, layer) in net.layers.iter().enumerate() {
            let mut xs = vec![x];
            let pli = layer.per_layer_input(ple.as_ref(), i)?;
            let ctx = CheckpointCtx {
                mask: if self.cfg.is_sliding(i) { masks.sliding } else { masks.full },
                ple: pli.is_some(),
                anchor: layer.attn.own_kv() && self.kv_src.iter().enumerate().any(|(j, &s)| s == i && j != i),
            };
            xs.extend(pli);
            if !layer.attn.own_kv() {
                let (k, v) = fetched[self.kv_src[i]].clone().ok_or_else(|| ModelError::Cache("KV-shared layer ran before its anchor".into()))?;
                xs.extend([k, v]);
            }
            let mut out = crate::layers::decoder::checkpoint_layer_with(layer, &xs, &ctx, |l, xs, c| l.forward_checkpointed(xs, c))?.into_iter();
            x = out.next().ok_or_else(|| ModelError::InvalidInput("the checkpointed layer returned no output".into()))?;
            if let (Some(k), Some(v)) = (out.next(), out.next()) {
                fetched[i] = Some((k, v));
            }
        }
        net.norm.forward(&x)
    }
}

impl ModelRuntime for Gemma4Model {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn cache_spec(&self) -> CacheSpec {
        let layers = (0..self.cfg.num_hidden_layers)
            .map(|i| {
                let (kv_heads, head_dim) = (self.cfg.layer_kv_heads(i) / self.tp_size, self.cfg.layer_head_dim(i));
                if self.cfg.is_kv_shared(i) {
                    LayerKind::SharedKv { anchor: self.kv_src[i] }
                } else if self.cfg.is_sliding(i) {
                    LayerKind::SlidingAttention { kv_heads, head_dim, window: self.cfg.sliding_window }
                } else {
                    LayerKind::Attention { kv_heads, head_dim }
                }
            })
            .collect();
        CacheSpec { layers }
    }
    fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        let net = self.net.as_ref().ok_or_else(|| {
            ModelError::InvalidInput("Model not initialized (weights not loaded): a Gemma4Model built with from_config cannot run; load the checkpoint with load_model".into())
        })?;
        // Calls that need every position's output must not skip a cached prefix.
        let rows = Rows::of(logits, hidden);
        let (h, _) = self.hidden(net, tokens, None, None, cache, rows, &[])?;
        net.lm_head.output(h, logits, hidden)
    }
    fn forward_taps(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool, taps: &[usize]) -> Result<(ForwardOutput, Vec<Array>)> {
        let net = self.net.as_ref().ok_or_else(|| ModelError::InvalidInput("Model not initialized (weights not loaded)".into()))?;
        let (h, t) = self.hidden(net, tokens, None, None, cache, Rows::All, taps)?;
        Ok((net.lm_head.output(h, logits, hidden)?, t))
    }

    fn as_gemma4(&self) -> Option<&Gemma4Model> {
        Some(self)
    }
}

/// The registry's constructor.
pub(crate) fn load(c: &LoadContext) -> Result<Built> {
    let cfg = Gemma4Config::from_root(c.dir, c.config)?;
    Ok(Built::Lm(Box::new(Gemma4Model::new(c.weights, cfg, c.eos.clone())?)))
}

/// A Gemma 4 text config.json. Every setting whose default differs between transformers and
/// mlx-lm is spelled out (mlx-lm defaults `num_kv_shared_layers` to 20,
/// `hidden_size_per_layer_input` to 256, `global_head_dim` to 512), so both read the same network.
fn shape(h: usize, inter: usize, heads: usize, d: usize, global_d: usize, vocab: usize, ple: usize, window: usize, max_pos: usize) -> Value {
    let (s, f) = ("sliding_attention", "full_attention");
    serde_json::json!({
        "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"],
        "hidden_size": h, "num_hidden_layers": if h > 64 { 8 } else { 6 }, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": d, "global_head_dim": global_d,
        "vocab_size": vocab, "vocab_size_per_layer_input": vocab, "hidden_size_per_layer_input": ple,
        "num_kv_shared_layers": 2, "use_double_wide_mlp": true, "attention_k_eq_v": false, "sliding_window": window,
        "layer_types": if h > 64 { serde_json::json!([s, s, s, f, s, s, s, f]) } else { serde_json::json!([s, s, f, s, s, f]) },
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}
        },
        "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "max_position_embeddings": max_pos,
        "tie_word_embeddings": true, "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 486, "eos_token_id": 488
    })
}

/// `tiny`: hidden 64, 6 layers (2 sliding + 1 full, twice; window 16), PLE 16, the last 2 layers
/// KV-shared with double-wide MLPs, vocab 512. `small` (E2B-style): hidden 1024, sliding (head
/// 128, window 512) and global (head 256, proportional rope) layers 3:1, PLE 64.
pub(crate) const PRESETS: &[Preset] = &[
    ("tiny", || shape(64, 128, 4, 16, 32, 512, 16, 16, 4096)),
    ("small", || shape(1024, 3072, 8, 128, 256, 32768, 64, 512, 131072)),
];

/// A `gemma4_assistant` config.json: the draft network's decoder settings (`text_config`) and
/// the hidden size of the target it drafts for.
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma4AssistantConfig {
    pub backbone_hidden_size: usize,
    #[serde(default)]
    pub use_ordered_embeddings: bool,
    pub text_config: Value,
}

/// Google's Gemma 4 assistant draft network (`Gemma4AssistantForCausalLM`): `pre_projection`
/// of [target token embedding, previous hidden state] to its own width, layers that project
/// only queries and attend over the target's K/V of its last own-K/V sliding and full layers,
/// the final norm, the tied head (as transformers 5.17, without a logit soft-cap), and
/// `post_projection` back to the target's width for the next draft step.
pub struct Gemma4Assistant {
    cfg: Gemma4Config,
    backbone: usize,
    pre: Linear,
    post: Linear,
    layers: Vec<Block>,
    norm: RmsNorm,
    head: LmHead,
}

impl Gemma4Assistant {
    /// Load the checkpoint in `dir` (floats converted to `float_dtype` when given).
    pub fn load(dir: &Path, float_dtype: Option<mlx_array::DType>) -> Result<Self> {
        let text = std::fs::read_to_string(dir.join("config.json")).map_err(|_| ModelError::ConfigNotFound(dir.to_path_buf()))?;
        let root: Value = serde_json::from_str(&text).map_err(|e| ModelError::MalformedConfig { path: dir.to_path_buf(), reason: e.to_string() })?;
        let a: Gemma4AssistantConfig = crate::config::parse_checked(dir, &root, |a: &Gemma4AssistantConfig| {
            if a.use_ordered_embeddings {
                return Err("use_ordered_embeddings (a centroid-masked head) is not supported".into());
            }
            if a.backbone_hidden_size == 0 {
                return Err("backbone_hidden_size must be positive".into());
            }
            Ok(())
        })?;
        let mut cfg: Gemma4Config = crate::config::parse_checked(dir, &a.text_config, |c: &Gemma4Config| {
            if c.hidden_size == 0 || c.num_hidden_layers == 0 || c.vocab_size == 0 || c.num_attention_heads == 0 {
                return Err("hidden_size, num_hidden_layers, num_attention_heads and vocab_size must be positive".into());
            }
            if c.ple_dim() != 0 || c.enable_moe_block || c.use_double_wide_mlp {
                return Err("an assistant has no per-layer inputs, MoE blocks or double-wide MLPs".into());
            }
            if c.num_kv_shared_layers.is_some_and(|n| n != 0 && n != c.num_hidden_layers) {
                return Err(format!("every assistant layer reads shared K/V: num_kv_shared_layers must be {}", c.num_hidden_layers));
            }
            if Activation::parse(&c.hidden_activation).is_none() {
                return Err(format!("unknown hidden_activation {:?}", c.hidden_activation));
            }
            if c.layer_types().len() != c.num_hidden_layers {
                return Err("layer_types must name every layer".into());
            }
            Ok(())
        })?;
        cfg.q_only = true;
        let weights = Weights::load(dir, float_dtype)?;
        let root = weights.root();
        let vb = root.pp("model");
        let (h, b) = (cfg.hidden_size, a.backbone_hidden_size);
        let embed = Embedding::load(&vb.pp("embed_tokens"), cfg.vocab_size, h)?;
        let layers = (0..cfg.num_hidden_layers).map(|i| Block::load(&vb.pp("layers").pp(i), &cfg, i)).collect::<Result<Vec<_>>>()?;
        Ok(Gemma4Assistant {
            pre: Linear::load(&root.pp("pre_projection"), 2 * b, h, false)?,
            post: Linear::load(&root.pp("post_projection"), h, b, false)?,
            norm: RmsNorm::load(&vb.pp("norm"), h, cfg.rms_norm_eps, 0.0)?,
            head: LmHead::load(&root, "model", &embed, cfg.tie_word_embeddings, h, cfg.vocab_size)?,
            layers,
            backbone: b,
            cfg,
        })
    }

    /// The draft network's settings.
    pub fn config(&self) -> &Gemma4Config {
        &self.cfg
    }

    /// The hidden size of the target this assistant drafts for.
    pub fn backbone_hidden_size(&self) -> usize {
        self.backbone
    }

    /// One draft step for one sequence. `x`: `[1, L, 2 * backbone]` (the target's scaled
    /// embedding of a token, then the hidden state before it: the target's final-normed one for
    /// the first draft, this network's projected output after), queried at rope position `pos`;
    /// `sliding`, `full`: the K/V (`[1, kv_heads, T, D]`) of the target's last own-K/V layer of
    /// each type, every query seeing all of them. Returns f32 logits `[1, L, V]` and the
    /// projected hidden states `[1, L, backbone]`.
    pub fn step(&self, x: &Array, pos: usize, sliding: &(Array, Array), full: &(Array, Array)) -> Result<(Array, Array)> {
        let want = 2 * self.backbone;
        if x.ndim() != 3 || x.dims()[2] as usize != want {
            return Err(ModelError::InvalidInput(format!("assistant input must be [1, L, {want}], got {:?}", x.dims())));
        }
        let mut x = self.pre.forward(x)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let kv = if self.cfg.is_sliding(i) { sliding } else { full };
            let h = layer.input_norm.forward(&x)?;
            let (a, _) = layer.attn.forward(&h, None, Some(kv), pos, AttentionMask::None, false, None)?;
            let h = x.add(&layer.post_attn_norm.forward(&a)?)?;
            let y = h.add(&layer.post_ffn_norm.forward(&layer.ffn(&h)?)?)?;
            x = y.mul(&layer.layer_scalar)?;
        }
        let h = self.norm.forward(&x)?;
        Ok((self.head.forward(&h)?, self.post.forward(&h)?))
    }
}
