//! Group Relative Policy Optimization: [`GrpoTrainer`] updates a policy from groups of
//! completions of the same prompt and their rewards, as TRL's `GRPOTrainer` computes the loss.
//!
//! One step takes a [`GrpoBatch`] (groups of `group_size` consecutive completions, each with its
//! reward from every reward function):
//!
//! * rewards: the weighted sum of the functions' rewards (a function's NaN counts as 0; a
//!   completion whose every reward is NaN is unscorable: left out of the group statistics, its
//!   advantage 0);
//! * advantages (TRL's `scale_rewards`): `r - mean(group)`, divided by `std + 1e-4` with `std` the
//!   group's ([`ScaleRewards::Group`]) or the whole batch's ([`ScaleRewards::Batch`]) unbiased
//!   standard deviation, or not divided ([`ScaleRewards::None`]);
//! * per-token log-probs `logp` of the completion tokens under the policy (temperature 1), `old`
//!   the batch's recorded old log-probs or, by default, `logp` itself as a constant (one update
//!   per generation: the ratio is 1 but its gradient is not 0), and `ref` under the frozen
//!   reference model when `beta > 0`;
//! * importance weight `w = exp(logp - old)` per token ([`ImportanceSampling::Token`]) or
//!   `exp(mean over the sequence of (logp - old))` per sequence (GSPO,
//!   [`ImportanceSampling::Sequence`]);
//! * per-token loss `-min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A) + beta k3` with the k3
//!   estimator `k3 = exp(ref - logp) - (ref - logp) - 1`;
//! * normalisation ([`LossType`]): `grpo` the mean over sequences of each sequence's mean,
//!   `bnpo` the sum over the micro-batch's completion tokens divided by their count, `dr_grpo`
//!   the sum divided by `sequences x max_completion_length`, `dapo` the sum divided by the
//!   completion tokens of the whole step (all micro-batches). With `micro_batch_size` the step's
//!   completions are split into micro-batches whose gradients add up; `grpo`, `bnpo` and
//!   `dr_grpo` divide each micro-batch's loss by the number of micro-batches (TRL's gradient
//!   accumulation).
//!
//! Gradients come in two passes, so that the loss's dependence on the parameters runs only
//! through `logp`: the loss is differentiated with respect to the `[N, T]` log-probs (`g`), then
//! the model with respect to `sum(logp(θ) · g)`. With the chunked head (the default, used when
//! the head is `lm_head.weight` or tied embeddings, optionally soft-capped, and reproduces the
//! model's logits on a probe sequence at construction, as [`crate::SftTrainer`] does) the
//! logits exist only for `head_chunk` completion positions at a time: `logp` from the final
//! hidden rows chunk by chunk; `dL/dz = g (onehot - softmax(z))` (times the softcap's
//! derivative), `dL/dh = dz W` and the head's `dL/dW += dzᵀ h` per chunk; the body's gradients
//! are those of `sum(h(θ) · dL/dh)`. Otherwise the model's full `[N, L, V]` logits are used.
//! With [`GrpoConfig::gradient_checkpointing`] the model pass of the gradients runs every
//! decoder layer checkpointed (the log-prob pass before it, which keeps no graph, runs plain).
//!
//! Each update clips the global gradient norm and applies the optimizer. An update whose loss
//! or gradients are not finite is skipped (parameters and optimizer state unchanged) and counted
//! by the NaN guard ([`crate::guard`]); past `max_nan_gradients` skipped updates the step fails
//! with [`TrainError::NanGradients`], the trainer still holding the last finite parameters (the
//! caller saves them as an emergency checkpoint).
use crate::error::{Result, TrainError};
use crate::guard::{NanGuard, Verdict};
use crate::lora::LoraConfig;
use crate::optim::{clip_gradients, ClipConfig, Optimizer, OptimizerConfig, Schedule};
use crate::state::{self, TrainerState};
use mlx_array::grad::value_and_grad;
use mlx_array::{Array, DType};
use mlx_models::{KvCacheMode, LoadOptions, Logits, Model, ParameterTree};
use std::path::Path;
use std::time::Instant;

/// How the per-token losses are normalised (TRL's `loss_type`). Default: `dapo` (TRL's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    Grpo,
    #[default]
    Dapo,
    DrGrpo,
    Bnpo,
}

/// How advantages are scaled (TRL's `scale_rewards`). Default: `group`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRewards {
    #[default]
    Group,
    Batch,
    None,
}

/// Importance-sampling level (TRL's `importance_sampling_level`). Default: `token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSampling {
    #[default]
    Token,
    /// One weight per sequence, from the mean token log-ratio (GSPO).
    Sequence,
}

/// GRPO settings. Defaults: group size 4, learning rate 1e-6 constant and
/// at most 100 skipped non-finite updates (mlx-node's); loss `dapo`, `beta` 0, `epsilon` 0.2, `epsilon_high` = `epsilon`, `token`
/// importance sampling, `group` reward scaling, `max_completion_length` 512 (TRL's); AdamW with
/// the global gradient norm clipped to 1.0; the whole step in one micro-batch.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoConfig {
    pub group_size: usize,
    pub loss: LossType,
    /// Weight of the k3 KL term to the reference model (0: no reference model is run).
    pub beta: f64,
    pub epsilon: f64,
    /// Upper clipping bound `1 + epsilon_high` (`None`: `epsilon`).
    pub epsilon_high: Option<f64>,
    pub scale_rewards: ScaleRewards,
    pub importance_sampling: ImportanceSampling,
    /// Longest completion: sampling stops there, a longer recorded completion is an error, and
    /// `dr_grpo` divides by it.
    pub max_completion_length: usize,
    /// Completions per micro-batch (`None`: all of the step's at once).
    pub micro_batch_size: Option<usize>,
    pub schedule: Schedule,
    pub optimizer: OptimizerConfig,
    pub clip: ClipConfig,
    /// Skipped non-finite updates allowed before the run stops ([`crate::guard`]).
    pub max_nan_gradients: u64,
    /// Use the chunked head when it reproduces the model's logits (default true; see the module
    /// docs); `false` always computes the model's full logits.
    pub chunked_head: bool,
    /// Completion positions per head chunk (default 1024).
    pub head_chunk: usize,
    /// Padding id (`None`: the config's `pad_token_id`, else 0).
    pub pad_id: Option<u32>,
    /// Per-layer gradient checkpointing in the policy's gradient pass
    /// ([`mlx_models::Cache::set_gradient_checkpointing`]): each decoder layer keeps only its
    /// inputs and is recomputed in the backward pass (less memory, one more forward pass
    /// through the layers). Default false.
    pub gradient_checkpointing: bool,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig {
            group_size: 4,
            loss: LossType::default(),
            beta: 0.0,
            epsilon: 0.2,
            epsilon_high: None,
            scale_rewards: ScaleRewards::default(),
            importance_sampling: ImportanceSampling::default(),
            max_completion_length: 512,
            micro_batch_size: None,
            schedule: Schedule {
                lr: 1e-6,
                ..Default::default()
            },
            optimizer: OptimizerConfig::default(),
            clip: ClipConfig {
                max_norm: Some(1.0),
                max_value: None,
            },
            max_nan_gradients: crate::guard::DEFAULT_MAX_NAN_GRADIENTS,
            chunked_head: true,
            head_chunk: 1024,
            pad_id: None,
            gradient_checkpointing: false,
        }
    }
}

impl GrpoConfig {
    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Config(m));
        if self.group_size < 2 {
            return bad(format!(
                "group_size must be >= 2 (advantages compare completions of a group), got {}",
                self.group_size
            ));
        }
        if !(self.beta.is_finite() && self.beta >= 0.0) {
            return bad(format!("beta must be finite and >= 0, got {}", self.beta));
        }
        if !(self.epsilon.is_finite() && (0.0..1.0).contains(&self.epsilon)) {
            return bad(format!("epsilon must lie in [0, 1), got {}", self.epsilon));
        }
        if let Some(e) = self.epsilon_high {
            if !(e.is_finite() && e >= 0.0) {
                return bad(format!("epsilon_high must be finite and >= 0, got {e}"));
            }
        }
        if self.max_completion_length == 0 {
            return bad("max_completion_length must be >= 1".into());
        }
        if self.head_chunk == 0 {
            return bad("head_chunk must be >= 1".into());
        }
        if self.micro_batch_size == Some(0) {
            return bad("micro_batch_size must be >= 1".into());
        }
        self.schedule.validate()
    }

    fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }
}

/// One completion of a prompt with its rewards.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// One reward per reward function of the batch (NaN: the function did not score it).
    pub rewards: Vec<f64>,
}

/// The completions of one step: `completions.len() / group_size` groups of consecutive
/// completions of the same prompt, scored by the reward functions `reward_names`, combined with
/// `reward_weights`.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoBatch {
    pub completions: Vec<Completion>,
    pub reward_names: Vec<String>,
    pub reward_weights: Vec<f64>,
    /// Per-token log-probs of the completions under the policy that sampled them (`None`: the
    /// current policy's, as constants).
    pub old_logprobs: Option<Vec<Vec<f32>>>,
}

impl GrpoBatch {
    /// A batch scored by a single reward function named `reward` (weight 1): `rewards[i]` is
    /// completion `i`'s.
    pub fn single_reward(completions: Vec<(Vec<u32>, Vec<u32>)>, rewards: &[f64]) -> Result<Self> {
        if completions.len() != rewards.len() {
            return Err(TrainError::InvalidInput(format!(
                "{} completions and {} rewards",
                completions.len(),
                rewards.len()
            )));
        }
        Ok(GrpoBatch {
            completions: completions
                .into_iter()
                .zip(rewards)
                .map(|((p, c), r)| Completion {
                    prompt_ids: p,
                    completion_ids: c,
                    rewards: vec![*r],
                })
                .collect(),
            reward_names: vec!["reward".into()],
            reward_weights: vec![1.0],
            old_logprobs: None,
        })
    }

    /// Each completion's combined reward: the weighted sum of its rewards, NaN ones left out,
    /// NaN when all are.
    pub fn total_rewards(&self) -> Vec<f64> {
        self.completions
            .iter()
            .map(|c| {
                if c.rewards.iter().all(|r| r.is_nan()) {
                    return f64::NAN;
                }
                c.rewards
                    .iter()
                    .zip(&self.reward_weights)
                    .filter(|(r, _)| !r.is_nan())
                    .map(|(r, w)| r * w)
                    .sum()
            })
            .collect()
    }

    fn validate(&self, group_size: usize, max_completion_length: usize) -> Result<()> {
        let bad = |m: String| Err(TrainError::InvalidInput(m));
        let n = self.completions.len();
        if let Some((i, c)) = self
            .completions
            .iter()
            .enumerate()
            .find(|(_, c)| c.completion_ids.len() > max_completion_length)
        {
            return bad(format!("completion {i} has {} tokens, more than max_completion_length {max_completion_length}", c.completion_ids.len()));
        }
        if n == 0 || n % group_size != 0 {
            return bad(format!(
                "{n} completions do not make whole groups of {group_size}"
            ));
        }
        if self.reward_names.is_empty() || self.reward_names.len() != self.reward_weights.len() {
            return bad(format!(
                "{} reward names and {} weights",
                self.reward_names.len(),
                self.reward_weights.len()
            ));
        }
        if let Some(w) = self.reward_weights.iter().find(|w| !w.is_finite()) {
            return bad(format!("reward weight {w}"));
        }
        for (i, c) in self.completions.iter().enumerate() {
            if c.prompt_ids.is_empty() {
                return bad(format!("completion {i}: empty prompt"));
            }
            if c.rewards.len() != self.reward_names.len() {
                return bad(format!(
                    "completion {i}: {} rewards for {} reward functions",
                    c.rewards.len(),
                    self.reward_names.len()
                ));
            }
            if c.rewards.iter().any(|r| r.is_infinite()) {
                return bad(format!("completion {i}: infinite reward"));
            }
            if c.prompt_ids != self.completions[i - i % group_size].prompt_ids {
                return bad(format!(
                    "completion {i}: its prompt differs from its group's first"
                ));
            }
        }
        if let Some(old) = &self.old_logprobs {
            if old.len() != n {
                return bad(format!(
                    "{} old log-prob rows for {n} completions",
                    old.len()
                ));
            }
            for (i, (o, c)) in old.iter().zip(&self.completions).enumerate() {
                if o.len() != c.completion_ids.len() {
                    return bad(format!(
                        "completion {i}: {} old log-probs for {} tokens",
                        o.len(),
                        c.completion_ids.len()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Advantages of `rewards` (consecutive groups of `group_size`) as TRL computes them (see the
/// module docs); unscorable (NaN) rewards get 0 and are left out of the statistics.
pub fn compute_advantages(
    rewards: &[f64],
    group_size: usize,
    scale: ScaleRewards,
) -> Result<Vec<f64>> {
    if group_size == 0 || rewards.is_empty() || rewards.len() % group_size != 0 {
        return Err(TrainError::InvalidInput(format!(
            "{} rewards do not make whole groups of {group_size}",
            rewards.len()
        )));
    }
    fn mean_std(xs: &[f64]) -> (f64, f64) {
        let v: Vec<f64> = xs.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return (f64::NAN, f64::NAN);
        }
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = if v.len() > 1 {
            v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (v.len() - 1) as f64
        } else {
            f64::NAN
        };
        (mean, var.sqrt())
    }
    let (_, batch_std) = mean_std(rewards);
    let mut out = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group_size) {
        let (mean, group_std) = mean_std(g);
        let std = if scale == ScaleRewards::Batch {
            batch_std
        } else {
            group_std
        };
        for r in g {
            let a = r - mean;
            let a = if scale == ScaleRewards::None {
                a
            } else {
                a / (std + 1e-4)
            };
            out.push(if a.is_nan() { 0.0 } else { a });
        }
    }
    Ok(out)
}

/// Mean and (population) standard deviation of the finite values of `xs` (NaN when none).
fn stats(xs: impl Iterator<Item = f64>) -> (f64, f64) {
    let v: Vec<f64> = xs.filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
    (mean, var.sqrt())
}

/// Mean and standard deviation of one reward function over a step.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RewardStats {
    pub name: String,
    pub mean: f64,
    pub std: f64,
}

/// What one GRPO step did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GrpoStepMetrics {
    /// Updates applied, this one included (a skipped step does not count).
    pub step: u64,
    /// The objective whose gradient was taken (summed over micro-batches).
    pub loss: f32,
    /// Combined reward over the step's completions: mean and population std.
    pub reward_mean: f64,
    pub reward_std: f64,
    /// Per reward function.
    pub rewards: Vec<RewardStats>,
    /// Mean k3 KL to the reference model over completion tokens (`None` when `beta` is 0).
    pub kl: Option<f64>,
    /// Fraction of completion tokens (sequences, at sequence level) whose weight was clipped
    /// where the clip matters: below `1 - epsilon` with a negative advantage, or above
    /// `1 + epsilon_high` with a positive one.
    pub clip_fraction: f64,
    pub completion_length_mean: f64,
    pub completion_length_min: usize,
    pub completion_length_max: usize,
    /// Completion tokens the loss counted.
    pub completion_tokens: usize,
    /// Prompt and completion tokens processed per second by the step (forward and backward).
    pub tokens_per_second: f64,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// The loss or the gradients were not finite: no update was applied.
    pub skipped: bool,
    pub seconds: f64,
}

/// One micro-batch laid out for the model.
struct Packed {
    /// `[n, w]` input ids: prompt + completion, without the last token, right-padded.
    inputs: Array,
    n: usize,
    /// Longest completion of the micro-batch.
    t: usize,
    /// `[n * t]` flat indices into `[n * w]` of the position predicting each completion token.
    pos: Array,
    /// `[n * t, 1]` completion ids (0 past a completion's end).
    targets: Array,
    /// `[n, t]` 1 on completion tokens, 0 on padding.
    mask: Vec<f32>,
    /// The targets on the host.
    target_ids: Vec<i32>,
    tokens: usize,
}

fn model_err(e: impl std::fmt::Display) -> mlx_array::Error {
    mlx_array::Error::InvalidArgument {
        op: "grpo loss",
        msg: e.to_string(),
    }
}

/// Data parallel: an error unless every rank of `g` was given the same batch (an FNV-1a hash
/// of its prompt and completion ids and rewards, compared over the ranks).
fn check_same_batch(g: &mlx_array::distributed::Group, batch: &GrpoBatch) -> Result<()> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    };
    for c in &batch.completions {
        eat(c.prompt_ids.len() as u64);
        c.prompt_ids.iter().for_each(|&t| eat(t as u64));
        eat(c.completion_ids.len() as u64);
        c.completion_ids.iter().for_each(|&t| eat(t as u64));
        c.rewards.iter().for_each(|r| eat(r.to_bits()));
    }
    // four 16-bit pieces: exact in f32
    let mine: Vec<f32> = (0..4).map(|i| ((h >> (16 * i)) & 0xffff) as f32).collect();
    let all = g.all_gather(&Array::from_slice(&mine, &[4])?)?.to_vec::<f32>()?;
    if all.chunks(4).any(|c| c != mine.as_slice()) {
        return Err(TrainError::InvalidInput(
            "the data-parallel ranks were given different batches (each rank must build the same global batch: the same data, seed and model)".into(),
        ));
    }
    Ok(())
}

fn pack(completions: &[&Completion], pad_id: u32) -> Result<Packed> {
    let n = completions.len();
    // at least one column (and one input position): a micro-batch of empty completions has a
    // zero loss
    let t = completions
        .iter()
        .map(|c| c.completion_ids.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let w = completions
        .iter()
        .map(|c| c.prompt_ids.len() + c.completion_ids.len() - 1)
        .max()
        .unwrap_or(1)
        .max(1);
    let (mut inputs, mut pos, mut targets, mut mask) = (
        Vec::with_capacity(n * w),
        Vec::with_capacity(n * t),
        Vec::with_capacity(n * t),
        Vec::with_capacity(n * t),
    );
    let mut tokens = 0;
    for (i, c) in completions.iter().enumerate() {
        let seq: Vec<u32> = c
            .prompt_ids
            .iter()
            .chain(&c.completion_ids)
            .copied()
            .collect();
        tokens += seq.len();
        for k in 0..w {
            inputs.push(if k + 1 < seq.len() { seq[k] } else { pad_id });
        }
        let p = c.prompt_ids.len();
        for j in 0..t {
            if j < c.completion_ids.len() {
                pos.push((i * w + p + j - 1) as u32);
                targets.push(c.completion_ids[j] as i32);
                mask.push(1.0);
            } else {
                pos.push((i * w) as u32);
                targets.push(0);
                mask.push(0.0);
            }
        }
    }
    Ok(Packed {
        inputs: Array::from_slice(&inputs, &[n, w])?,
        n,
        t,
        pos: Array::from_slice(&pos, &[n * t])?,
        targets: Array::from_slice(&targets, &[n * t, 1])?,
        target_ids: targets,
        mask,
        tokens,
    })
}

/// `[n, t]` log-probs of the completion tokens under `model` (temperature 1; 0-masked rows hold
/// a finite placeholder), the layers checkpointed when `checkpointed`.
fn token_logprobs(model: &Model, p: &Packed, checkpointed: bool) -> mlx_array::Result<Array> {
    let mut cache = model.new_cache();
    cache.set_gradient_checkpointing(checkpointed);
    let out = model
        .forward(&p.inputs, &mut cache, Logits::All, false)
        .map_err(model_err)?;
    let logits = out
        .logits
        .ok_or_else(|| model_err("the model returned no logits"))?;
    let w = p.inputs.dim(1)?;
    let rows = logits
        .reshape(&[(p.n * w) as i32, -1])?
        .take(&p.pos, 0)?
        .astype(DType::F32)?;
    let lp = rows
        .take_along_axis(&p.targets, -1)?
        .sub(&rows.logsumexp(&[-1], true)?)?;
    lp.reshape(&[p.n as i32, p.t as i32])
}

/// The output head the gradients run through.
#[derive(Debug, Clone, PartialEq)]
enum Head {
    /// Final hidden rows times this parameter (transposed), optionally soft-capped.
    Chunked {
        weight: String,
        softcap: Option<f32>,
    },
    /// The model's own logits.
    Model,
}

/// `[M, H]` f32 final hidden rows of the positions predicting the completion tokens, the
/// layers checkpointed when `checkpointed`.
fn hidden_rows(model: &Model, p: &Packed, checkpointed: bool) -> mlx_array::Result<Array> {
    let mut cache = model.new_cache();
    cache.set_gradient_checkpointing(checkpointed);
    let out = model
        .forward(&p.inputs, &mut cache, Logits::None, true)
        .map_err(model_err)?;
    let h = out
        .hidden
        .ok_or_else(|| model_err("the model returned no hidden states"))?;
    let w = p.inputs.dim(1)?;
    h.reshape(&[(p.n * w) as i32, -1])?
        .take(&p.pos, 0)?
        .astype(DType::F32)
}

fn head_weight(tree: &ParameterTree, name: &str) -> mlx_array::Result<Array> {
    tree.get(name)
        .ok_or_else(|| model_err(format!("no parameter {name}")))?
        .array
        .astype(DType::F32)
}

fn head_logits(h: &Array, w: &Array, softcap: Option<f32>) -> mlx_array::Result<Array> {
    let z = h.matmul(&w.transpose(&[1, 0])?)?;
    match softcap {
        Some(c) => z.softcap(c),
        None => Ok(z),
    }
}

/// `[n, t]` log-probs from hidden rows `h` through the head `w`, `chunk` rows at a time.
fn chunked_logprobs(
    h: &Array,
    w: &Array,
    softcap: Option<f32>,
    p: &Packed,
    chunk: usize,
) -> mlx_array::Result<Array> {
    let m = p.n * p.t;
    let mut parts = Vec::new();
    let mut start = 0;
    while start < m {
        let end = (start + chunk).min(m);
        let z = head_logits(&h.slice_axis(0, start, end)?, w, softcap)?;
        let t = Array::from_slice(&p.target_ids[start..end], &[end - start, 1])?;
        let lp = z.take_along_axis(&t, -1)?.sub(&z.logsumexp(&[-1], true)?)?;
        lp.eval()?;
        parts.push(lp);
        start = end;
    }
    mlx_array::ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?
        .reshape(&[p.n as i32, p.t as i32])
}

/// `dL/dh` (`[M, H]`) and the head's `dL/dW` given `g = dL/dlogp` (`[n, t]`), chunk by chunk.
fn chunked_backward(
    h: &Array,
    w: &Array,
    softcap: Option<f32>,
    p: &Packed,
    g: &Array,
    chunk: usize,
) -> mlx_array::Result<(Array, Array)> {
    let m = p.n * p.t;
    let vocab = w.dim(0)?;
    let g = g.reshape(&[m as i32, 1])?;
    let classes = Array::arange(0, vocab as i64, DType::I32)?.reshape(&[1, -1])?;
    let (mut dh_parts, mut dw): (Vec<Array>, Option<Array>) = (Vec::new(), None);
    let mut start = 0;
    while start < m {
        let end = (start + chunk).min(m);
        let hc = h.slice_axis(0, start, end)?;
        let z = head_logits(&hc, w, softcap)?;
        let t = Array::from_slice(&p.target_ids[start..end], &[end - start, 1])?;
        let onehot = classes.eq(&t)?.astype(DType::F32)?;
        let probs = z.sub(&z.logsumexp(&[-1], true)?)?.exp()?;
        let mut dz = onehot.sub(&probs)?.mul(&g.slice_axis(0, start, end)?)?;
        if let Some(c) = softcap {
            // d(c tanh(x / c))/dx = 1 - (z / c)^2
            dz = dz.mul(
                &z.mul_scalar(1.0 / c)?
                    .square()?
                    .mul_scalar(-1.0)?
                    .add_scalar(1.0)?,
            )?;
        }
        let dhc = dz.matmul(w)?;
        let dwc = dz.transpose(&[1, 0])?.matmul(&hc)?;
        let acc = match dw.take() {
            Some(a) => a.add(&dwc)?,
            None => dwc,
        };
        mlx_array::eval(&[&dhc, &acc])?;
        dh_parts.push(dhc);
        dw = Some(acc);
        start = end;
    }
    let dh = mlx_array::ops::concatenate(&dh_parts.iter().collect::<Vec<_>>(), 0)?;
    Ok((dh, dw.ok_or_else(|| model_err("no completion position"))?))
}

/// The chunked head when it reproduces the model's logits on a probe sequence.
fn pick_head(tree: &ParameterTree, opts: &LoadOptions, cfg: &serde_json::Value) -> Result<Head> {
    let text = cfg.get("text_config").unwrap_or(cfg);
    let tied = text
        .get("tie_word_embeddings")
        .or_else(|| cfg.get("tie_word_embeddings"))
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let names: Vec<&str> = tree.iter().map(|(n, _)| n).collect();
    let weight = if let Some(n) = names.iter().find(|n| n.ends_with("lm_head.weight")) {
        n.to_string()
    } else if let (true, Some(n)) = (
        tied,
        names.iter().find(|n| n.ends_with("embed_tokens.weight")),
    ) {
        n.to_string()
    } else {
        return Ok(Head::Model);
    };
    if tree
        .get(&weight)
        .is_none_or(|p| p.packed || p.array.ndim() != 2)
    {
        return Ok(Head::Model);
    }
    let softcap = text
        .get("final_logit_softcapping")
        .and_then(|v| v.as_f64())
        .map(|v| v as f32);
    let model = tree.build(opts)?.into_lm()?;
    let vocab = model.info().vocab_size;
    let probe: Vec<u32> = (0..8u32).map(|i| (i * 7 + 1) % vocab as u32).collect();
    let mut cache = model.new_cache();
    let out = model.forward(
        &Array::from_slice(&probe, &[1, probe.len()])?,
        &mut cache,
        Logits::All,
        true,
    )?;
    let (Some(want), Some(h)) = (out.logits, out.hidden) else {
        return Ok(Head::Model);
    };
    let got = head_logits(
        &h.reshape(&[probe.len() as i32, -1])?.astype(DType::F32)?,
        &head_weight(tree, &weight)?,
        softcap,
    )?;
    let want = want
        .reshape(&[probe.len() as i32, -1])?
        .astype(DType::F32)?;
    let scale = want.abs()?.max(&[], false)?.item::<f32>()?.max(1e-6);
    let err = got.sub(&want)?.abs()?.max(&[], false)?.item::<f32>()? / scale;
    Ok(if err < 1e-4 {
        Head::Chunked { weight, softcap }
    } else {
        Head::Model
    })
}

/// Constants of one micro-batch's loss.
struct LossInputs {
    old: Array,
    reference: Option<Array>,
    /// `[n, 1]`.
    adv: Array,
    /// `[n, t]`.
    mask: Array,
    /// The normaliser dividing the masked sum (`None` for `grpo`: per-sequence means).
    divisor: Option<f32>,
    /// `grpo`'s extra division (micro-batches).
    grpo_div: f32,
}

impl GrpoTrainerCore<'_> {
    /// The loss of one micro-batch as a function of its `[n, t]` log-probs.
    fn loss(&self, lp: &Array, c: &LossInputs) -> mlx_array::Result<Array> {
        let cfg = self.config;
        let log_ratio = lp.sub(&c.old)?;
        let liw = match cfg.importance_sampling {
            ImportanceSampling::Token => log_ratio,
            ImportanceSampling::Sequence => {
                let count = c.mask.sum(&[-1], true)?.maximum(&Array::scalar(1f32))?;
                log_ratio.mul(&c.mask)?.sum(&[-1], true)?.div(&count)?
            }
        };
        let w = liw.exp()?;
        let (lo, hi) = (
            (1.0 - cfg.epsilon) as f32,
            (1.0 + cfg.epsilon_high()) as f32,
        );
        // clip with a zero gradient outside [lo, hi] and the identity's inside
        let lo_a = Array::scalar(lo);
        let hi_a = Array::scalar(hi);
        let clipped = mlx_array::ops::where_(
            &w.lt(&lo_a)?,
            &lo_a,
            &mlx_array::ops::where_(&w.gt(&hi_a)?, &hi_a, &w)?,
        )?;
        let l1 = w.mul(&c.adv)?;
        let l2 = clipped.mul(&c.adv)?;
        let mut per_token = mlx_array::ops::where_(&l1.le(&l2)?, &l1, &l2)?.neg()?;
        if let Some(r) = &c.reference {
            let d = r.sub(lp)?;
            let k3 = d.exp()?.sub(&d)?.add_scalar(-1.0)?;
            per_token = per_token.add(&k3.mul_scalar(cfg.beta as f32)?)?;
        }
        let masked = per_token.mul(&c.mask)?;
        match c.divisor {
            Some(d) => masked.sum(&[], false)?.mul_scalar(1.0 / d),
            None => {
                let count = c.mask.sum(&[-1], false)?.maximum(&Array::scalar(1f32))?;
                masked
                    .sum(&[-1], false)?
                    .div(&count)?
                    .mean(&[], false)?
                    .mul_scalar(1.0 / c.grpo_div)
            }
        }
    }
}

/// The parts of the trainer the loss reads.
struct GrpoTrainerCore<'a> {
    config: &'a GrpoConfig,
}

/// GRPO over a parameter tree (its trainable subset is trained; frozen parameters never change).
pub struct GrpoTrainer {
    tree: ParameterTree,
    reference: Option<ParameterTree>,
    opts: LoadOptions,
    config: GrpoConfig,
    optimizer: Optimizer,
    step: u64,
    guard: NanGuard,
    head: Head,
    pad_id: u32,
    /// Batches taken so far (skipped updates included): the data position.
    batches: u64,
    data: Option<GrpoData>,
    output: Option<OutputRun>,
    lora: Option<LoraConfig>,
    /// Data-parallel group ([`GrpoTrainer::with_data_parallel`]).
    data_parallel: Option<mlx_array::distributed::Group>,
}

/// The prompts (or recorded groups) a run cycles through, in order, `per_step` a step, and the
/// sampling seed: step `s` (0-based, skipped updates included) takes items `s * per_step`,
/// `s * per_step + 1`, ... (mod `items`) and samples with seed `seed + s`
/// ([`GrpoTrainer::next_items`], [`GrpoTrainer::sampling_seed`]). Checkpoints record it with the
/// data position, and a resumed run must be given the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GrpoData {
    pub items: usize,
    pub per_step: usize,
    pub seed: u64,
}

/// The output-store run a trainer's steps are recorded in: saved with checkpoints so that a
/// resumed run records into the same run ([`crate::output_store::OutputStore`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OutputRun {
    /// The store's file.
    pub store: std::path::PathBuf,
    pub run_id: i64,
}

/// What a GRPO checkpoint holds besides `trainer_state.json`'s common fields
/// (`grpo_state.json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct GrpoSaved {
    /// Batches taken (the data position; `trainer_state.json`'s `position` says the same).
    batches: u64,
    data: Option<GrpoData>,
    output: Option<OutputRun>,
    /// Whether the run has a reference model (`beta > 0`): the policy's parameters with those
    /// of `reference.safetensors` in their place.
    reference: bool,
}

/// `grpo_state.json` of a GRPO checkpoint.
pub const GRPO_STATE_FILE: &str = "grpo_state.json";
/// The frozen reference model of a run with `beta > 0`: its parameters (by checkpoint name, in
/// the dtype they run in) that differ from the saved policy's; the others are the policy's. With
/// every parameter trained that is the whole initial model; with LoRA, the initial adapters.
pub const REFERENCE_FILE: &str = "reference.safetensors";

/// What [`GrpoTrainer::loss_and_gradients`] returns besides the gradients.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoLoss {
    pub loss: f32,
    pub advantages: Vec<f64>,
    pub kl: Option<f64>,
    pub clip_fraction: f64,
    /// Prompt and completion tokens run through the policy.
    pub tokens: usize,
    pub completion_tokens: usize,
}

impl GrpoTrainer {
    /// A trainer over `tree` (loaded with `opts`). With `beta > 0` the KL term needs a frozen
    /// reference model: `reference`, or when `None` a copy of `tree` as it is now.
    pub fn new(
        tree: ParameterTree,
        reference: Option<ParameterTree>,
        opts: &LoadOptions,
        config: GrpoConfig,
    ) -> Result<Self> {
        config.validate()?;
        if tree.trainable_names().is_empty() {
            return Err(TrainError::InvalidInput("no trainable parameter".into()));
        }
        let reference = if config.beta > 0.0 {
            Some(reference.unwrap_or_else(|| tree.clone()))
        } else {
            None
        };
        let optimizer = Optimizer::new(config.optimizer)?;
        Self::assemble(tree, reference, opts, config, optimizer)
    }

    fn assemble(
        tree: ParameterTree,
        reference: Option<ParameterTree>,
        opts: &LoadOptions,
        config: GrpoConfig,
        optimizer: Optimizer,
    ) -> Result<Self> {
        let opts = LoadOptions {
            kv_cache: KvCacheMode::Flat,
            ..opts.clone()
        };
        let cfg_path = tree.dir().join("config.json");
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&cfg_path).map_err(crate::error::io_err(&cfg_path))?,
        )
        .map_err(|e| TrainError::State {
            path: cfg_path.clone(),
            msg: e.to_string(),
        })?;
        let pad_id = config
            .pad_id
            .or_else(|| {
                cfg.get("pad_token_id")
                    .and_then(|v| v.as_u64())
                    .and_then(|v| u32::try_from(v).ok())
            })
            .unwrap_or(0);
        let guard = NanGuard::new(config.max_nan_gradients);
        let head = if config.chunked_head {
            pick_head(&tree, &opts, &cfg)?
        } else {
            Head::Model
        };
        Ok(GrpoTrainer {
            tree,
            reference,
            opts,
            config,
            optimizer,
            step: 0,
            guard,
            head,
            pad_id,
            batches: 0,
            data: None,
            output: None,
            lora: None,
            data_parallel: None,
        })
    }

    /// Train data parallel over `group`'s ranks ([`crate::distributed`]): every rank is given
    /// the same global batch (checked: a hash of its prompts, completions and rewards is
    /// compared over the ranks), computes the gradients of its share of the batch's
    /// micro-batches, and one `all_sum` adds the ranks' gradients, losses and metric sums, so
    /// every rank applies the update of a single process with the same micro-batches (up to
    /// f32 summation order). Without [`GrpoConfig::micro_batch_size`] the batch is cut into
    /// one micro-batch per rank (`ceil(n / ranks)` completions each); a batch with fewer
    /// micro-batches than ranks is an error. Only rank 0 should save. A group of one rank is
    /// the single process.
    pub fn with_data_parallel(mut self, group: mlx_array::distributed::Group) -> Self {
        self.data_parallel = Some(group).filter(|g| g.size() > 1);
        self
    }

    /// The LoRA settings the tree's adapters were made with ([`crate::lora::apply_lora`]):
    /// needed to save a tree with adapters, whose checkpoints then hold the adapters
    /// (`adapters.safetensors`, `adapter_config.json`) instead of the model.
    pub fn with_lora(mut self, lora: LoraConfig) -> Result<Self> {
        if self.tree.lora().is_none() {
            return Err(TrainError::Config(
                "with_lora: the tree has no LoRA adapters (apply_lora)".into(),
            ));
        }
        lora.validate()?;
        if lora.dropout > 0.0 || self.tree.lora().is_some_and(|l| l.dropout > 0.0) {
            return Err(TrainError::Config(
                "GrpoTrainer does not apply LoRA dropout: make the adapters with dropout 0".into(),
            ));
        }
        self.lora = Some(lora);
        Ok(self)
    }

    /// The trainer with the run's data layout and sampling seed ([`GrpoData`]), recorded in
    /// checkpoints.
    pub fn with_data(mut self, data: GrpoData) -> Result<Self> {
        if data.items == 0 || data.per_step == 0 {
            return Err(TrainError::Config(format!(
                "GrpoData needs at least one item and one per step, got {} and {}",
                data.items, data.per_step
            )));
        }
        self.data = Some(data);
        Ok(self)
    }

    /// The run's data layout, if set ([`GrpoTrainer::with_data`]).
    pub fn data(&self) -> Option<&GrpoData> {
        self.data.as_ref()
    }

    /// Batches taken so far by [`GrpoTrainer::step`] (skipped updates included).
    pub fn batches_done(&self) -> u64 {
        self.batches
    }

    /// Indices of the items the next step takes ([`GrpoData`]); `None` without a data layout.
    pub fn next_items(&self) -> Option<Vec<usize>> {
        let d = self.data?;
        let first = ((self.batches as u128 * d.per_step as u128) % d.items as u128) as usize;
        Some(
            (0..d.per_step.min(d.items))
                .map(|k| (first + k) % d.items)
                .collect(),
        )
    }

    /// The sampling seed of the next step, `seed + batches_done` ([`GrpoData`]); `None` without
    /// a data layout.
    pub fn sampling_seed(&self) -> Option<u64> {
        self.data.map(|d| d.seed.wrapping_add(self.batches))
    }

    /// Record the output-store run the steps go to, so that checkpoints carry it.
    pub fn set_output_run(&mut self, output: Option<OutputRun>) {
        self.output = output;
    }

    /// The output-store run recorded with [`GrpoTrainer::set_output_run`] (or resumed).
    pub fn output_run(&self) -> Option<&OutputRun> {
        self.output.as_ref()
    }

    /// The frozen reference model of the KL term (`None` when `beta` is 0).
    pub fn reference(&self) -> Option<&ParameterTree> {
        self.reference.as_ref()
    }

    fn build(&self, tree: &ParameterTree) -> mlx_array::Result<Model> {
        tree.build(&self.opts)
            .and_then(|m| m.into_lm())
            .map_err(model_err)
    }

    /// Loss, advantages and metrics of `batch` and the gradients of the trainable parameters (in
    /// [`ParameterTree::trainable_names`] order), without updating anything.
    pub fn loss_and_gradients(&self, batch: &GrpoBatch) -> Result<(GrpoLoss, Vec<Array>)> {
        // untraced forwards (log-probabilities, reference model) compute what the traced ones do
        let _ops = mlx_array::ops::mlx_ops_only();
        let cfg = &self.config;
        batch.validate(cfg.group_size, cfg.max_completion_length)?;
        let advantages =
            compute_advantages(&batch.total_rewards(), cfg.group_size, cfg.scale_rewards)?;
        let n = batch.completions.len();
        let micro = match (cfg.micro_batch_size, &self.data_parallel) {
            (Some(m), _) => m,
            (None, Some(g)) => n.div_ceil(g.size()),
            (None, None) => n,
        }
        .min(n);
        let ranges: Vec<(usize, usize)> = (0..n)
            .step_by(micro)
            .map(|s| (s, (s + micro).min(n)))
            .collect();
        // data parallel: this rank's share of the micro-batches
        let mine = match &self.data_parallel {
            Some(g) => {
                check_same_batch(g, batch)?;
                crate::distributed::rank_share(ranges.len(), g.rank(), g.size()).map_err(|_| {
                    TrainError::InvalidInput(format!(
                        "{} micro-batches of {micro} cannot be shared by {} data-parallel ranks (each needs one): use a smaller micro-batch size",
                        ranges.len(),
                        g.size()
                    ))
                })?
            }
            None => 0..ranges.len(),
        };
        let total_tokens: usize = batch
            .completions
            .iter()
            .map(|c| c.completion_ids.len())
            .sum();
        let policy = self.build(&self.tree)?;
        let reference = match &self.reference {
            Some(r) => Some(self.build(r)?),
            None => None,
        };
        let params = self.tree.trainable_arrays();
        let core = GrpoTrainerCore { config: cfg };
        let (mut loss, mut grads): (f64, Option<Vec<Array>>) = (0.0, None);
        let (mut kl_sum, mut kl_count, mut clipped, mut clip_count, mut tokens) =
            (0f64, 0f64, 0f64, 0f64, 0usize);
        for &(s, e) in &ranges[mine] {
            let rows: Vec<&Completion> = batch.completions[s..e].iter().collect();
            let p = pack(&rows, self.pad_id)?;
            tokens += p.tokens;
            let chunk = cfg.head_chunk;
            // the policy's hidden rows and head weight, kept for the chunked backward pass
            let (lp0, hidden) = match &self.head {
                Head::Chunked { weight, softcap } => {
                    let h = hidden_rows(&policy, &p, false)?;
                    h.eval()?;
                    let w = head_weight(&self.tree, weight)?;
                    (chunked_logprobs(&h, &w, *softcap, &p, chunk)?, Some((h, w)))
                }
                Head::Model => (token_logprobs(&policy, &p, false)?, None),
            };
            lp0.eval()?;
            let old = match &batch.old_logprobs {
                Some(o) => {
                    let mut v = vec![0f32; p.n * p.t];
                    for (k, row) in o[s..e].iter().enumerate() {
                        v[k * p.t..k * p.t + row.len()].copy_from_slice(row);
                    }
                    Array::from_slice(&v, &[p.n, p.t])?
                }
                None => lp0.clone(),
            };
            let ref_lp = match (&reference, &self.reference, &self.head) {
                (Some(m), Some(rt), Head::Chunked { weight, softcap }) => {
                    let h = hidden_rows(m, &p, false)?;
                    h.eval()?;
                    Some(chunked_logprobs(
                        &h,
                        &head_weight(rt, weight)?,
                        *softcap,
                        &p,
                        chunk,
                    )?)
                }
                (Some(m), _, _) => {
                    let r = token_logprobs(m, &p, false)?;
                    r.eval()?;
                    Some(r)
                }
                _ => None,
            };
            let mask = Array::from_slice(&p.mask, &[p.n, p.t])?;
            let micro_tokens: f32 = p.mask.iter().sum();
            let n_micro = ranges.len() as f32;
            let divisor = match cfg.loss {
                LossType::Grpo => None,
                LossType::Bnpo => Some(micro_tokens.max(1.0) * n_micro),
                LossType::DrGrpo => Some((p.n * cfg.max_completion_length) as f32 * n_micro),
                LossType::Dapo => Some((total_tokens as f32).max(1.0)),
            };
            let adv: Vec<f32> = advantages[s..e].iter().map(|a| *a as f32).collect();
            let inputs = LossInputs {
                old,
                reference: ref_lp,
                adv: Array::from_slice(&adv, &[p.n, 1])?,
                mask,
                divisor,
                grpo_div: n_micro,
            };
            let (l, g) = value_and_grad(|x| core.loss(&x[0], &inputs), std::slice::from_ref(&lp0))?;
            let g_lp = g
                .into_iter()
                .next()
                .ok_or_else(|| TrainError::InvalidInput("no log-prob gradient".into()))?;
            mlx_array::eval(&[&l, &g_lp])?;
            loss += l.item::<f32>()? as f64;
            let gk = match (&hidden, &self.head) {
                (Some((h, w)), Head::Chunked { weight, softcap }) => {
                    let (dh, dw) = chunked_backward(h, w, *softcap, &p, &g_lp, chunk)?;
                    let (_, mut gk) = value_and_grad(
                        |ps| {
                            let tree = self.tree.with_trainable(ps).map_err(model_err)?;
                            hidden_rows(&self.build(&tree)?, &p, cfg.gradient_checkpointing)?
                                .mul(&dh)?
                                .sum(&[], false)
                        },
                        &params,
                    )?;
                    if let Some(i) = self.tree.trainable_names().iter().position(|n| n == weight) {
                        gk[i] = gk[i].add(&dw.astype(gk[i].dtype())?)?;
                    }
                    gk
                }
                _ => {
                    value_and_grad(
                        |ps| {
                            let tree = self.tree.with_trainable(ps).map_err(model_err)?;
                            token_logprobs(&self.build(&tree)?, &p, cfg.gradient_checkpointing)?
                                .mul(&g_lp)?
                                .sum(&[], false)
                        },
                        &params,
                    )?
                    .1
                }
            };
            let acc = match grads.take() {
                None => gk,
                Some(a) => a
                    .iter()
                    .zip(&gk)
                    .map(|(x, y)| x.add(y))
                    .collect::<mlx_array::Result<_>>()?,
            };
            mlx_array::eval(&acc.iter().collect::<Vec<_>>())?;
            grads = Some(acc);
            // metrics, from the values
            let lp_v = lp0.to_vec::<f32>()?;
            let old_v = inputs.old.to_vec::<f32>()?;
            if let Some(r) = &inputs.reference {
                for ((r, l), m) in r.to_vec::<f32>()?.iter().zip(&lp_v).zip(&p.mask) {
                    let d = (*r - *l) as f64;
                    kl_sum += (d.exp() - d - 1.0) * *m as f64;
                    kl_count += *m as f64;
                }
            }
            let (lo, hi) = (1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high());
            let is_clipped = |w: f64, a: f64| (w < lo && a < 0.0) || (w > hi && a > 0.0);
            for k in 0..p.n {
                let a = advantages[s + k];
                let row = k * p.t..(k + 1) * p.t;
                let len: f32 = p.mask[row.clone()].iter().sum();
                match cfg.importance_sampling {
                    ImportanceSampling::Token => {
                        for i in row {
                            if p.mask[i] > 0.0 {
                                clipped +=
                                    is_clipped(((lp_v[i] - old_v[i]) as f64).exp(), a) as u8 as f64;
                                clip_count += 1.0;
                            }
                        }
                    }
                    ImportanceSampling::Sequence => {
                        let s: f64 = row
                            .clone()
                            .map(|i| ((lp_v[i] - old_v[i]) * p.mask[i]) as f64)
                            .sum();
                        clipped += is_clipped((s / len.max(1.0) as f64).exp(), a) as u8 as f64;
                        clip_count += 1.0;
                    }
                }
            }
        }
        let mut grads = grads.ok_or_else(|| TrainError::InvalidInput("no micro-batch".into()))?;
        if let Some(g) = &self.data_parallel {
            // the ranks' sums over their micro-batches add up to the whole batch's
            let local = [loss, kl_sum, kl_count, clipped, clip_count, tokens as f64].map(|x| x as f32);
            let (head, sums) = crate::distributed::sum_over_ranks(g, &local, &grads, 1.0)?;
            grads = sums
                .iter()
                .zip(&grads)
                .map(|(s, g)| s.astype(g.dtype()))
                .collect::<mlx_array::Result<Vec<_>>>()?;
            mlx_array::eval(&grads.iter().collect::<Vec<_>>())?;
            let h: Vec<f64> = head.iter().map(|&x| x as f64).collect();
            (loss, kl_sum, kl_count, clipped, clip_count) = (h[0], h[1], h[2], h[3], h[4]);
            tokens = h[5] as usize;
        }
        let kl = reference.as_ref().map(|_| kl_sum / kl_count.max(1.0));
        let out = GrpoLoss {
            loss: loss as f32,
            advantages,
            kl,
            clip_fraction: clipped / clip_count.max(1.0),
            tokens,
            completion_tokens: total_tokens,
        };
        Ok((out, grads))
    }

    /// One GRPO update on `batch` (skipped when not finite; see the module docs).
    pub fn step(&mut self, batch: &GrpoBatch) -> Result<GrpoStepMetrics> {
        let started = Instant::now();
        let (out, grads) = self.loss_and_gradients(batch)?;
        let lr = self.config.schedule.lr_at(self.step);
        // clipping by value would hide infinities: judge the unclipped gradients then
        let unclipped_norm = match self.config.clip.max_value {
            Some(_) => Some(crate::optim::global_norm(&grads)?.item::<f32>()?),
            None => None,
        };
        let (grads, grad_norm) = clip_gradients(grads, &self.config.clip)?;
        let skipped = match self
            .guard
            .check(out.loss, unclipped_norm.unwrap_or(grad_norm))
        {
            Verdict::Apply => {
                let names: Vec<String> = self
                    .tree
                    .trainable_names()
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                let new =
                    self.optimizer
                        .update(&refs, &self.tree.trainable_arrays(), &grads, lr)?;
                self.tree = self.tree.with_trainable(&new)?;
                self.step += 1;
                self.batches += 1;
                false
            }
            Verdict::Skip { .. } => {
                self.batches += 1;
                true
            }
            Verdict::Stop { skipped } => {
                self.batches += 1;
                return Err(TrainError::NanGradients {
                    skipped,
                    max: self.guard.max_nan_gradients(),
                });
            }
        };
        let totals = batch.total_rewards();
        let (reward_mean, reward_std) = stats(totals.iter().copied());
        let rewards = batch
            .reward_names
            .iter()
            .enumerate()
            .map(|(k, name)| {
                let (mean, std) = stats(batch.completions.iter().map(|c| c.rewards[k]));
                RewardStats {
                    name: name.clone(),
                    mean,
                    std,
                }
            })
            .collect();
        let lens: Vec<usize> = batch
            .completions
            .iter()
            .map(|c| c.completion_ids.len())
            .collect();
        let seconds = started.elapsed().as_secs_f64();
        Ok(GrpoStepMetrics {
            step: self.step,
            loss: out.loss,
            reward_mean,
            reward_std,
            rewards,
            kl: out.kl,
            clip_fraction: out.clip_fraction,
            completion_length_mean: lens.iter().sum::<usize>() as f64 / lens.len() as f64,
            completion_length_min: lens.iter().copied().min().unwrap_or(0),
            completion_length_max: lens.iter().copied().max().unwrap_or(0),
            completion_tokens: out.completion_tokens,
            tokens_per_second: out.tokens as f64 / seconds.max(1e-9),
            lr,
            grad_norm,
            skipped,
            seconds,
        })
    }

    /// Updates applied so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Updates skipped so far for non-finite loss or gradients.
    pub fn nan_skipped(&self) -> u64 {
        self.guard.skipped()
    }

    pub fn tree(&self) -> &ParameterTree {
        &self.tree
    }

    /// Whether the chunked head is in use (see the module docs).
    pub fn uses_chunked_head(&self) -> bool {
        matches!(self.head, Head::Chunked { .. })
    }

    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    pub fn config(&self) -> &GrpoConfig {
        &self.config
    }

    /// The model as it is now, for sampling (built with the trainer's load options).
    pub fn policy(&self) -> Result<Model> {
        Ok(self.build(&self.tree)?)
    }

    /// The progress a checkpoint records: `step` the updates applied, `position` the batches
    /// taken, `epoch` the completed passes over the data, `seed`, `dataset_len` and `batch_size`
    /// the [`GrpoData`] (0 without one).
    pub fn trainer_state(&self) -> TrainerState {
        let d = self.data.unwrap_or(GrpoData {
            items: 0,
            per_step: 0,
            seed: 0,
        });
        TrainerState {
            step: self.step,
            epoch: if d.items == 0 {
                0
            } else {
                ((self.batches as u128 * d.per_step as u128) / d.items as u128) as u64
            },
            position: self.batches as usize,
            epoch_rng: 0,
            seed: d.seed,
            dataset_len: d.items,
            trainable: self
                .tree
                .trainable_names()
                .iter()
                .map(|s| s.to_string())
                .collect(),
            optimizer: optimizer_kind(&self.config.optimizer).into(),
            batch_size: d.per_step,
            grad_accumulation: 1,
            shuffle: false,
            nan_skipped: self.guard.skipped(),
        }
    }

    /// Save model, optimizer and progress to `dir` atomically (weights in `save_dtype`, or as
    /// trained when `None`): the files of [`state::save_checkpoint`] (`trainer_state.json` as
    /// [`GrpoTrainer::trainer_state`] says; with LoRA, the adapters in place of the model, as
    /// [`crate::SftTrainer::save`] writes them), `grpo_state.json` (data position and layout,
    /// output-store run) and, when `beta > 0`, `reference.safetensors` ([`REFERENCE_FILE`]), so
    /// that a resumed run keeps the original reference model.
    pub fn save(&self, dir: &Path, save_dtype: Option<DType>) -> Result<()> {
        if self.tree.lora().is_some() && self.lora.is_none() {
            return Err(TrainError::Config(
                "the tree has LoRA adapters: give their config with GrpoTrainer::with_lora to save"
                    .into(),
            ));
        }
        let arrays: Vec<(String, Array)> = self
            .tree
            .iter()
            .map(|(n, p)| (n.to_string(), p.array.clone()))
            .collect();
        let params: Vec<(&str, &Array)> = arrays.iter().map(|(n, a)| (n.as_str(), a)).collect();
        let reference = match &self.reference {
            Some(r) => Some(self.reference_delta(r, save_dtype)?),
            None => None,
        };
        let trainer = self.trainer_state();
        let saved = GrpoSaved {
            batches: self.batches,
            data: self.data,
            output: self.output.clone(),
            reference: self.reference.is_some(),
        };
        state::write_dir_atomically(dir, |tmp| {
            match &self.lora {
                Some(lora) => crate::lora::write_adapter_files(tmp, &self.tree, lora)?,
                None => state::write_model_files(
                    tmp,
                    state::MODEL_FILE,
                    &params,
                    save_dtype,
                    self.tree.dir(),
                )?,
            }
            state::write_training_state(tmp, &self.optimizer, &trainer)?;
            if let Some(delta) = &reference {
                let refs: Vec<(&str, &Array)> =
                    delta.iter().map(|(n, a)| (n.as_str(), a)).collect();
                mlx_array::io::save_safetensors(tmp.join(REFERENCE_FILE), &refs, None)?;
            }
            let p = tmp.join(GRPO_STATE_FILE);
            let text = serde_json::to_string_pretty(&saved).map_err(|e| TrainError::State {
                path: p.clone(),
                msg: e.to_string(),
            })?;
            std::fs::write(&p, text + "\n").map_err(crate::error::io_err(&p))
        })
    }

    /// The reference's parameters that differ (in dtype, shape or value) from the policy's as a
    /// checkpoint writes them (a policy parameter cast by `save_dtype` counts as different; with
    /// LoRA the base model is not written, so only the adapters can differ); the two must have
    /// the same parameter names.
    fn reference_delta(
        &self,
        r: &ParameterTree,
        save_dtype: Option<DType>,
    ) -> Result<Vec<(String, Array)>> {
        let mismatch = || {
            TrainError::InvalidInput(
                "saving the reference model needs it to have the policy's parameters (same names)"
                    .into(),
            )
        };
        if r.len() != self.tree.len() {
            return Err(mismatch());
        }
        let mut out = Vec::new();
        for (name, p) in r.iter() {
            let mine = self.tree.get(name).ok_or_else(mismatch)?;
            let cast = match save_dtype {
                Some(d) if self.lora.is_none() => {
                    mine.array.dtype().is_float() && mine.array.dtype() != d
                }
                _ => false,
            };
            let same = !cast
                && p.array.dtype() == mine.array.dtype()
                && p.array.shape() == mine.array.shape()
                && (p.array.size() == 0 || {
                    let d = p
                        .array
                        .astype(DType::F32)?
                        .sub(&mine.array.astype(DType::F32)?)?;
                    d.abs()?.max(&[], false)?.item::<f32>()? == 0.0
                });
            if !same {
                out.push((name.to_string(), p.array.clone()));
            }
        }
        Ok(out)
    }

    /// Continue the run saved in `dir` by [`GrpoTrainer::save`]: its model (trainable marks as
    /// saved), optimizer state, step, NaN-guard count, data position, output-store run and,
    /// when `config.beta > 0`, its frozen reference model. `config` and `data` must be the
    /// saving run's (the optimizer kind and the data layout are checked); a checkpoint written
    /// with weights cast to a narrower dtype continues from the cast weights.
    pub fn resume(
        dir: &Path,
        opts: &LoadOptions,
        config: GrpoConfig,
        data: Option<GrpoData>,
    ) -> Result<Self> {
        Self::resume_with_base(dir, None, opts, config, data)
    }

    /// [`GrpoTrainer::resume`] for a checkpoint of either kind: a LoRA checkpoint (adapters, no
    /// model) is continued over `base` (the model it was trained from, without adapters), whose
    /// adapters and LoRA config are those saved.
    pub fn resume_with_base(
        dir: &Path,
        base: Option<ParameterTree>,
        opts: &LoadOptions,
        config: GrpoConfig,
        data: Option<GrpoData>,
    ) -> Result<Self> {
        config.validate()?;
        let dir = state::resolve_checkpoint(dir)?;
        let saved = state::read_trainer_state(&dir)?;
        let grpo_path = dir.join(GRPO_STATE_FILE);
        let bad = |path: &Path, msg: String| TrainError::State {
            path: path.to_path_buf(),
            msg,
        };
        let text = std::fs::read_to_string(&grpo_path).map_err(crate::error::io_err(&grpo_path))?;
        let grpo: GrpoSaved =
            serde_json::from_str(&text).map_err(|e| bad(&grpo_path, e.to_string()))?;
        if grpo.data != data {
            return Err(bad(
                &grpo_path,
                format!("saved with data layout {:?}, given {data:?}", grpo.data),
            ));
        }
        if grpo.batches != saved.position as u64 {
            return Err(bad(
                &grpo_path,
                format!(
                    "{} batches but trainer_state.json's position is {}",
                    grpo.batches, saved.position
                ),
            ));
        }
        let state_path = dir.join(state::TRAINER_STATE_FILE);
        let kind = optimizer_kind(&config.optimizer);
        if saved.optimizer != kind {
            return Err(bad(
                &state_path,
                format!("saved with optimizer {}, given {kind}", saved.optimizer),
            ));
        }
        let (mut tree, lora) = if dir.join(crate::lora::ADAPTERS_FILE).is_file() {
            let mut tree = base.ok_or_else(|| {
                bad(
                    &dir,
                    format!(
                        "a LoRA checkpoint ({}) continues over its base model, which was not given",
                        crate::lora::ADAPTERS_FILE
                    ),
                )
            })?;
            let lora = crate::lora::load_adapters(&mut tree, &dir)?;
            (tree, Some(lora))
        } else {
            (ParameterTree::load(&dir, opts)?, None)
        };
        tree.freeze(|_| true);
        for n in &saved.trainable {
            if tree.unfreeze(|k| k == n) != 1 {
                return Err(bad(
                    &state_path,
                    format!(
                        "trainable parameter {n} is not in the saved model (or cannot be trained)"
                    ),
                ));
            }
        }
        let reference = if config.beta > 0.0 {
            let file = dir.join(REFERENCE_FILE);
            if !grpo.reference || !file.is_file() {
                return Err(bad(
                    &grpo_path,
                    format!("beta {} needs the run's reference model, but the checkpoint has no {REFERENCE_FILE} (saved with beta 0)", config.beta),
                ));
            }
            let tensors = mlx_array::io::load_safetensors(&file, None)?;
            let mut r = tree.clone();
            for (name, a) in tensors {
                if r.get(&name).is_none() {
                    return Err(bad(
                        &file,
                        format!("{name} is not a parameter of the model"),
                    ));
                }
                r.set(&name, a)?;
            }
            r.freeze(|_| true);
            Some(r)
        } else {
            None
        };
        let mut optimizer = Optimizer::new(config.optimizer)?;
        let opt_file = dir.join(state::OPTIMIZER_FILE);
        if opt_file.is_file() {
            let names: Vec<&str> = tree.trainable_names();
            let shapes: Vec<Vec<usize>> =
                tree.trainable_arrays().iter().map(|a| a.shape()).collect();
            state::load_optimizer_state(&mut optimizer, &opt_file, &names, &shapes)?;
        } else if optimizer.has_state() && saved.step > 0 {
            return Err(bad(
                &state_path,
                format!(
                    "{} updates done but no {}",
                    saved.step,
                    state::OPTIMIZER_FILE
                ),
            ));
        } else {
            optimizer.set_step(saved.step);
        }
        if optimizer.step() != saved.step {
            return Err(bad(
                &state_path,
                format!(
                    "trainer step {} but optimizer step {}",
                    saved.step,
                    optimizer.step()
                ),
            ));
        }
        let mut t = Self::assemble(tree, reference, opts, config, optimizer)?;
        t.step = saved.step;
        t.batches = grpo.batches;
        t.data = grpo.data;
        t.output = grpo.output;
        t.lora = lora;
        t.guard = t.guard.clone().with_skipped(saved.nan_skipped);
        Ok(t)
    }
}

fn optimizer_kind(c: &OptimizerConfig) -> &'static str {
    match c {
        OptimizerConfig::AdamW(_) => "adamw",
        OptimizerConfig::Sgd(_) => "sgd",
    }
}

/// One line of a rollouts file: `{"group": g, "prompt_ids": [...], "completion_ids": [...],
/// "reward": r}` (`g` a number or a string; `reward` null: unscorable). Other keys (as the
/// output store's JSONL export writes) are ignored.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Rollout {
    pub group: serde_json::Value,
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    pub reward: Option<f64>,
}

/// The groups of a rollouts file, in the order their first line appears; every group must hold
/// `group_size` completions of one prompt.
pub fn load_rollouts(path: &Path, group_size: usize) -> Result<Vec<Vec<Rollout>>> {
    let text = std::fs::read_to_string(path).map_err(crate::error::io_err(path))?;
    let bad = |line: usize, msg: String| TrainError::Data {
        path: path.to_path_buf(),
        line,
        msg,
    };
    let mut groups: Vec<(String, Vec<Rollout>)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: Rollout = serde_json::from_str(line).map_err(|e| bad(i + 1, e.to_string()))?;
        let key = match &r.group {
            serde_json::Value::Number(n) => n.to_string(),
            serde_json::Value::String(s) => format!("{s:?}"),
            other => {
                return Err(bad(
                    i + 1,
                    format!("\"group\" must be a number or a string, got {other}"),
                ))
            }
        };
        if r.prompt_ids.is_empty() {
            return Err(bad(i + 1, "empty prompt_ids".into()));
        }
        if r.reward.is_some_and(|x| !x.is_finite()) {
            return Err(bad(i + 1, "reward must be finite (or null)".into()));
        }
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => {
                if g[0].prompt_ids != r.prompt_ids {
                    return Err(bad(
                        i + 1,
                        format!("group {key}: prompt_ids differ from the group's first line"),
                    ));
                }
                g.push(r);
            }
            None => groups.push((key, vec![r])),
        }
    }
    if groups.is_empty() {
        return Err(bad(0, "no rollouts".into()));
    }
    for (k, g) in &groups {
        if g.len() != group_size {
            return Err(bad(
                0,
                format!(
                    "group {k} has {} completions, the group size is {group_size}",
                    g.len()
                ),
            ));
        }
    }
    Ok(groups.into_iter().map(|(_, g)| g).collect())
}

/// A batch of recorded groups (single reward function `reward`).
pub fn rollout_batch(groups: &[Vec<Rollout>]) -> Result<GrpoBatch> {
    let rows: Vec<&Rollout> = groups.iter().flatten().collect();
    let rewards: Vec<f64> = rows.iter().map(|r| r.reward.unwrap_or(f64::NAN)).collect();
    GrpoBatch::single_reward(
        rows.iter()
            .map(|r| (r.prompt_ids.clone(), r.completion_ids.clone()))
            .collect(),
        &rewards,
    )
}

/// A prompt to sample completions for: its text (recorded and given to reward functions) and
/// its token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoPrompt {
    pub text: String,
    pub ids: Vec<u32>,
}

/// The prompts of a JSONL file, one object a line: `{"prompt": "text"}` (tokenised as it is,
/// without special tokens, as TRL does for plain prompts), `{"messages": [...]}` (rendered by the
/// checkpoint's chat template with the generation prompt) or `{"prompt_ids": [...]}` (with an
/// optional `"prompt"` text).
pub fn load_prompts(path: &Path, enc: &crate::data::TextEncoder) -> Result<Vec<GrpoPrompt>> {
    let text = std::fs::read_to_string(path).map_err(crate::error::io_err(path))?;
    let bad = |line: usize, msg: String| TrainError::Data {
        path: path.to_path_buf(),
        line,
        msg,
    };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(i + 1, e.to_string()))?;
        let text_of =
            |v: &serde_json::Value| v.get("prompt").and_then(|p| p.as_str()).map(str::to_string);
        let prompt = if let Some(ids) = v.get("prompt_ids") {
            let ids: Vec<u32> = serde_json::from_value(ids.clone())
                .map_err(|e| bad(i + 1, format!("prompt_ids: {e}")))?;
            GrpoPrompt {
                text: text_of(&v).unwrap_or_default(),
                ids,
            }
        } else if let Some(m) = v.get("messages") {
            let messages: Vec<mlx_models::chat::ChatMessage> = serde_json::from_value(m.clone())
                .map_err(|e| bad(i + 1, format!("messages: {e}")))?;
            let fmt = enc.chat_format().map_err(|e| bad(i + 1, e.to_string()))?;
            let p = fmt
                .render(&messages, &Default::default())
                .map_err(|e| bad(i + 1, e.to_string()))?;
            GrpoPrompt {
                text: p.text,
                ids: p.ids,
            }
        } else if let Some(t) = text_of(&v) {
            let tok = enc.tokenizer().map_err(|e| bad(i + 1, e.to_string()))?;
            GrpoPrompt {
                ids: tok
                    .encode(&t, false)
                    .map_err(|e| bad(i + 1, e.to_string()))?,
                text: t,
            }
        } else {
            return Err(bad(
                i + 1,
                "expected \"prompt\", \"messages\" or \"prompt_ids\"".into(),
            ));
        };
        if prompt.ids.is_empty() {
            return Err(bad(i + 1, "the prompt has no tokens".into()));
        }
        out.push(prompt);
    }
    if out.is_empty() {
        return Err(bad(0, "no prompts".into()));
    }
    Ok(out)
}

/// Sampling settings of GRPO rollouts: temperature 0.8, top-p 0.95, repetition penalty 1.1
/// (mlx-node's GRPO defaults), the sampling crate's defaults otherwise.
pub fn default_rollout_sampling() -> sampling::SamplingConfig {
    sampling::SamplingConfig {
        temperature: 0.8,
        top_p: 0.95,
        repetition_penalty: 1.1,
        ..Default::default()
    }
}

/// Completions sampled and scored for one step.
#[derive(Debug, Clone)]
pub struct SampledGroups {
    /// What [`GrpoTrainer::step`] takes (reward functions as in the [`crate::rewards::RewardSet`]).
    pub batch: GrpoBatch,
    /// Per completion: its prompt's text, its text and why sampling stopped.
    pub prompt_texts: Vec<String>,
    pub completion_texts: Vec<String>,
    pub finish_reasons: Vec<String>,
    /// Generated tokens per second of the batched decode.
    pub decode_tokens_per_sec: f64,
    pub seconds: f64,
}

impl GrpoTrainer {
    /// Sample `group_size` completions of every prompt with the current policy, all in one
    /// batched generation ([`mlx_models::generate_batch`]: at most `max_completion_length` new
    /// tokens, `sampling`, `stop_tokens` or the model's eos ids), decode them with `decode` and
    /// score them with `rewards`.
    ///
    /// As in TRL, the stop token that ended a completion is part of the trained completion (so
    /// the policy learns when to stop) when the stop set has a single id; with several,
    /// `generate_batch` does not say which one ended it and the completion is trained without it.
    /// Rewards see the decoded text without it.
    pub fn sample(
        &self,
        prompts: &[GrpoPrompt],
        rewards: &crate::rewards::RewardSet,
        sampling: &sampling::SamplingConfig,
        stop_tokens: Option<Vec<u32>>,
        decode: &dyn Fn(&[u32]) -> std::result::Result<String, String>,
    ) -> Result<SampledGroups> {
        if rewards.is_empty() {
            return Err(TrainError::Config("no reward function".into()));
        }
        if prompts.is_empty() {
            return Err(TrainError::InvalidInput("no prompts to sample".into()));
        }
        let started = Instant::now();
        let model = self.policy()?;
        let ids: Vec<Vec<u32>> = prompts.iter().map(|p| p.ids.clone()).collect();
        let stop = stop_tokens.unwrap_or_else(|| model.info().eos_token_ids.clone());
        let single_stop = (stop.len() == 1).then(|| stop[0]);
        let gen_cfg = mlx_models::GenerateConfig {
            max_new_tokens: self.config.max_completion_length,
            sampling: sampling.clone(),
            stop_tokens: Some(stop),
            ..Default::default()
        };
        let out = mlx_models::generate_batch(&model, &ids, self.config.group_size, &gen_cfg)?;
        let n = out.sequences.len();
        let (mut completions, mut prompt_texts, mut completion_texts, mut finish_reasons) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for s in &out.sequences {
            let p = prompts.get(s.prompt_index).ok_or_else(|| {
                TrainError::InvalidInput(format!(
                    "generated sequence for prompt {} of {}",
                    s.prompt_index,
                    prompts.len()
                ))
            })?;
            let text = decode(&s.tokens)
                .map_err(|e| TrainError::InvalidInput(format!("decoding a completion: {e}")))?;
            let mut ids = s.tokens.clone();
            if let (mlx_models::FinishReason::Stop, Some(t)) = (s.finish_reason, single_stop) {
                ids.push(t);
            }
            completions.push(Completion {
                prompt_ids: p.ids.clone(),
                completion_ids: ids,
                rewards: rewards.score(&p.text, &text),
            });
            prompt_texts.push(p.text.clone());
            completion_texts.push(text);
            finish_reasons.push(s.finish_reason.as_str().to_string());
        }
        let batch = GrpoBatch {
            completions,
            reward_names: rewards.names(),
            reward_weights: rewards.weights(),
            old_logprobs: None,
        };
        Ok(SampledGroups {
            batch,
            prompt_texts,
            completion_texts,
            finish_reasons,
            decode_tokens_per_sec: out.decode_tokens_per_sec,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}
