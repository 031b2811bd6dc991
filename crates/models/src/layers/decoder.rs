//! The decoder skeleton every causal LM family runs: checks, cache begin/finish, prefix skipping,
//! which rows are computed past the last mixer, and the output head. A family supplies its
//! embedding, its blocks ([`DecoderLayer`]) and its [`LmHead`].
use crate::cache::{Cache, CacheSpec, ForwardKv, LayerKind};
use crate::layers::{Attention, Embedding, GatedMlp, Linear, RmsNorm, RopeAt};
use crate::runtime::{check_cache_layers, check_tokens, ForwardOutput, Logits, Rows};
use crate::weights::Vb;
use crate::{ModelError, Result};
use mlx_array::{Array, AttentionMask, DType};

/// One block of a decoder stack: a token mixer (attention, convolution, recurrence) and a
/// channel mixer (MLP, MoE), each with its own norms; the runner adds the residuals.
pub(crate) trait DecoderLayer {
    /// Inputs shared by every layer of one forward call (the masks for its length).
    type Ctx;

    /// The token mixer's output for `x` (`[B, L, H]`), to be added to `x`. `last_only`: only the
    /// last position is read past this layer, so an attention layer may query only that one
    /// (returning `[B, 1, H]`) while still caching the K/V of every position.
    fn mixer(&self, x: &Array, kv: &mut ForwardKv, i: usize, ctx: &Self::Ctx, last_only: bool) -> Result<Array>;

    /// Whether [`DecoderLayer::mixer`] honours `last_only` (attention does; a recurrence must
    /// see every position).
    fn can_query_last_only(&self) -> bool {
        true
    }

    /// The channel mixer's output for `h`, to be added to `h`.
    fn ffn(&self, h: &Array) -> Result<Array>;
}

/// A token mixer that carries state from call to call in its layer's recurrent cache slots (a
/// short convolution, a linear-attention recurrence).
pub(crate) trait RecurrentMixer {
    /// The output for the normed `x` (`[B, L, H]`), reading and updating `slots` (layer `i`'s).
    /// `valid` (`[B, L, 1]` booleans, batch caches only): the positions that are tokens; the
    /// mixer zeroes its recurrent inputs at the others (left padding), leaving the state as it
    /// was ([`crate::batch`]).
    fn forward_slots(&self, x: &Array, slots: &mut [Option<Array>], i: usize, valid: Option<&Array>) -> Result<Array>;
}

/// A routed expert block: `[B, L, H]` to `[B, L, H]`.
pub(crate) trait ExpertBlock {
    fn forward_experts(&self, x: &Array) -> Result<Array>;
}

/// The token mixer of a [`HybridBlock`].
pub(crate) enum Mixer<R> {
    Attention(Attention),
    Recurrent(R),
}

/// The channel mixer of a [`HybridBlock`].
pub(crate) enum FeedForward<E> {
    Dense(GatedMlp),
    Experts(E),
}

/// A pre-norm block of a hybrid stack (Qwen3.5, LFM2): attention or a recurrent mixer, then a
/// dense MLP or an expert block, each behind its own RMSNorm.
pub(crate) struct HybridBlock<R, E> {
    pub mixer_norm: RmsNorm,
    pub mixer: Mixer<R>,
    pub ffn_norm: RmsNorm,
    pub ffn: FeedForward<E>,
}

/// The per-call inputs of a hybrid stack: the attention mask and where the tokens sit for the
/// rotary embedding.
pub(crate) struct HybridCtx {
    pub mask: AttentionMask<'static>,
    pub at: RopeAt,
}

impl<R: RecurrentMixer, E: ExpertBlock> DecoderLayer for HybridBlock<R, E> {
    type Ctx = HybridCtx;
    fn mixer(&self, x: &Array, kv: &mut ForwardKv, i: usize, ctx: &Self::Ctx, last_only: bool) -> Result<Array> {
        let n = self.mixer_norm.forward(x)?;
        match &self.mixer {
            Mixer::Attention(a) => a.forward_kv_at(&n, &mut kv.layer(i)?, ctx.mask, last_only, &ctx.at),
            Mixer::Recurrent(r) => {
                let valid = kv.batch().map(|b| b.step_valid()).transpose()?.flatten();
                r.forward_slots(&n, kv.recurrent(i)?, i, valid.as_ref())
            }
        }
    }
    fn can_query_last_only(&self) -> bool {
        matches!(self.mixer, Mixer::Attention(_))
    }
    fn ffn(&self, h: &Array) -> Result<Array> {
        let n = self.ffn_norm.forward(h)?;
        match &self.ffn {
            FeedForward::Dense(m) => m.forward(&n),
            FeedForward::Experts(m) => m.forward_experts(&n),
        }
    }
}

/// A hybrid LM's embedding, blocks, final norm and head (Qwen3.5, LFM2).
pub(crate) struct HybridStack<R, E> {
    pub embed: Embedding,
    pub layers: Vec<HybridBlock<R, E>>,
    pub norm: RmsNorm,
    pub lm_head: LmHead,
}

impl<R: RecurrentMixer, E: ExpertBlock> HybridStack<R, E> {
    /// `attention` for the attention layers, `slots` recurrent slots for the others.
    pub fn cache_spec(&self, attention: LayerKind, slots: usize) -> CacheSpec {
        let kind = |l: &HybridBlock<R, E>| match l.mixer {
            Mixer::Attention(_) => attention.clone(),
            Mixer::Recurrent(_) => LayerKind::Recurrent { slots },
        };
        CacheSpec { layers: self.layers.iter().map(kind).collect() }
    }

    /// With a paged cache, a new sequence skips a cached prefix only up to a block boundary
    /// where a snapshot of the recurrent state was kept ([`crate::PagedConfig::recurrent_snapshots`]),
    /// and restores it. To keep such snapshots, a multi-token call on a paged cache runs in
    /// pieces ending at multiples of [`crate::PagedConfig::snapshot_interval`] positions (past
    /// the prefix a snapshot already covers); calls that read every position run whole.
    pub fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        self.forward_at(tokens, cache, logits, hidden, &RopeAt::Cache)
    }

    /// The stack over precomputed input embeddings `embeds` (`[1, L, H]`) of the ids `ids`
    /// (`[1, L]`, for the cache's bookkeeping) at rotary positions `at`, in one call; a paged
    /// cache neither reuses nor shares blocks for it (the ids do not identify the inputs).
    pub fn forward_embedded(&self, ids: &Array, embeds: &Array, cache: &mut Cache, logits: Logits, hidden: bool, at: RopeAt) -> Result<ForwardOutput> {
        let stack = Stack { layers: &self.layers, prefix_skip: false, norm: &self.norm };
        let (h, _) = stack.forward(ids, cache, Rows::of(logits, hidden), |_| Ok(embeds.clone()), |l| HybridCtx { mask: crate::layers::causal_mask(l, None), at })?;
        self.lm_head.output(h, logits, hidden)
    }

    /// [`HybridStack::forward`] with the tokens at rotary positions `at` ([`RopeAt::Cache`] or a
    /// [`RopeAt::Shift`]: positions relative to the cache, so the pieces of a paged prefill
    /// keep them).
    pub fn forward_at(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool, at: &RopeAt) -> Result<ForwardOutput> {
        check_tokens(tokens)?;
        let stack = Stack { layers: &self.layers, prefix_skip: true, norm: &self.norm };
        let rows = Rows::of(logits, hidden);
        let (b, l) = (tokens.dims()[0] as usize, tokens.dims()[1] as usize);
        let embed = |t: &Array| self.embed.forward(t);
        let mask = |l| HybridCtx { mask: crate::layers::causal_mask(l, None), at: at.clone() };
        if rows != Rows::All && b == 1 && l > 1 && cache.is_paged() {
            let start = cache.offset();
            // Host ids (a prompt's are): the pieces are made from them, so their ids are known
            // when each piece ends and its snapshot can be keyed.
            let ids = if start == 0 || tokens.is_available() { Some(tokens.astype(DType::U32)?.to_vec::<u32>()?) } else { None };
            let piece = |a: usize, c: usize| -> Result<Array> {
                Ok(match &ids {
                    Some(ids) => Array::from_slice(&ids[a..c], &[1, c - a])?,
                    None => tokens.slice_axis(1, a, c)?,
                })
            };
            if let Some((every, covered)) = cache.snapshot_plan(ids.as_deref().filter(|_| start == 0)) {
                let mut cuts = Vec::new();
                let mut e = (start + covered) / every * every + every;
                while e < start + l {
                    cuts.push(e - start);
                    e += every;
                }
                if !cuts.is_empty() {
                    let (mut a, mut skipped) = (0, None);
                    for c in cuts {
                        let (_, s) = stack.forward(&piece(a, c)?, cache, Rows::None, embed, mask)?;
                        skipped.get_or_insert(s);
                        a = c;
                    }
                    let (h, _) = stack.forward(&piece(a, l)?, cache, rows, embed, mask)?;
                    cache.set_last_skipped(skipped.unwrap_or(0));
                    return self.lm_head.output(h, logits, hidden);
                }
            }
        }
        let (h, _) = stack.forward(tokens, cache, rows, embed, mask)?;
        self.lm_head.output(h, logits, hidden)
    }
}

/// The masks of one forward call over `l` new positions: full causal, and sliding-window causal
/// when the family has sliding layers.
#[derive(Clone, Copy)]
pub(crate) struct Masks {
    pub full: AttentionMask<'static>,
    pub sliding: AttentionMask<'static>,
}

impl Masks {
    pub fn new(l: usize, window: Option<usize>) -> Self {
        Masks { full: crate::layers::causal_mask(l, None), sliding: crate::layers::causal_mask(l, window) }
    }
}

/// How a family's stack is run.
pub(crate) struct Stack<'a, L: DecoderLayer> {
    pub layers: &'a [L],
    /// Whether a paged cache may serve a cached prefix (attention-only stacks). Hybrid stacks
    /// (recurrent layers must see every token) never skip.
    pub prefix_skip: bool,
    /// The final norm.
    pub norm: &'a crate::layers::RmsNorm,
}

impl<L: DecoderLayer> Stack<'_, L> {
    /// Final-normed hidden states `[B, L - skipped, H]` (or `[B, 1, H]` for `Rows::Last`) and
    /// `skipped`, the leading tokens a paged prefix-cache hit served (0 with flat caches).
    ///
    /// `rows`: which positions the caller reads. Past the last layer's mixer (its caches are
    /// written) only those are computed: the last one for `Rows::Last`, none for `Rows::None`
    /// (a prefill chunk), as mlx-lm evaluates only the caches for a prompt's leading tokens.
    /// `embed` maps the (unskipped) ids to the first hidden states; `ctx` builds the per-call
    /// inputs from the number of new positions.
    pub fn forward(
        &self,
        tokens: &Array,
        cache: &mut Cache,
        rows: Rows,
        embed: impl FnOnce(&Array) -> Result<Array>,
        ctx: impl FnOnce(usize) -> L::Ctx,
    ) -> Result<(Array, usize)> {
        check_tokens(tokens)?;
        check_cache_layers(cache, self.layers.len())?;
        let (mut kv, skipped) = cache.begin_forward_with(tokens, self.prefix_skip && rows != Rows::All)?;
        let l = tokens.dims()[1] as usize;
        let tokens = if skipped > 0 { tokens.slice_axis(1, skipped, l)? } else { tokens.clone() };
        let mut x = embed(&tokens)?;
        let ctx = ctx(l - skipped);
        let n = self.layers.len();
        for (i, layer) in self.layers.iter().enumerate() {
            let last = i + 1 == n;
            let last_only = last && layer.can_query_last_only() && rows.query_last_only(x.dim(1)?);
            let a = layer.mixer(&x, &mut kv, i, &ctx, last_only)?;
            let mut h = Rows::residual(&x, last_only)?.add(&a)?;
            if last && !rows.cut(&mut h)? {
                x = h;
                break;
            }
            x = h.add(&layer.ffn(&h)?)?;
        }
        kv.finish()?;
        Ok((self.norm.forward(&x)?, skipped))
    }
}

/// The output projection: the tied embedding or its own `lm_head`, with an optional final
/// logit soft-cap (Gemma).
pub struct LmHead {
    linear: Linear,
    softcap: Option<f32>,
    /// Tensor parallel: `linear` computes this rank's vocabulary slice, joined over the group.
    gather: Option<mlx_array::distributed::Group>,
}

impl LmHead {
    /// One precedence for every family: `tie_word_embeddings` decides. Tied: the embedding
    /// (an `lm_head` copy a tied checkpoint may carry is set aside by the loader). Untied: the
    /// head at the root next to the decoder (`lm_head`, or `language_model.lm_head` for
    /// `language_model.model` layouts), else under the decoder prefix.
    pub fn load(root: &Vb, decoder_prefix: &str, embed: &Embedding, tied: bool, hidden: usize, vocab: usize) -> Result<Self> {
        let linear = if tied {
            embed.as_linear()?
        } else {
            let candidates = [head_prefix(decoder_prefix).to_string(), format!("{decoder_prefix}.lm_head")];
            let at = candidates.iter().find(|c| root.contains(&format!("{c}.weight"))).unwrap_or(&candidates[0]);
            Linear::load_parallel(&root.pp(at), hidden, vocab, false, super::parallel::Shard::Output).map_err(|e| match e {
                ModelError::Checkpoint { path, msg } if msg.starts_with("missing tensor") => {
                    ModelError::Checkpoint { path, msg: format!("{msg} (tie_word_embeddings is false)") }
                }
                e => e,
            })?
        };
        Ok(LmHead { linear, softcap: None, gather: super::parallel::group(root) })
    }

    /// Soft-cap the logits: `c * tanh(logits / c)` (no cap for `None` or `c <= 0`).
    pub fn with_softcap(mut self, c: Option<f32>) -> Self {
        self.softcap = c.filter(|c| *c > 0.0);
        self
    }

    /// f32 logits of hidden states `h`.
    pub fn forward(&self, h: &Array) -> Result<Array> {
        let y = self.linear.forward(h)?;
        let y = match &self.gather {
            Some(g) => super::parallel::gather_last_axis(g, &y)?,
            None => y,
        };
        let y = y.astype(DType::F32)?;
        Ok(match self.softcap {
            Some(c) => y.softcap(c)?,
            None => y,
        })
    }

    /// The requested logits of final hidden states `h`, and `h` itself when asked for.
    pub fn output(&self, h: Array, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        let logits = logits.select(&h, |x| self.forward(x))?;
        Ok(ForwardOutput { logits, hidden: hidden.then_some(h) })
    }
}

/// Where the untied head of a decoder under `decoder_prefix` lives.
pub(crate) fn head_prefix(decoder_prefix: &str) -> &'static str {
    if decoder_prefix == "language_model.model" { "language_model.lm_head" } else { "lm_head" }
}
