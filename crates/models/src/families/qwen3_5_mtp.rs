//! Qwen3.5's multi-token-prediction (MTP) head, as vLLM's `qwen3_next_mtp.py` runs it: for target
//! position `i`, the pair (target hidden `h_i`, token `t_{i+1}`) becomes
//! `fc([pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])`, one gated
//! full-attention decoder layer (dense MLP, or the sparse MoE block of MoE checkpoints) at rope
//! position `i` with its own K/V cache, then `norm` and the target's head: logits for token
//! `t_{i+2}`. Deeper drafts re-apply the head to its own normed output and the drafted token, at
//! the next position. `h_i` is the target's final-normed hidden state (what
//! [`crate::ModelRuntime::forward`] returns with `hidden`). Norm weights are stored as deltas
//! (`1 + w`) like the rest of Qwen3.5 (already added in mlx-lm's saved layout).
use super::moe::{SparseMoe, SparseMoeConfig};
use super::qwen3_5::Qwen35Config;
use crate::cache::{Cache, CacheSpec, LayerKind};
use crate::layers::decoder::{FeedForward, HybridBlock, HybridCtx, LmHead, Mixer, Stack};
use crate::layers::{causal_mask, Activation, Attention, AttentionConfig, Embedding, GatedMlp, Linear, RmsNorm, RopeAt};
use crate::runtime::Rows;
use crate::weights::Weights;
use crate::{ModelError, Result};
use mlx_array::{ops, Array};
use std::collections::HashMap;
use std::path::Path;

type Block = HybridBlock<super::gated_delta::GatedDeltaNet, SparseMoe>;

/// The MTP head's own weights (embedding and output head are the target's).
pub(crate) struct Mtp {
    fc: Linear,
    pre_fc_norm_embedding: RmsNorm,
    pre_fc_norm_hidden: RmsNorm,
    layers: Vec<Block>,
    norm: RmsNorm,
    kv_heads: usize,
    head_dim: usize,
}

impl Mtp {
    /// Build from the `mtp.*` tensors; every one of them must be used. `off`: the norms' offset
    /// (1 for the hub layout's deltas, 0 where the 1 is already added).
    pub(crate) fn load(tensors: &HashMap<String, Array>, cfg: &Qwen35Config, off: f32, path: &Path) -> Result<Self> {
        let n = cfg.mtp_layers().max(1);
        let weights = Weights::from_map(tensors.clone(), path);
        let vb = weights.root().pp("mtp");
        let (h, d, eps) = (cfg.hidden_size, cfg.head_dim(), cfg.rms_norm_eps);
        let act = Activation::parse(&cfg.hidden_act).ok_or_else(|| ModelError::MalformedConfig { path: path.to_path_buf(), reason: format!("unknown activation {}", cfg.hidden_act) })?;
        let acfg = AttentionConfig {
            bias: cfg.attention_bias,
            o_bias: cfg.attention_bias,
            qk_norm: Some(eps),
            norm_offset: off,
            output_gate: true,
            ..AttentionConfig::new(h, cfg.num_attention_heads, cfg.num_key_value_heads, d)
        };
        let rope = cfg.rope().map_err(|reason| ModelError::MalformedConfig { path: path.to_path_buf(), reason })?;
        let moe_cfg = SparseMoeConfig {
            hidden: h,
            num_experts: cfg.num_experts,
            top_k: cfg.num_experts_per_tok,
            moe_intermediate: cfg.moe_intermediate_size,
            shared_intermediate: cfg.shared_expert_intermediate_size,
            norm_topk_prob: cfg.norm_topk_prob,
            act,
        };
        let layers = (0..n)
            .map(|i| {
                let lv = vb.pp("layers").pp(i);
                // vLLM builds MTP layer `i` as decoder layer index `i`: sparse when the target's
                // layer `i` would be
                let ffn = if cfg.is_moe_layer(i) {
                    FeedForward::Experts(SparseMoe::load(&lv.pp("mlp"), &moe_cfg)?)
                } else {
                    FeedForward::Dense(GatedMlp::load(&lv.pp("mlp"), h, cfg.intermediate_size, act)?)
                };
                Ok(Block {
                    mixer_norm: RmsNorm::load(&lv.pp("input_layernorm"), h, eps, off)?,
                    mixer: Mixer::Attention(Attention::load(&lv.pp("self_attn"), acfg.clone(), rope.clone(), ["q_norm", "k_norm"])?),
                    ffn_norm: RmsNorm::load(&lv.pp("post_attention_layernorm"), h, eps, off)?,
                    ffn,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let m = Mtp {
            fc: Linear::load(&vb.pp("fc"), 2 * h, h, false)?,
            pre_fc_norm_embedding: RmsNorm::load(&vb.pp("pre_fc_norm_embedding"), h, eps, off)?,
            pre_fc_norm_hidden: RmsNorm::load(&vb.pp("pre_fc_norm_hidden"), h, eps, off)?,
            layers,
            norm: RmsNorm::load(&vb.pp("norm"), h, eps, off)?,
            kv_heads: cfg.num_key_value_heads,
            head_dim: d,
        };
        weights.check_all_used()?;
        Ok(m)
    }

    pub(crate) fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The cache of one MTP layer.
    pub(crate) fn cache_spec(&self) -> CacheSpec {
        CacheSpec { layers: vec![LayerKind::Attention { kv_heads: self.kv_heads, head_dim: self.head_dim }] }
    }

    /// MTP layer `layer` over `tokens` (`[1, L]`, the tokens after the positions of `hidden`) and
    /// `hidden` (`[1, L, H]`), appended to `cache` (rope positions from its offset). Returns f32
    /// logits `[1, L, V]` and the final-normed MTP hidden states `[1, L, H]`.
    pub(crate) fn forward(&self, embed: &Embedding, head: &LmHead, tokens: &Array, hidden: &Array, cache: &mut Cache, layer: usize) -> Result<(Array, Array)> {
        let block = self.layers.get(layer..layer + 1).ok_or_else(|| ModelError::InvalidInput(format!("MTP layer {layer} of {}", self.layers.len())))?;
        if hidden.ndim() != 3 || tokens.ndim() != 2 || hidden.dim(1)? != tokens.dim(1)? {
            return Err(ModelError::InvalidInput(format!("MTP inputs: tokens {:?} and hidden {:?} must be [B, L] and [B, L, H]", tokens.shape(), hidden.shape())));
        }
        let stack = Stack { layers: block, prefix_skip: false, norm: &self.norm };
        let (h, _) = stack.forward(
            tokens,
            cache,
            Rows::All,
            |t| {
                let e = self.pre_fc_norm_embedding.forward(&embed.forward(t)?)?;
                let x = self.pre_fc_norm_hidden.forward(&hidden.astype(e.dtype())?)?;
                self.fc.forward(&ops::concatenate(&[&e, &x], -1)?)
            },
            |l| HybridCtx { mask: causal_mask(l, None), at: RopeAt::Cache },
        )?;
        Ok((head.forward(&h)?, h))
    }
}
