//! Supervised fine-tuning: [`SftTrainer`] runs optimizer updates over a dataset of
//! [`Example`]s and returns per-step metrics.
//!
//! Loss: the mean cross-entropy (with optional label smoothing, as torch's
//! `cross_entropy(label_smoothing=ε)`: `(1 - ε) nll + ε (logsumexp - mean logits)`) over all
//! loss tokens of the batch. The output head runs only on the loss positions. When they fit in
//! [`SftConfig::head_chunk`] rows, it runs on all of them inside one autodiff pass (one forward,
//! one backward). When there are more, it runs in chunks of `head_chunk` rows, each evaluated
//! before the next, with the head's gradient computed in closed form per chunk (see
//! `chunked_gradients`): neither the forward nor the backward pass holds more than
//! `head_chunk x V` logits, at the cost of a second forward pass through the model body. The
//! chunked head multiplies the final hidden states by the head matrix (`lm_head.weight`, or
//! the embeddings when they are tied, with the config's `final_logit_softcapping`); it is used
//! when it reproduces the model's own logits on a probe sequence at construction, otherwise the
//! model's full logits are computed and the loss positions taken from them.
//!
//! Batches are right-padded (causal attention: the padding does not change earlier positions).
//! Gradient accumulation sums the gradients of `grad_accumulation` micro-batches and applies
//! their mean; the last micro-batches of an epoch, when fewer, are applied averaged over how many
//! there were. The data order of each epoch is a seeded shuffle; the checkpoint records the
//! generator state and the position, so a resumed run sees exactly the batches it would have.
use crate::data::{make_batch, Batch, Example};
use crate::error::{Result, TrainError};
use crate::guard::{NanGuard, Verdict};
use crate::lora::LoraConfig;
use crate::optim::{clip_gradients, ClipConfig, Optimizer, OptimizerConfig, Schedule};
use crate::state::{self, CheckpointContents, TrainerState};
use mlx_array::grad::value_and_grad;
use mlx_array::{Array, DType};
use mlx_models::{KvCacheMode, LoadOptions, Logits, LoraSettings, Model, ParameterTree};
use std::path::Path;
use std::time::Instant;

/// SFT settings. Defaults: batch 4, no accumulation, one epoch, shuffled with seed 0, AdamW,
/// constant learning rate 1e-5, gradient norm clipped to 1.0, no label smoothing, 1024 loss
/// positions per head chunk.
#[derive(Debug, Clone, PartialEq)]
pub struct SftConfig {
    pub batch_size: usize,
    pub grad_accumulation: usize,
    pub epochs: u64,
    /// Number of optimizer updates; when set it wins over `epochs` (the data repeats as needed).
    pub max_steps: Option<u64>,
    pub shuffle: bool,
    pub seed: u64,
    pub label_smoothing: f64,
    pub schedule: Schedule,
    pub optimizer: OptimizerConfig,
    pub clip: ClipConfig,
    pub head_chunk: usize,
    /// Use the chunked head when it reproduces the model's logits (default true); `false`
    /// always computes the model's full logits.
    pub chunked_head: bool,
    /// Padding id (`None`: the config's `pad_token_id`, else 0).
    pub pad_id: Option<u32>,
    /// The LoRA settings the tree's adapters were made with ([`crate::lora::apply_lora`],
    /// [`crate::lora::load_adapters`]); required when the tree has adapters. Checkpoints then
    /// hold the adapters (`adapters.safetensors`, `adapter_config.json`), not the base model.
    pub lora: Option<LoraConfig>,
    /// Updates with non-finite gradients are skipped; once more than this many were, the run
    /// stops with [`TrainError::NanGradients`] ([`crate::guard`]; default 100).
    pub max_nan_gradients: u64,
    /// Gradient checkpointing per decoder layer (default false): the backward pass recomputes
    /// each layer's activations from the layer's input instead of keeping them
    /// ([`mlx_models::Cache::set_gradient_checkpointing`]): less memory, one more forward pass
    /// through the layers. Every LM family's layers support it (attention, short-conv and
    /// GatedDeltaNet mixers, dense and MoE feed-forwards, Gemma 4's per-layer inputs and
    /// KV-shared layers).
    pub gradient_checkpointing: bool,
}

impl Default for SftConfig {
    fn default() -> Self {
        SftConfig {
            batch_size: 4,
            grad_accumulation: 1,
            epochs: 1,
            max_steps: None,
            shuffle: true,
            seed: 0,
            label_smoothing: 0.0,
            schedule: Schedule::default(),
            optimizer: OptimizerConfig::default(),
            clip: ClipConfig { max_norm: Some(1.0), max_value: None },
            head_chunk: 1024,
            chunked_head: true,
            pad_id: None,
            lora: None,
            max_nan_gradients: crate::guard::DEFAULT_MAX_NAN_GRADIENTS,
            gradient_checkpointing: false,
        }
    }
}

impl SftConfig {
    fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(TrainError::Config(m.into()));
        if self.batch_size == 0 {
            return bad("batch_size must be >= 1");
        }
        if self.grad_accumulation == 0 {
            return bad("grad_accumulation must be >= 1");
        }
        if self.max_steps.is_none() && self.epochs == 0 {
            return bad("epochs must be >= 1 (or set max_steps)");
        }
        if !(0.0..1.0).contains(&self.label_smoothing) {
            return bad("label_smoothing must lie in [0, 1)");
        }
        if self.head_chunk == 0 {
            return bad("head_chunk must be >= 1");
        }
        self.schedule.validate()
    }
}

/// What one optimizer update did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepMetrics {
    /// Updates applied, this one included.
    pub step: u64,
    /// Epoch (0-based) of the update's last micro-batch.
    pub epoch: u64,
    /// Mean of the micro-batches' losses.
    pub loss: f32,
    /// Tokens the loss counted.
    pub loss_tokens: usize,
    /// Positions with a real next token (padding excluded).
    pub tokens: usize,
    pub micro_batches: usize,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    pub seconds: f64,
    /// The gradients were not finite and the update was skipped (`step` did not advance).
    pub skipped: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum Head {
    /// Hidden states times this parameter (transposed), optionally soft-capped.
    Chunked { weight: String, softcap: Option<f32> },
    /// The model's own logits over every position.
    Model,
}

/// Progress through the data.
#[derive(Debug, Clone)]
struct Progress {
    step: u64,
    epoch: u64,
    position: usize,
    epoch_rng: u64,
    order: Vec<usize>,
}

/// The seed of the LoRA dropout masks of micro-batch `micro` of update `step`.
fn lora_dropout_seed(seed: u64, step: u64, micro: usize) -> u64 {
    let mut s = seed ^ 0xD50F_0D50_F0D5_0F0D ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (micro as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    splitmix(&mut s)
}

/// A tree with adapters needs its LoRA config (what checkpoints record), and only then.
fn check_lora(tree: &ParameterTree, config: &SftConfig) -> Result<()> {
    match (tree.lora().is_some(), &config.lora) {
        (true, None) => Err(TrainError::Config("the tree has LoRA adapters: set SftConfig::lora to the LoRA config they were made with".into())),
        (false, Some(_)) => Err(TrainError::Config("SftConfig::lora is set but the tree has no LoRA adapters (apply_lora)".into())),
        _ => Ok(()),
    }
}

/// SplitMix64: the shuffle generator (its whole state is one u64, saved with checkpoints).
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The order of an epoch whose generator starts at `rng`, and the generator state after it.
fn epoch_order(n: usize, shuffle: bool, mut rng: u64) -> (Vec<usize>, u64) {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        for i in (1..n).rev() {
            let j = (splitmix(&mut rng) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
    }
    (order, rng)
}

/// Supervised fine-tuning over a parameter tree (its trainable subset is trained; frozen
/// parameters never change).
pub struct SftTrainer {
    tree: ParameterTree,
    opts: LoadOptions,
    config: SftConfig,
    examples: Vec<Example>,
    optimizer: Optimizer,
    progress: Progress,
    head: Head,
    pad_id: u32,
    guard: NanGuard,
    /// Data-parallel group ([`SftTrainer::with_data_parallel`]).
    data_parallel: Option<mlx_array::distributed::Group>,
}

fn model_err(e: impl std::fmt::Display) -> mlx_array::Error {
    mlx_array::Error::InvalidArgument { op: "sft loss", msg: e.to_string() }
}

/// A batch as arrays: `inputs` `[B, W]`, `positions` `[N]` (flat indices into `B * W` of the
/// loss positions) and `targets` `[N]`.
struct BatchArrays {
    inputs: Array,
    positions: Array,
    targets: Array,
}

impl BatchArrays {
    fn of(batch: &Batch) -> mlx_array::Result<Self> {
        let n = batch.positions.len();
        Ok(BatchArrays { inputs: batch.inputs.clone(), positions: Array::from_slice(&batch.positions, &[n])?, targets: Array::from_slice(&batch.targets, &[n])? })
    }
}

/// The batch loss as a function of the trainable parameters (for `value_and_grad`): the tree
/// (its frozen parameters and structure), build options, head and settings it depends on.
struct LossFn<'a> {
    tree: &'a ParameterTree,
    opts: &'a LoadOptions,
    head: &'a Head,
    label_smoothing: f32,
    checkpointed: bool,
}

impl LossFn<'_> {
    /// The mean loss over the batch's loss positions: through the chunked head's matrix applied
    /// to the loss positions' hidden rows in one piece (one forward and one backward pass,
    /// holding `[N, V]` logits: as much as one chunk; used when the `N` positions fit in one),
    /// or through the model's own full logits.
    fn loss(&self, params: &[Array], b: &BatchArrays) -> mlx_array::Result<Array> {
        let tree = self.tree.with_trainable(params).map_err(model_err)?;
        let model: Model = tree.build(self.opts).and_then(|m| m.into_lm()).map_err(model_err)?;
        let rows = match self.head {
            Head::Chunked { .. } => SftTrainer::head_logits(&tree, self.head, &hidden_rows(&model, b, self.checkpointed)?)?,
            Head::Model => {
                let mut cache = model.new_cache();
                cache.set_gradient_checkpointing(self.checkpointed);
                let out = model.forward(&b.inputs, &mut cache, Logits::All, false).map_err(model_err)?;
                let l = out.logits.ok_or_else(|| model_err("the model returned no logits"))?;
                l.reshape(&[b.inputs.size() as i32, -1])?.take(&b.positions, 0)?.astype(DType::F32)?
            }
        };
        let (total, _) = loss_sum(self.label_smoothing, &rows, &b.targets)?;
        total.mul_scalar(1.0 / b.positions.size() as f32)
    }
}

/// Hidden rows `[N, H]` of the batch's loss positions (final-normed hidden states), the layers
/// checkpointed when `checkpointed`.
fn hidden_rows(model: &Model, b: &BatchArrays, checkpointed: bool) -> mlx_array::Result<Array> {
    let mut cache = model.new_cache();
    cache.set_gradient_checkpointing(checkpointed);
    let out = model.forward(&b.inputs, &mut cache, Logits::None, true).map_err(model_err)?;
    let h = out.hidden.ok_or_else(|| model_err("the model returned no hidden states"))?;
    h.reshape(&[b.inputs.size() as i32, -1])?.take(&b.positions, 0)
}

/// Per-row loss terms of `logits` (`[n, V]` f32) for `targets` (`[n]`), with label smoothing
/// `eps`: `(1 - ε) nll + ε (lse - mean)`, summed, with the row-wise `lse` (`[n, 1]`).
fn loss_sum(eps: f32, logits: &Array, targets: &Array) -> mlx_array::Result<(Array, Array)> {
    let t = targets.reshape(&[-1, 1])?.astype(DType::I32)?;
    let lse = logits.logsumexp(&[-1], true)?;
    let nll = lse.sub(&logits.take_along_axis(&t, -1)?)?;
    let per = if eps > 0.0 {
        let smooth = lse.sub(&logits.mean(&[-1], true)?)?;
        nll.mul_scalar(1.0 - eps)?.add(&smooth.mul_scalar(eps)?)?
    } else {
        nll
    };
    Ok((per.sum(&[], false)?, lse))
}

impl SftTrainer {
    /// A trainer over `tree` (loaded with `opts`; models are built with a flat KV cache, which a
    /// gradient transform needs) and `examples`.
    pub fn new(tree: ParameterTree, opts: &LoadOptions, examples: Vec<Example>, config: SftConfig) -> Result<Self> {
        config.validate()?;
        if examples.is_empty() {
            return Err(TrainError::InvalidInput("no training examples".into()));
        }
        if tree.trainable_names().is_empty() {
            return Err(TrainError::InvalidInput("no trainable parameter".into()));
        }
        check_lora(&tree, &config)?;
        let optimizer = Optimizer::new(config.optimizer)?;
        let rng0 = config.seed ^ 0x5EED_5EED_5EED_5EED;
        let (order, _) = epoch_order(examples.len(), config.shuffle, rng0);
        let progress = Progress { step: 0, epoch: 0, position: 0, epoch_rng: rng0, order };
        Self::assemble(tree, opts, examples, config, optimizer, progress)
    }

    fn assemble(tree: ParameterTree, opts: &LoadOptions, examples: Vec<Example>, config: SftConfig, optimizer: Optimizer, progress: Progress) -> Result<Self> {
        let opts = LoadOptions { kv_cache: KvCacheMode::Flat, ..opts.clone() };
        let cfg: serde_json::Value = {
            let p = tree.dir().join("config.json");
            serde_json::from_str(&std::fs::read_to_string(&p).map_err(crate::error::io_err(&p))?).map_err(|e| TrainError::State { path: p, msg: e.to_string() })?
        };
        let pad_id = config.pad_id.or_else(|| cfg.get("pad_token_id").and_then(|v| v.as_u64()).and_then(|v| u32::try_from(v).ok())).unwrap_or(0);
        let guard = NanGuard::new(config.max_nan_gradients);
        let mut t = SftTrainer { tree, opts, config, examples, optimizer, progress, head: Head::Model, pad_id, guard, data_parallel: None };
        t.head = t.pick_head(&cfg)?;
        Ok(t)
    }

    /// The chunked head when it reproduces the model's logits on a probe sequence.
    fn pick_head(&self, cfg: &serde_json::Value) -> Result<Head> {
        if !self.config.chunked_head {
            return Ok(Head::Model);
        }
        let text = cfg.get("text_config").unwrap_or(cfg);
        let tied = text.get("tie_word_embeddings").or_else(|| cfg.get("tie_word_embeddings")).and_then(|v| v.as_bool()).unwrap_or(false);
        let names: Vec<&str> = self.tree.iter().map(|(n, _)| n).collect();
        let weight = if let Some(n) = names.iter().find(|n| n.ends_with("lm_head.weight")) {
            n.to_string()
        } else if let (true, Some(n)) = (tied, names.iter().find(|n| n.ends_with("embed_tokens.weight"))) {
            n.to_string()
        } else {
            return Ok(Head::Model);
        };
        let adapted = weight.strip_suffix(".weight").is_some_and(|p| self.tree.get(&format!("{p}.lora_a")).is_some());
        if adapted || self.tree.get(&weight).is_none_or(|p| p.packed || p.array.ndim() != 2) {
            return Ok(Head::Model);
        }
        let softcap = text.get("final_logit_softcapping").and_then(|v| v.as_f64()).map(|v| v as f32);
        let head = Head::Chunked { weight, softcap };
        let model = self.tree.build(&self.opts)?.into_lm()?;
        let vocab = model.info().vocab_size;
        let probe: Vec<u32> = (0..8u32).map(|i| (i * 7 + 1) % vocab as u32).collect();
        let tokens = Array::from_slice(&probe, &[1, probe.len()])?;
        let mut cache = model.new_cache();
        let out = model.forward(&tokens, &mut cache, Logits::All, true)?;
        let (Some(want), Some(h)) = (out.logits, out.hidden) else { return Ok(Head::Model) };
        let got = Self::head_logits(&self.tree, &head, &h.reshape(&[probe.len() as i32, -1])?)?;
        let want = want.reshape(&[probe.len() as i32, -1])?.astype(DType::F32)?;
        let scale = want.abs()?.max(&[], false)?.item::<f32>()?.max(1e-6);
        let err = got.sub(&want)?.abs()?.max(&[], false)?.item::<f32>()? / scale;
        Ok(if err < 1e-4 { head } else { Head::Model })
    }

    /// Whether the chunked head is in use (see the module docs).
    pub fn uses_chunked_head(&self) -> bool {
        matches!(self.head, Head::Chunked { .. })
    }

    /// Logits of hidden rows `h` (`[N, H]`) through the chunked head, with `tree`'s head weight.
    fn head_logits(tree: &ParameterTree, head: &Head, h: &Array) -> mlx_array::Result<Array> {
        let Head::Chunked { weight, softcap } = head else { return Err(model_err("not a chunked head")) };
        let w = tree.get(weight).ok_or_else(|| model_err(format!("no parameter {weight}")))?.array.astype(DType::F32)?;
        let logits = h.astype(DType::F32)?.matmul(&w.transpose(&[1, 0])?)?;
        match softcap {
            Some(c) => logits.softcap(*c),
            None => Ok(logits),
        }
    }

    /// What the batch loss depends on besides the trainable parameters and the batch.
    fn loss_fn(&self) -> LossFn<'_> {
        LossFn { tree: &self.tree, opts: &self.opts, head: &self.head, label_smoothing: self.config.label_smoothing as f32, checkpointed: self.config.gradient_checkpointing }
    }

    /// Loss and gradients with the chunked head, never holding more than `head_chunk` rows of
    /// logits: (1) the hidden rows `h` of the loss positions are computed; (2) chunk by chunk, the
    /// loss, `dL/dlogits = ((1 - ε)(softmax - onehot) + ε (softmax - 1/V)) / N` (times the
    /// softcap's derivative), `dL/dh = dlogits W` and the head's `dL/dW += dlogitsᵀ h` are
    /// computed and evaluated; (3) the model body's gradients are those of `sum(h(θ) · dL/dh)`
    /// (the vector-Jacobian product through the body, one more forward pass); the head's
    /// `dL/dW` is added to its parameter's gradient when it is trained.
    fn chunked_gradients(&self, batch: &Batch, weight: &str, softcap: Option<f32>) -> Result<(f32, Vec<Array>)> {
        let b = BatchArrays::of(batch)?;
        let model = self.tree.build(&self.opts)?.into_lm()?;
        let h = hidden_rows(&model, &b, false)?.astype(DType::F32)?;
        h.eval()?;
        let w = self.tree.get(weight).ok_or_else(|| TrainError::InvalidInput(format!("no parameter {weight}")))?.array.astype(DType::F32)?;
        let (n, vocab) = (batch.positions.len(), w.dim(0)?);
        let eps = self.config.label_smoothing as f32;
        let inv_n = 1.0 / n as f32;
        let classes = Array::arange(0, vocab as i64, DType::I32)?.reshape(&[1, -1])?;
        let (mut loss, mut dh_parts, mut dw): (f64, Vec<Array>, Option<Array>) = (0.0, Vec::new(), None);
        let mut start = 0;
        while start < n {
            let end = (start + self.config.head_chunk).min(n);
            let hc = h.slice_axis(0, start, end)?;
            let raw = hc.matmul(&w.transpose(&[1, 0])?)?;
            let z = match softcap {
                Some(c) => raw.softcap(c)?,
                None => raw,
            };
            let targets = b.targets.slice_axis(0, start, end)?;
            let (sum, lse) = loss_sum(eps, &z, &targets)?;
            let p = z.sub(&lse)?.exp()?;
            let t = targets.reshape(&[-1, 1])?.astype(DType::I32)?;
            let onehot = classes.eq(&t)?.astype(DType::F32)?;
            let mut dz = p.sub(&onehot.mul_scalar(1.0 - eps)?)?;
            if eps > 0.0 {
                dz = dz.add_scalar(-eps / vocab as f32)?;
            }
            let mut draw = dz.mul_scalar(inv_n)?;
            if let Some(c) = softcap {
                // d(c tanh(x / c))/dx = 1 - (z / c)^2
                draw = draw.mul(&z.mul_scalar(1.0 / c)?.square()?.mul_scalar(-1.0)?.add_scalar(1.0)?)?;
            }
            let dhc = draw.matmul(&w)?;
            let dwc = draw.transpose(&[1, 0])?.matmul(&hc)?;
            let dw_new = match dw.take() {
                Some(acc) => acc.add(&dwc)?,
                None => dwc,
            };
            mlx_array::eval(&[&sum, &dhc, &dw_new])?;
            loss += sum.item::<f32>()? as f64;
            dh_parts.push(dhc);
            dw = Some(dw_new);
            start = end;
        }
        let dh = mlx_array::ops::concatenate(&dh_parts.iter().collect::<Vec<_>>(), 0)?;
        let params = self.tree.trainable_arrays();
        let (_, mut grads) = value_and_grad(
            |p| {
                let m: Model = self.tree.with_trainable(p).and_then(|t| t.build(&self.opts)).and_then(|m| m.into_lm()).map_err(model_err)?;
                hidden_rows(&m, &b, self.config.gradient_checkpointing)?.astype(DType::F32)?.mul(&dh)?.sum(&[], false)
            },
            &params,
        )?;
        if let (Some(i), Some(dw)) = (self.tree.trainable_names().iter().position(|n| *n == weight), dw) {
            grads[i] = grads[i].add(&dw.astype(grads[i].dtype())?)?;
        }
        mlx_array::eval(&grads.iter().collect::<Vec<_>>())?;
        Ok(((loss / n as f64) as f32, grads))
    }

    /// Loss and gradients (of the trainable parameters, in [`ParameterTree::trainable_names`]
    /// order) of one batch of examples, without updating anything.
    pub fn loss_and_gradients(&self, examples: &[&Example]) -> Result<(f32, Vec<Array>)> {
        let batch = make_batch(examples, self.pad_id)?;
        self.batch_gradients(&batch)
    }

    fn batch_gradients(&self, batch: &Batch) -> Result<(f32, Vec<Array>)> {
        // the untraced forward of the chunked head computes what the traced one does
        let _ops = mlx_array::ops::mlx_ops_only();
        if let Head::Chunked { weight, softcap } = &self.head {
            if batch.positions.len() > self.config.head_chunk {
                return self.chunked_gradients(batch, weight, *softcap);
            }
        }
        let b = BatchArrays::of(batch)?;
        let params = self.tree.trainable_arrays();
        let f = self.loss_fn();
        let (loss, grads) = value_and_grad(|p| f.loss(p, &b), &params)?;
        let mut all: Vec<&Array> = grads.iter().collect();
        all.push(&loss);
        mlx_array::eval(&all)?;
        Ok((loss.item::<f32>()?, grads))
    }

    /// Whether the run is over (`max_steps` updates applied, or the last epoch's data used).
    pub fn is_done(&self) -> bool {
        let p = &self.progress;
        match self.config.max_steps {
            Some(n) => p.step >= n,
            None => p.position >= p.order.len() && p.epoch + 1 >= self.config.epochs,
        }
    }

    /// One optimizer update; `None` when the run is over.
    pub fn step(&mut self) -> Result<Option<StepMetrics>> {
        if self.is_done() {
            return Ok(None);
        }
        let started = Instant::now();
        let mut acc: Option<Vec<Array>> = None;
        let (mut count, mut loss_sum, mut loss_tokens, mut tokens) = (0usize, 0f64, 0usize, 0usize);
        while count < self.config.grad_accumulation {
            let p = &mut self.progress;
            if p.position >= p.order.len() {
                if count > 0 {
                    break; // the epoch's leftover micro-batches
                }
                if self.config.max_steps.is_none() && p.epoch + 1 >= self.config.epochs {
                    return Ok(None);
                }
                let (_, next_rng) = epoch_order(p.order.len(), self.config.shuffle, p.epoch_rng);
                let (order, _) = epoch_order(p.order.len(), self.config.shuffle, next_rng);
                p.epoch += 1;
                p.epoch_rng = next_rng;
                p.order = order;
                p.position = 0;
            }
            let end = (p.position + self.config.batch_size).min(p.order.len());
            let picked: Vec<&Example> = p.order[p.position..end].iter().map(|&i| &self.examples[i]).collect();
            p.position = end;
            // Data parallel: this rank's share of the batch, gradients averaged over the ranks.
            let picked = match &self.data_parallel {
                Some(g) => picked[crate::distributed::rank_share(picked.len(), g.rank(), g.size())?].to_vec(),
                None => picked,
            };
            let batch = make_batch(&picked, self.pad_id)?;
            let dropout_seed = lora_dropout_seed(self.config.seed, self.progress.step, count);
            self.set_lora_dropout(Some(dropout_seed));
            let result = self.batch_gradients(&batch);
            self.set_lora_dropout(None);
            let (loss, grads) = result?;
            let (loss, grads, positions, batch_tokens) = match &self.data_parallel {
                Some(g) => {
                    let r = crate::distributed::reduce_gradients(g, loss, batch.positions.len(), batch.tokens, &grads)?;
                    (r.loss, r.grads, r.positions, r.tokens)
                }
                None => (loss, grads, batch.positions.len(), batch.tokens),
            };
            loss_sum += loss as f64;
            loss_tokens += positions;
            tokens += batch_tokens;
            count += 1;
            acc = Some(match acc {
                None => grads,
                Some(a) => {
                    let s: Vec<Array> = a.iter().zip(&grads).map(|(x, g)| x.add(g)).collect::<mlx_array::Result<_>>()?;
                    mlx_array::eval(&s.iter().collect::<Vec<_>>())?;
                    s
                }
            });
        }
        let mut grads = acc.ok_or_else(|| TrainError::InvalidInput("no micro-batch".into()))?;
        if count > 1 {
            let inv = 1.0 / count as f32;
            grads = grads.iter().map(|g| g.mul_scalar(inv)).collect::<mlx_array::Result<_>>()?;
        }
        // clipping by value would hide infinities: judge the unclipped gradients then
        let unclipped_norm = match self.config.clip.max_value {
            Some(_) => Some(crate::optim::global_norm(&grads)?.item::<f32>()?),
            None => None,
        };
        let (grads, grad_norm) = clip_gradients(grads, &self.config.clip)?;
        let lr = self.config.schedule.lr_at(self.progress.step);
        let loss = (loss_sum / count as f64) as f32;
        let mut metrics = StepMetrics {
            step: self.progress.step,
            epoch: self.progress.epoch,
            loss,
            loss_tokens,
            tokens,
            micro_batches: count,
            lr,
            grad_norm,
            seconds: 0.0,
            skipped: true,
        };
        match self.guard.check(loss, unclipped_norm.unwrap_or(grad_norm)) {
            Verdict::Apply => metrics.skipped = false,
            Verdict::Skip { .. } => {
                metrics.seconds = started.elapsed().as_secs_f64();
                return Ok(Some(metrics));
            }
            Verdict::Stop { skipped } => return Err(TrainError::NanGradients { skipped, max: self.guard.max_nan_gradients() }),
        }
        let names: Vec<String> = self.tree.trainable_names().iter().map(|s| s.to_string()).collect();
        let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let new = self.optimizer.update(&name_refs, &self.tree.trainable_arrays(), &grads, lr)?;
        self.tree = self.tree.with_trainable(&new)?;
        self.progress.step += 1;
        metrics.step = self.progress.step;
        metrics.seconds = started.elapsed().as_secs_f64();
        Ok(Some(metrics))
    }

    /// Updates skipped so far for non-finite gradients ([`crate::guard`]).
    pub fn nan_skipped(&self) -> u64 {
        self.guard.skipped()
    }

    /// Train data parallel over `group`'s ranks ([`crate::distributed`]): every rank runs the
    /// same trainer (same model, data, config and seed); each computes the gradients of its
    /// share of every batch ([`crate::distributed::rank_share`]) and the ranks average them
    /// before the update, so the parameters, optimizer state and metrics stay the same on every
    /// rank and equal a single process's on the whole batch (up to f32 summation order). Every
    /// batch needs at least one example per rank. A group of one changes nothing. Saving is
    /// the caller's choice: one rank (rank 0) is enough, every rank holding the same state.
    pub fn with_data_parallel(mut self, group: mlx_array::distributed::Group) -> Self {
        self.data_parallel = Some(group).filter(|g| g.size() > 1);
        self
    }

    /// Updates applied so far.
    pub fn steps_done(&self) -> u64 {
        self.progress.step
    }

    /// The number of updates the run makes in all (`max_steps`, or what the epochs give).
    pub fn total_steps(&self) -> u64 {
        if let Some(n) = self.config.max_steps {
            return n;
        }
        let batches = self.examples.len().div_ceil(self.config.batch_size);
        (batches.div_ceil(self.config.grad_accumulation) as u64) * self.config.epochs
    }

    pub fn tree(&self) -> &ParameterTree {
        &self.tree
    }

    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    pub fn config(&self) -> &SftConfig {
        &self.config
    }

    /// The progress a checkpoint records.
    pub fn trainer_state(&self) -> TrainerState {
        let p = &self.progress;
        TrainerState {
            step: p.step,
            epoch: p.epoch,
            position: p.position,
            epoch_rng: p.epoch_rng,
            seed: self.config.seed,
            dataset_len: self.examples.len(),
            trainable: self.tree.trainable_names().iter().map(|s| s.to_string()).collect(),
            optimizer: match self.config.optimizer {
                OptimizerConfig::AdamW(_) => "adamw".into(),
                OptimizerConfig::Sgd(_) => "sgd".into(),
            },
            batch_size: self.config.batch_size,
            grad_accumulation: self.config.grad_accumulation,
            shuffle: self.config.shuffle,
            nan_skipped: self.guard.skipped(),
        }
    }

    /// LoRA dropout masks of the next gradient computations drawn from `seed` (`None`: no dropout).
    fn set_lora_dropout(&mut self, seed: Option<u64>) {
        if let Some(s) = self.tree.lora().filter(|s| s.dropout > 0.0) {
            let s = LoraSettings { dropout_seed: seed, ..s.clone() };
            self.tree.set_lora(Some(s));
        }
    }

    /// Save model, optimizer and trainer state to `dir` atomically (weights in `save_dtype`,
    /// or as trained when `None`). With LoRA, the adapters (`adapters.safetensors`,
    /// `adapter_config.json`, in their f32) take the model's place.
    pub fn save(&self, dir: &Path, save_dtype: Option<DType>) -> Result<()> {
        if let Some(lora) = &self.config.lora {
            let trainer = self.trainer_state();
            return state::write_dir_atomically(dir, |tmp| {
                crate::lora::write_adapter_files(tmp, &self.tree, lora)?;
                state::write_training_state(tmp, &self.optimizer, &trainer)
            });
        }
        let arrays: Vec<(String, Array)> = self.tree.iter().map(|(n, p)| (n.to_string(), p.array.clone())).collect();
        let params: Vec<(&str, &Array)> = arrays.iter().map(|(n, a)| (n.as_str(), a)).collect();
        let trainer = self.trainer_state();
        state::save_checkpoint(dir, &CheckpointContents { params, save_dtype, source_dir: self.tree.dir(), optimizer: &self.optimizer, trainer: &trainer })
    }

    /// [`SftTrainer::save`] of a LoRA run, with the model with its adapters fused
    /// ([`crate::lora::fuse_lora`]) written next to them in Hugging Face's layout
    /// (`model.safetensors` in `dtype` when given, config and tokenizer files), in one atomic
    /// directory write.
    pub fn save_fused(&self, dir: &Path, dtype: Option<DType>) -> Result<()> {
        let lora = self.config.lora.as_ref().ok_or_else(|| TrainError::InvalidInput("save_fused: not a LoRA run".into()))?;
        let fused = crate::lora::fuse_lora(&self.tree)?;
        let arrays: Vec<(String, Array)> = fused.iter().map(|(n, p)| (n.to_string(), p.array.clone())).collect();
        let params: Vec<(&str, &Array)> = arrays.iter().map(|(n, a)| (n.as_str(), a)).collect();
        let trainer = self.trainer_state();
        state::write_dir_atomically(dir, |tmp| {
            crate::lora::write_adapter_files(tmp, &self.tree, lora)?;
            state::write_training_state(tmp, &self.optimizer, &trainer)?;
            state::write_model_files(tmp, state::MODEL_FILE, &params, dtype, self.tree.dir())
        })
    }

    /// Continue the run saved in `dir` (model, optimizer and progress), with the same
    /// `examples` and `config` as the run that saved it.
    pub fn resume(dir: &Path, opts: &LoadOptions, examples: Vec<Example>, config: SftConfig) -> Result<Self> {
        Self::resume_with_base(dir, None, opts, examples, config)
    }

    /// [`SftTrainer::resume`] for a checkpoint of either kind: a LoRA checkpoint (adapters, no
    /// model) is continued over `base` (the model it was trained from), whose adapters are
    /// those saved; `config.lora` is then taken from the checkpoint's `adapter_config.json`.
    pub fn resume_with_base(dir: &Path, base: Option<ParameterTree>, opts: &LoadOptions, examples: Vec<Example>, mut config: SftConfig) -> Result<Self> {
        config.validate()?;
        let dir = state::resolve_checkpoint(dir)?;
        let saved = state::read_trainer_state(&dir)?;
        let bad = |msg: String| TrainError::State { path: dir.join(state::TRAINER_STATE_FILE), msg };
        if saved.dataset_len != examples.len() {
            return Err(bad(format!("saved for {} examples, given {}", saved.dataset_len, examples.len())));
        }
        if saved.seed != config.seed {
            return Err(bad(format!("saved with seed {}, given {}", saved.seed, config.seed)));
        }
        let kind = match config.optimizer {
            OptimizerConfig::AdamW(_) => "adamw",
            OptimizerConfig::Sgd(_) => "sgd",
        };
        if saved.optimizer != kind {
            return Err(bad(format!("saved with optimizer {}, given {kind}", saved.optimizer)));
        }
        if (saved.batch_size, saved.grad_accumulation, saved.shuffle) != (config.batch_size, config.grad_accumulation, config.shuffle) {
            return Err(bad(format!(
                "saved with batch size {}, accumulation {}, shuffle {}; given {}, {}, {}",
                saved.batch_size, saved.grad_accumulation, saved.shuffle, config.batch_size, config.grad_accumulation, config.shuffle
            )));
        }
        let mut tree = if dir.join(crate::lora::ADAPTERS_FILE).is_file() {
            let mut tree = base.ok_or_else(|| bad(format!("a LoRA checkpoint ({}) continues over its base model, which was not given", crate::lora::ADAPTERS_FILE)))?;
            config.lora = Some(crate::lora::load_adapters(&mut tree, &dir)?);
            tree
        } else {
            ParameterTree::load(&dir, opts)?
        };
        tree.freeze(|_| true);
        let names: Vec<String> = saved.trainable.clone();
        for n in &names {
            if tree.unfreeze(|k| k == n) != 1 {
                return Err(bad(format!("trainable parameter {n} is not in the saved model (or cannot be trained)")));
            }
        }
        let mut optimizer = Optimizer::new(config.optimizer)?;
        let opt_file = dir.join(state::OPTIMIZER_FILE);
        if opt_file.is_file() {
            let refs: Vec<&str> = tree.trainable_names();
            let shapes: Vec<Vec<usize>> = tree.trainable_arrays().iter().map(|a| a.shape()).collect();
            state::load_optimizer_state(&mut optimizer, &opt_file, &refs, &shapes)?;
        } else if optimizer.has_state() && saved.step > 0 {
            return Err(bad(format!("{} updates done but no {}", saved.step, state::OPTIMIZER_FILE)));
        } else {
            optimizer.set_step(saved.step);
        }
        if optimizer.step() != saved.step {
            return Err(bad(format!("trainer step {} but optimizer step {}", saved.step, optimizer.step())));
        }
        let (order, _) = epoch_order(examples.len(), config.shuffle, saved.epoch_rng);
        if saved.position > order.len() {
            return Err(bad(format!("position {} past the {} examples", saved.position, order.len())));
        }
        let progress = Progress { step: saved.step, epoch: saved.epoch, position: saved.position, epoch_rng: saved.epoch_rng, order };
        let mut t = Self::assemble(tree, opts, examples, config, optimizer, progress)?;
        t.guard = t.guard.clone().with_skipped(saved.nan_skipped);
        Ok(t)
    }
}
