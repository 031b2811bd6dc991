//! Qwen3 dense causal LM (mirrors mlx-lm `models/qwen3.py` and HF `Qwen3ForCausalLM`).
use crate::cache::{Cache, CacheSpec, ForwardKv, LayerKind};
use crate::config::{default_f32, default_usize, DecoderConfig};
use crate::layers::decoder::{DecoderLayer, Stack};
use crate::layers::{causal_mask, Activation, Attention, AttentionConfig, Embedding, GatedMlp, LmHead, RmsNorm, Rope, RopeScaling};
use crate::runtime::{ForwardOutput, Logits, ModelInfo, ModelRuntime, Rows};
use crate::weights::{Vb, Weights};
use crate::{ModelError, Result};
use mlx_array::{Array, AttentionMask};
use crate::registry::{Built, LoadContext, Preset};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// `config.json` of a Qwen3 checkpoint (the keys the model uses).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Qwen3Config {
    /// The keys every Qwen/Llama-style decoder reads (`cfg.hidden_size` etc. read through it).
    #[serde(flatten)]
    pub decoder: DecoderConfig,
    pub intermediate_size: usize,
    pub num_key_value_heads: usize,
    #[serde(default = "default_f32::<1_000_000>")]
    pub rope_theta: f32,
    #[serde(default = "default_usize::<40960>")]
    pub max_position_embeddings: usize,
    /// `rope_scaling` (or a scaled `rope_parameters`): linear, dynamic, yarn, llama3.
    pub rope_scaling: Option<RopeScaling>,
}

crate::config::impl_deref!(Qwen3Config => decoder: DecoderConfig);

impl Qwen3Config {
    /// Checks the config before any tensor is read.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.decoder.validate(self.num_key_value_heads)?;
        self.rope().map(|_| ())
    }

    /// The rope of every layer: `rope_theta`, scaled as `rope_scaling` asks.
    pub fn rope(&self) -> std::result::Result<Rope, String> {
        Rope::scaled(self.head_dim(), self.rope_theta, self.rope_scaling.as_ref(), self.max_position_embeddings)
    }
}

#[derive(Clone)]
struct Block {
    input_norm: RmsNorm,
    attn: Attention,
    post_norm: RmsNorm,
    mlp: GatedMlp,
}

crate::layers::layer_arrays!(Block { input_norm, attn, post_norm, mlp });

impl DecoderLayer for Block {
    type Ctx = AttentionMask<'static>;
    fn mixer(&self, x: &Array, kv: &mut ForwardKv, i: usize, mask: &Self::Ctx, last_only: bool) -> Result<Array> {
        let (xn, mut kv) = (self.input_norm.forward(x)?, kv.layer(i)?);
        if last_only { self.attn.forward_kv_last(&xn, &mut kv, *mask) } else { self.attn.forward_kv(&xn, &mut kv, *mask) }
    }
    fn ffn(&self, h: &Array) -> Result<Array> {
        self.mlp.forward(&self.post_norm.forward(h)?)
    }
    fn checkpointed(&self, x: &Array, mask: &Self::Ctx) -> Option<Result<Array>> {
        Some(crate::layers::decoder::checkpoint_block(self, x, mask))
    }
}

/// What distinguishes the dense decoders that share [`Qwen3Backbone`]: Qwen3 (per-head q/k
/// norms), Llama (optional biases everywhere, scaled rope) and Qwen2 (q/k/v bias only).
#[derive(Clone)]
pub struct DecoderOptions {
    pub qk_norm: bool,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub rope: Rope,
}

impl DecoderOptions {
    /// Qwen3's: q/k norms, `attention_bias` on all four projections, the config's rope.
    pub fn qwen3(cfg: &Qwen3Config) -> std::result::Result<Self, String> {
        Ok(DecoderOptions { qk_norm: true, qkv_bias: cfg.attention_bias, o_bias: cfg.attention_bias, mlp_bias: false, rope: cfg.rope()? })
    }
}

/// The Qwen3 transformer stack (no head): shared by the LM and Harrier embeddings, and by the
/// Llama and Qwen2 families through [`DecoderOptions`].
pub struct Qwen3Backbone {
    pub(crate) cfg: Qwen3Config,
    embed: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    /// KV heads of this rank's cache (all of them unless the load is tensor parallel).
    kv_heads: usize,
}

impl Qwen3Backbone {
    /// `vb` points at the stack (`model` for the LM, the root for Qwen3Model checkpoints).
    pub fn load(vb: &Vb, cfg: &Qwen3Config) -> Result<Self> {
        let opts = DecoderOptions::qwen3(cfg).map_err(|reason| ModelError::MalformedConfig { path: vb.weights().path().to_path_buf(), reason })?;
        Self::load_with(vb, cfg, &opts)
    }

    pub fn load_with(vb: &Vb, cfg: &Qwen3Config, opts: &DecoderOptions) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim());
        let act = Activation::parse(&cfg.hidden_act).expect("validated");
        let acfg = AttentionConfig {
            bias: opts.qkv_bias,
            o_bias: opts.o_bias,
            qk_norm: opts.qk_norm.then_some(cfg.rms_norm_eps),
            ..AttentionConfig::new(h, cfg.num_attention_heads, cfg.num_key_value_heads, d)
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let lv = vb.pp("layers").pp(i);
                Ok(Block {
                    input_norm: RmsNorm::load(&lv.pp("input_layernorm"), h, cfg.rms_norm_eps, 0.0)?,
                    attn: Attention::load(&lv.pp("self_attn"), acfg.clone(), opts.rope.clone(), ["q_norm", "k_norm"])?,
                    post_norm: RmsNorm::load(&lv.pp("post_attention_layernorm"), h, cfg.rms_norm_eps, 0.0)?,
                    mlp: GatedMlp::load_biased(&lv.pp("mlp"), ["gate_proj", "up_proj", "down_proj"], h, cfg.intermediate_size, act, opts.mlp_bias)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Qwen3Backbone {
            cfg: cfg.clone(),
            embed: Embedding::load(&vb.pp("embed_tokens"), cfg.vocab_size, h)?,
            layers,
            norm: RmsNorm::load(&vb.pp("norm"), h, cfg.rms_norm_eps, 0.0)?,
            kv_heads: crate::layers::parallel::per_rank(vb, "KV heads", cfg.num_key_value_heads)?,
        })
    }

    pub fn cache_spec(&self) -> CacheSpec {
        let k = LayerKind::Attention { kv_heads: self.kv_heads, head_dim: self.cfg.head_dim() };
        CacheSpec { layers: vec![k; self.layers.len()] }
    }

    /// Final-normed hidden states and the leading tokens a paged prefix hit served (see
    /// [`Stack::forward`]).
    pub(crate) fn forward(&self, tokens: &Array, cache: &mut Cache, rows: Rows) -> Result<(Array, usize)> {
        self.forward_tapped(tokens, cache, rows, &[]).map(|(h, s, _)| (h, s))
    }

    /// [`Qwen3Backbone::forward`] with the residual stream after each layer in `taps` (see
    /// [`Stack::forward_tapped`]).
    pub(crate) fn forward_tapped(&self, tokens: &Array, cache: &mut Cache, rows: Rows, taps: &[usize]) -> Result<(Array, usize, Vec<Array>)> {
        let stack = Stack { layers: &self.layers, prefix_skip: true, norm: &self.norm };
        stack.forward_tapped(tokens, cache, rows, |t| self.embed.forward(t), |l| causal_mask(l, None), taps)
    }

    pub fn embed(&self) -> &Embedding {
        &self.embed
    }
}

/// Qwen3 causal LM.
pub struct Qwen3Model {
    backbone: Qwen3Backbone,
    lm_head: LmHead,
    info: ModelInfo,
}

impl Qwen3Model {
    pub fn new(weights: &Weights, cfg: Qwen3Config, eos: Vec<u32>) -> Result<Self> {
        let opts = DecoderOptions::qwen3(&cfg).map_err(|reason| ModelError::MalformedConfig { path: weights.path().to_path_buf(), reason })?;
        Self::with_options(weights, cfg, &opts, "qwen3", eos)
    }

    /// A dense decoder LM with the given options, reported as `model_type`.
    pub fn with_options(weights: &Weights, cfg: Qwen3Config, opts: &DecoderOptions, model_type: &str, eos: Vec<u32>) -> Result<Self> {
        Self::with_options_at(weights, cfg, opts, model_type, eos, "model")
    }

    /// [`Qwen3Model::with_options`] with the decoder's tensors under `decoder_prefix` (e.g.
    /// `language_model.model` in a vision-language checkpoint; the untied head as
    /// [`LmHead::load`] finds it).
    pub fn with_options_at(weights: &Weights, cfg: Qwen3Config, opts: &DecoderOptions, model_type: &str, eos: Vec<u32>, decoder_prefix: &str) -> Result<Self> {
        cfg.validate().map_err(|reason| ModelError::MalformedConfig { path: weights.path().to_path_buf(), reason })?;
        let root = weights.root();
        let backbone = Qwen3Backbone::load_with(&root.pp(decoder_prefix), &cfg, opts)?;
        let lm_head = LmHead::load(&root, decoder_prefix, backbone.embed(), cfg.tie_word_embeddings, cfg.hidden_size, cfg.vocab_size)?;
        let info = ModelInfo::decoder(model_type, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.max_position_embeddings, eos, cfg.bos_token_id);
        Ok(Qwen3Model { backbone, lm_head, info })
    }

    /// The LM over precomputed input embeddings `embeds` (`[1, L, H]`) of the ids `ids`
    /// (`[1, L]`, for the cache's bookkeeping) at the cache's positions; a paged cache serves no
    /// prefix for it (the ids do not identify the inputs).
    pub fn forward_embedded(&self, ids: &Array, embeds: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        let b = &self.backbone;
        let stack = Stack { layers: &b.layers, prefix_skip: false, norm: &b.norm };
        let (h, _) = stack.forward(ids, cache, Rows::of(logits, hidden), |_| Ok(embeds.clone()), |l| causal_mask(l, None))?;
        self.lm_head.output(h, logits, hidden)
    }
}

impl ModelRuntime for Qwen3Model {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn cache_spec(&self) -> CacheSpec {
        self.backbone.cache_spec()
    }
    fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        let (h, _) = self.backbone.forward(tokens, cache, Rows::of(logits, hidden))?;
        self.lm_head.output(h, logits, hidden)
    }
    fn forward_taps(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool, taps: &[usize]) -> Result<(ForwardOutput, Vec<Array>)> {
        let (h, _, t) = self.backbone.forward_tapped(tokens, cache, Rows::All, taps)?;
        Ok((self.lm_head.output(h, logits, hidden)?, t))
    }
    fn input_embeddings(&self, tokens: &Array) -> Result<Array> {
        crate::runtime::check_tokens(tokens)?;
        self.backbone.embed.forward(tokens)
    }
    fn head_logits(&self, hidden: &Array) -> Result<Array> {
        self.lm_head.forward(hidden)
    }
}

/// The registry's constructor.
pub(crate) fn load(c: &LoadContext) -> Result<Built> {
    Ok(Built::Lm(Box::new(Qwen3Model::new(c.weights, c.parse()?, c.eos.clone())?)))
}

/// A Qwen3 config.json of the given shape (head_dim 128 unless `head_dim` says otherwise).
fn shape(h: usize, l: usize, nq: usize, nkv: usize, d: usize, inter: usize, vocab: usize, tied: bool, bos: u32, eos: u32) -> Value {
    json!({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": l,
        "num_attention_heads": nq, "num_key_value_heads": nkv, "head_dim": d, "vocab_size": vocab,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": tied,
        "max_position_embeddings": if vocab > 512 { 40960 } else { 4096 }, "bos_token_id": bos, "eos_token_id": eos
    })
}

/// `tiny`: hidden 64, 2 layers, vocab 512 (runs anywhere in milliseconds); `small`: 8 layers of
/// Qwen3-0.6B's width with a 32k vocabulary; `0.6b` and `8b`: the real shapes.
pub(crate) const PRESETS: &[Preset] = &[
    ("tiny", || shape(64, 2, 4, 2, 16, 128, 512, true, 486, 488)),
    ("small", || shape(1024, 8, 16, 8, 128, 3072, 32768, true, 151643, 151645)),
    ("0.6b", || shape(1024, 28, 16, 8, 128, 3072, 151936, true, 151643, 151645)),
    ("8b", || shape(4096, 36, 32, 8, 128, 12288, 151936, false, 151643, 151645)),
];
