//! The decoder skeleton every causal LM family runs: checks, cache begin/finish, prefix skipping,
//! which rows are computed past the last mixer, and the output head. A family supplies its
//! embedding, its blocks ([`DecoderLayer`]) and its [`LmHead`].
use crate::cache::{Cache, CacheSpec, ForwardKv, KvCache, LayerCache, LayerKind};
use crate::layers::{Attention, Embedding, GatedMlp, LayerArrays, Linear, RmsNorm, RopeAt};
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

    /// Gradient checkpointing ([`Cache::set_gradient_checkpointing`]): the layer's output for
    /// `x` (`x` plus the mixer's output, plus the channel mixer's) over no cache, computed under
    /// [`mlx_array::grad::checkpoint`] ([`checkpoint_layer`]); `None` when the layer does not
    /// support it.
    fn checkpointed(&self, _x: &Array, _ctx: &Self::Ctx) -> Option<Result<Array>> {
        None
    }

    /// The empty cache of this layer that a checkpointed pass runs its mixer over
    /// ([`checkpoint_block`]): K/V storage unless the layer says otherwise.
    fn scratch_cache(&self) -> LayerCache {
        LayerCache::Kv(KvCache::new(None))
    }
}

/// `run(layer, x, ctx)` under [`mlx_array::grad::checkpoint`], with `x` and every array of
/// `layer` ([`LayerArrays`]) as the checkpoint's inputs: a gradient transform keeps only those
/// and runs `run` again, over a copy of the layer holding the arrays it is handed, to rebuild
/// the layer's activations in the backward pass.
pub(crate) fn checkpoint_layer<L, C>(layer: &L, x: &Array, ctx: &C, run: fn(&L, &Array, &C) -> Result<Array>) -> Result<Array>
where
    L: LayerArrays + Clone + 'static,
    C: Clone + 'static,
{
    let mut out = checkpoint_layer_with(layer, std::slice::from_ref(x), ctx, move |l, xs, c| Ok(vec![run(l, &xs[0], c)?]))?;
    out.pop().ok_or_else(|| ModelError::InvalidInput("the checkpointed layer returned no output".into()))
}

/// [`checkpoint_layer`] with several activation inputs `xs` (the layer's input and whatever else
/// it reads that depends on the parameters: per-layer inputs, K/V shared from another layer)
/// and several outputs: `run(layer, xs, ctx)` under [`mlx_array::grad::checkpoint`], with `xs`
/// and every array of `layer` as the checkpoint's inputs.
pub(crate) fn checkpoint_layer_with<L, C, F>(layer: &L, xs: &[Array], ctx: &C, run: F) -> Result<Vec<Array>>
where
    L: LayerArrays + Clone + 'static,
    C: Clone + 'static,
    F: Fn(&L, &[Array], &C) -> Result<Vec<Array>> + 'static,
{
    let n = xs.len();
    let mut inputs = xs.to_vec();
    let mut base = layer.clone();
    base.visit_arrays(&mut |a| inputs.push(a.clone()));
    let ctx = ctx.clone();
    let f = move |ins: &[Array]| -> mlx_array::Result<Vec<Array>> {
        let mut copy = base.clone();
        let mut given = ins.iter().skip(n);
        let mut missing = false;
        copy.visit_arrays(&mut |a| match given.next() {
            Some(g) => *a = g.clone(),
            None => missing = true,
        });
        if missing || given.next().is_some() || ins.len() < n {
            return Err(mlx_array::Error::InvalidArgument { op: "checkpoint_layer", msg: format!("{} inputs do not match the layer's arrays", ins.len()) });
        }
        run(&copy, &ins[..n], &ctx).map_err(|e| mlx_array::Error::InvalidArgument { op: "checkpoint_layer", msg: e.to_string() })
    };
    Ok(mlx_array::grad::checkpoint(f, &inputs)?)
}

/// [`DecoderLayer::checkpointed`] of a pre-norm block: [`checkpoint_layer`] over its mixer
/// (from position 0, over the layer's empty [`DecoderLayer::scratch_cache`]: K/V storage for
/// attention, no state yet for a recurrence) and channel mixer, with the residuals.
pub(crate) fn checkpoint_block<L>(layer: &L, x: &Array, ctx: &L::Ctx) -> Result<Array>
where
    L: DecoderLayer + LayerArrays + Clone + 'static,
    L::Ctx: Clone + 'static,
{
    checkpoint_layer(layer, x, ctx, |l, x, ctx| {
        let mut scratch = vec![l.scratch_cache()];
        let h = x.add(&l.mixer(x, &mut ForwardKv::scratch(&mut scratch), 0, ctx, false)?)?;
        Ok(h.add(&l.ffn(&h)?)?)
    })
}

/// A token mixer that carries state from call to call in its layer's recurrent cache slots (a
/// short convolution, a linear-attention recurrence). Its arrays ([`LayerArrays`]) are what a
/// checkpointed pass differentiates.
pub(crate) trait RecurrentMixer: LayerArrays + Clone + 'static {
    /// The recurrent cache slots of one layer.
    const SLOTS: usize;

    /// The output for the normed `x` (`[B, L, H]`), reading and updating `slots` (layer `i`'s).
    /// `valid` (`[B, L, 1]` booleans, batch caches only): the positions that are tokens; the
    /// mixer zeroes its recurrent inputs at the others (left padding), leaving the state as it
    /// was ([`crate::batch`]).
    fn forward_slots(&self, x: &Array, slots: &mut [Option<Array>], i: usize, valid: Option<&Array>) -> Result<Array>;

    /// [`RecurrentMixer::forward_slots`] of a packed step (`x`: `[1, T, H]`, laid out by `g`;
    /// `valid` that of the rows): here the tokens are laid out as rows around it; a mixer whose
    /// projections work token by token runs them over the packed tokens instead.
    fn forward_packed(&self, x: &Array, slots: &mut [Option<Array>], i: usize, valid: Option<&Array>, g: &crate::batch::Ragged) -> Result<Array> {
        g.to_packed(&self.forward_slots(&g.to_rows(x, 1)?, slots, i, valid)?)
    }
}

/// A routed expert block: `[B, L, H]` to `[B, L, H]`.
pub(crate) trait ExpertBlock: LayerArrays + Clone + 'static {
    fn forward_experts(&self, x: &Array) -> Result<Array>;
}

/// The token mixer of a [`HybridBlock`].
#[derive(Clone)]
pub(crate) enum Mixer<R> {
    Attention(Attention),
    Recurrent(R),
}

/// The channel mixer of a [`HybridBlock`].
#[derive(Clone)]
pub(crate) enum FeedForward<E> {
    Dense(GatedMlp),
    Experts(E),
}

impl<R: LayerArrays> LayerArrays for Mixer<R> {
    fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut Array)) {
        match self {
            Mixer::Attention(a) => a.visit_arrays(f),
            Mixer::Recurrent(r) => r.visit_arrays(f),
        }
    }
}

impl<E: LayerArrays> LayerArrays for FeedForward<E> {
    fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut Array)) {
        match self {
            FeedForward::Dense(m) => m.visit_arrays(f),
            FeedForward::Experts(e) => e.visit_arrays(f),
        }
    }
}

/// A pre-norm block of a hybrid stack (Qwen3.5, LFM2): attention or a recurrent mixer, then a
/// dense MLP or an expert block, each behind its own RMSNorm.
#[derive(Clone)]
pub(crate) struct HybridBlock<R, E> {
    pub mixer_norm: RmsNorm,
    pub mixer: Mixer<R>,
    pub ffn_norm: RmsNorm,
    pub ffn: FeedForward<E>,
}

impl<R: LayerArrays, E: LayerArrays> LayerArrays for HybridBlock<R, E> {
    fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut Array)) {
        self.mixer_norm.visit_arrays(f);
        self.mixer.visit_arrays(f);
        self.ffn_norm.visit_arrays(f);
        self.ffn.visit_arrays(f);
    }
}

/// The per-call inputs of a hybrid stack: the attention mask and where the tokens sit for the
/// rotary embedding.
#[derive(Clone)]
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
                match kv.batch().and_then(|b| b.ragged()) {
                    // a packed step: the recurrence runs over the rows
                    Some(g) => r.forward_packed(&n, kv.recurrent(i)?, i, valid.as_ref(), g),
                    None => r.forward_slots(&n, kv.recurrent(i)?, i, valid.as_ref()),
                }
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
    fn checkpointed(&self, x: &Array, ctx: &HybridCtx) -> Option<Result<Array>> {
        Some(checkpoint_block(self, x, ctx))
    }
    fn scratch_cache(&self) -> LayerCache {
        match self.mixer {
            Mixer::Attention(_) => LayerCache::Kv(KvCache::new(None)),
            Mixer::Recurrent(_) => LayerCache::Recurrent(vec![None; R::SLOTS]),
        }
    }
}

/// The [`crate::ModelRuntime`] methods a model over a [`HybridStack`] in its field `stack`
/// delegates to it: `forward_taps`, `input_embeddings` and `head_logits` (what block drafts
/// read of their target).
macro_rules! hybrid_stack_taps {
    () => {
        fn forward_taps(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool, taps: &[usize]) -> Result<(ForwardOutput, Vec<Array>)> {
            self.stack.forward_taps(tokens, cache, logits, hidden, taps)
        }
        fn input_embeddings(&self, tokens: &Array) -> Result<Array> {
            self.stack.input_embeddings(tokens)
        }
        fn head_logits(&self, hidden: &Array) -> Result<Array> {
            self.stack.lm_head.forward(hidden)
        }
    };
}
pub(crate) use hybrid_stack_taps;

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

    /// [`HybridStack::forward`] with the residual stream after each layer in `taps`
    /// ([`crate::ModelRuntime::forward_taps`]): every position, in one call (no paged prefix
    /// is served, no pieces are cut for snapshots).
    pub fn forward_taps(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool, taps: &[usize]) -> Result<(ForwardOutput, Vec<Array>)> {
        check_tokens(tokens)?;
        let stack = Stack { layers: &self.layers, prefix_skip: true, norm: &self.norm };
        let mask = |l| HybridCtx { mask: crate::layers::causal_mask(l, None), at: RopeAt::Cache };
        let (h, _, tapped) = stack.forward_tapped(tokens, cache, Rows::All, |t| self.embed.forward(t), mask, taps)?;
        Ok((self.lm_head.output(h, logits, hidden)?, tapped))
    }

    /// The input embeddings of `tokens` ([`crate::ModelRuntime::input_embeddings`]).
    pub fn input_embeddings(&self, tokens: &Array) -> Result<Array> {
        check_tokens(tokens)?;
        self.embed.forward(tokens)
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
        self.forward_tapped(tokens, cache, rows, embed, ctx, &[]).map(|(h, s, _)| (h, s))
    }

    /// [`Stack::forward`] that also returns the residual stream after each layer in `taps`
    /// (strictly ascending, below the last layer; every position, no prefix skipped).
    pub fn forward_tapped<E, C>(&self, tokens: &Array, cache: &mut Cache, rows: Rows, embed: E, ctx: C, taps: &[usize]) -> Result<(Array, usize, Vec<Array>)>
    where
        E: FnOnce(&Array) -> Result<Array>,
        C: FnOnce(usize) -> L::Ctx,
    {
        check_tokens(tokens)?;
        check_cache_layers(cache, self.layers.len())?;
        crate::runtime::check_taps(taps, self.layers.len())?;
        if cache.gradient_checkpointing() {
            if !taps.is_empty() {
                return Err(ModelError::UnsupportedOption("gradient checkpointing: residual-stream taps".into()));
            }
            return Ok((self.forward_checkpointed(tokens, cache, rows, embed, ctx)?, 0, Vec::new()));
        }
        let mut tapped = Vec::with_capacity(taps.len());
        let (mut kv, skipped) = cache.begin_forward_with(tokens, self.prefix_skip && rows != Rows::All && taps.is_empty())?;
        let l = tokens.dims()[1] as usize;
        let tokens = if skipped > 0 { tokens.slice_axis(1, skipped, l)? } else { tokens.clone() };
        let mut x = embed(&tokens)?;
        let ctx = ctx(l - skipped);
        let n = self.layers.len();
        // A packed step ([`crate::batch::Ragged`]): the last position read is each row's own.
        let ragged = kv.batch().and_then(|b| b.ragged());
        for (i, layer) in self.layers.iter().enumerate() {
            let last = i + 1 == n;
            let last_only = last && ragged.is_none() && layer.can_query_last_only() && rows.query_last_only(x.dim(1)?);
            let a = layer.mixer(&x, &mut kv, i, &ctx, last_only)?;
            let mut h = Rows::residual(&x, last_only)?.add(&a)?;
            if let (true, Some(g)) = (last, ragged) {
                match rows {
                    Rows::None => {
                        x = h;
                        break;
                    }
                    // [B, 1, H]: each row's last token
                    Rows::Last => h = g.last_tokens(&h)?.swap_axes(0, 1)?,
                    Rows::All => {}
                }
            } else if last && !rows.cut(&mut h)? {
                x = h;
                break;
            }
            x = h.add(&layer.ffn(&h)?)?;
            if taps.contains(&i) {
                tapped.push(x.clone());
            }
        }
        kv.finish()?;
        Ok((self.norm.forward(&x)?, skipped, tapped))
    }

    /// A training forward pass with every layer checkpointed
    /// ([`Cache::set_gradient_checkpointing`]): from position 0, every position, no K/V stored.
    fn forward_checkpointed(&self, tokens: &Array, cache: &Cache, rows: Rows, embed: impl FnOnce(&Array) -> Result<Array>, ctx: impl FnOnce(usize) -> L::Ctx) -> Result<Array> {
        check_checkpointed(cache, rows)?;
        let mut x = embed(tokens)?;
        let ctx = ctx(tokens.dims()[1] as usize);
        for layer in self.layers {
            x = match layer.checkpointed(&x, &ctx) {
                Some(r) => r?,
                None => return Err(ModelError::UnsupportedOption("gradient checkpointing: this model's layers do not support it".into())),
            };
        }
        self.norm.forward(&x)
    }
}

/// What a pass with [`Cache::set_gradient_checkpointing`] needs: a flat, non-batch cache at
/// position 0 (no K/V, no recurrent state), and every position computed (a checkpointed layer keeps no cache state, so a
/// later call could not continue from it).
pub(crate) fn check_checkpointed(cache: &Cache, rows: Rows) -> Result<()> {
    let why = if cache.is_paged() || cache.batch.is_some() {
        "it needs a flat, non-batch cache"
    } else if cache.offset() != 0 || cache.layers.iter().any(|l| matches!(l, LayerCache::Recurrent(s) if s.iter().any(Option::is_some))) {
        "a pass starts at position 0"
    } else if rows != Rows::All {
        "a pass computes every position (all logits, or the hidden states)"
    } else {
        return Ok(());
    };
    Err(ModelError::UnsupportedOption(format!("gradient checkpointing: {why}")))
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
