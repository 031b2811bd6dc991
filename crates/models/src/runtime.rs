//! The [`ModelRuntime`] trait every family implements: forward, cache spec, config.
use crate::cache::{Cache, CacheSpec};
use crate::{ModelError, Result};
use mlx_array::{Array, DType};

/// Family-independent facts about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Canonical family (`qwen3`, `harrier`, ...).
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub max_position_embeddings: usize,
    /// Token ids that end generation (from config.json / generation_config.json).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

impl ModelInfo {
    /// The facts of a decoder LM; `eos_token_ids` come from the checkpoint's files.
    pub fn decoder(model_type: &str, vocab_size: usize, hidden_size: usize, num_layers: usize, max_position_embeddings: usize, eos_token_ids: Vec<u32>, bos_token_id: Option<u32>) -> Self {
        ModelInfo { model_type: model_type.into(), vocab_size, hidden_size, num_layers, max_position_embeddings, eos_token_ids, bos_token_id }
    }
}

/// `[B, L]` integer ids (shape and dtype only: no device sync, so decode stays pipelined).
/// [`crate::Model::forward`] also checks the id range ([`check_token_range`]); generation checks
/// host ids itself.
pub(crate) fn check_tokens(tokens: &Array) -> Result<()> {
    if tokens.ndim() != 2 || tokens.size() == 0 || !matches!(tokens.dtype(), DType::I32 | DType::U32 | DType::I64) {
        return Err(ModelError::InvalidInput(format!("tokens must be a non-empty [batch, length] integer array, got {:?} {}", tokens.shape(), tokens.dtype())));
    }
    Ok(())
}

/// Every id of `tokens` is in `0..vocab` (reads two scalars back: one device sync).
pub(crate) fn check_token_range(tokens: &Array, vocab: usize) -> Result<()> {
    check_tokens(tokens)?;
    let max = tokens.max(&[], false)?.astype(DType::I64)?.item::<i64>()?;
    let min = tokens.min(&[], false)?.astype(DType::I64)?.item::<i64>()?;
    if min < 0 || max as usize >= vocab {
        return Err(ModelError::InvalidInput(format!("token id {} out of range for vocab size {vocab}", if min < 0 { min } else { max })));
    }
    Ok(())
}

/// The cache was laid out for a model of `layers` layers.
pub(crate) fn check_cache_layers(cache: &Cache, layers: usize) -> Result<()> {
    if cache.layers.len() != layers {
        return Err(ModelError::Cache(format!("cache has {} layers, model {layers}", cache.layers.len())));
    }
    Ok(())
}

/// Which logits a forward call should compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// `[B, L, V]`.
    All,
    /// `[B, 1, V]`: the last position only (prefill, decode).
    Last,
    /// None (embedding models, or prefill chunks before the last).
    None,
}

impl Logits {
    /// Apply the output `head` to final hidden states `h` (`[B, L, hidden]`) at the positions this
    /// request asks for: all of them, the last one, or none.
    pub fn select(self, h: &Array, head: impl Fn(&Array) -> Result<Array>) -> Result<Option<Array>> {
        Ok(match self {
            Logits::None => None,
            Logits::All => Some(head(h)?),
            Logits::Last => {
                let l = h.dim(1)?;
                Some(head(&h.slice_axis(1, l - 1, l)?)?)
            }
        })
    }
}

/// Which positions' outputs a forward call needs (models skip work for the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rows {
    All,
    Last,
    None,
}

impl Rows {
    pub(crate) fn of(logits: Logits, hidden: bool) -> Rows {
        match (logits, hidden) {
            (Logits::All, _) | (_, true) => Rows::All,
            (Logits::Last, false) => Rows::Last,
            (Logits::None, false) => Rows::None,
        }
    }

    /// Past the last layer's mixer (its caches are written), cut `h` (`[B, L, H]`) to the rows
    /// still worth computing: all, or the last position. `false`: none (stop, only the caches
    /// mattered).
    pub(crate) fn cut(self, h: &mut Array) -> Result<bool> {
        let l = h.dim(1)?;
        match self {
            Rows::None => return Ok(false),
            Rows::Last if l > 1 => *h = h.slice_axis(1, l - 1, l)?,
            Rows::All | Rows::Last => {}
        }
        Ok(true)
    }

    /// At the last cache-writing layer, over `l` rows: whether its attention need query only the
    /// last position (only that row is read; the K/V of all rows still go to the cache).
    pub(crate) fn query_last_only(self, l: usize) -> bool {
        self == Rows::Last && l > 1
    }

    /// The residual stream `x` (`[B, L, H]`) that a last-only attention output (`[B, 1, H]`) is
    /// added to: its last row when `last_only`, else all of it.
    pub(crate) fn residual(x: &Array, last_only: bool) -> Result<Array> {
        if !last_only {
            return Ok(x.clone());
        }
        let l = x.dim(1)?;
        Ok(x.slice_axis(1, l - 1, l)?)
    }
}

/// What a forward call returns. With a paged cache, the first `Logits::Last`/`Logits::None`
/// call of a sequence (without hidden states) may find leading tokens in the prefix cache and not
/// recompute them ([`crate::Cache::last_skipped`]); calls asking for every position never skip.
pub struct ForwardOutput {
    /// f32 logits as requested.
    pub logits: Option<Array>,
    /// Final-normed hidden states `[B, L, hidden]`, when asked for.
    pub hidden: Option<Array>,
}

/// A model: a function of (tokens, caches).
pub trait ModelRuntime: Send {
    fn info(&self) -> &ModelInfo;
    fn cache_spec(&self) -> CacheSpec;
    /// `tokens`: `[B, L]` i32/u32 ids. Appends to `cache` and returns the requested outputs.
    fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput>;
    /// Whether the checkpoint carried multi-token-prediction head weights (Qwen3.5), for the
    /// speculative crate.
    fn has_mtp_weights(&self) -> bool {
        false
    }
    /// Layers of the multi-token-prediction head [`ModelRuntime::mtp_forward`] runs (0: none).
    fn mtp_layers(&self) -> usize {
        0
    }
    /// The cache layout of one MTP layer, when the model has an MTP head.
    fn mtp_cache_spec(&self) -> Option<CacheSpec> {
        None
    }
    /// MTP layer `layer` over `tokens` (`[1, L]`: the token after each position of `hidden`) and
    /// `hidden` (`[1, L, H]`: the target's final-normed hidden states, or the head's own output
    /// for deeper drafts), appended to `cache` (from [`ModelRuntime::mtp_cache_spec`]). Returns
    /// f32 logits `[1, L, V]` and the head's final-normed hidden states `[1, L, H]`.
    fn mtp_forward(&self, _tokens: &Array, _hidden: &Array, _cache: &mut Cache, _layer: usize) -> Result<(Array, Array)> {
        Err(ModelError::UnsupportedOption(format!("{} has no multi-token-prediction head", self.info().model_type)))
    }
    /// The media side of a vision-language model (`None`: text only).
    fn media(&self) -> Option<&dyn crate::media::MediaModel> {
        None
    }
    /// The Gemma 4 network behind this runtime, for `gemma4_assistant` drafting (`None` for
    /// other families).
    fn as_gemma4(&self) -> Option<&crate::families::gemma4::Gemma4Model> {
        None
    }
}
