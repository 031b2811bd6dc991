//! Optimizers over named parameters (AdamW, SGD with optional momentum), gradient clipping and
//! learning-rate schedules.
//!
//! The updates follow torch's `torch.optim.AdamW` and `torch.optim.SGD` (single-tensor, not
//! foreach): AdamW decays the parameter first (`p *= 1 - lr * weight_decay`, decoupled), then
//! `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2` and
//! `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`, the bias corrections computed
//! in f64 as Python floats are; SGD adds `weight_decay * p` to the gradient, keeps
//! `buf = g` on the first step and `buf = momentum * buf + (1 - dampening) * g` after, and steps
//! by `lr * buf` (by `lr * g` without momentum).
use crate::error::{Result, TrainError};
use mlx_array::{Array, DType};
use mlx_models::ParameterTree;
use std::collections::BTreeMap;

/// AdamW hyper-parameters (the learning rate comes from the schedule). Defaults: β 0.9/0.999,
/// ε 1e-8, weight decay 0.01 (torch's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

/// SGD hyper-parameters. Default: plain SGD (no momentum, no dampening, no weight decay).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SgdConfig {
    pub momentum: f64,
    pub dampening: f64,
    /// L2 penalty added to the gradient (coupled, as torch's SGD does).
    pub weight_decay: f64,
}

/// Which optimizer, with its hyper-parameters. Default: AdamW with its defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerConfig {
    AdamW(AdamWConfig),
    Sgd(SgdConfig),
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::AdamW(AdamWConfig::default())
    }
}

impl OptimizerConfig {
    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Config(m));
        match *self {
            OptimizerConfig::AdamW(c) => {
                if !(0.0..1.0).contains(&c.beta1) || !(0.0..1.0).contains(&c.beta2) {
                    return bad(format!("AdamW betas must lie in [0, 1), got {} and {}", c.beta1, c.beta2));
                }
                if c.eps.is_nan() || c.eps <= 0.0 || c.weight_decay.is_nan() || c.weight_decay < 0.0 {
                    return bad(format!("AdamW needs eps > 0 and weight_decay >= 0, got {} and {}", c.eps, c.weight_decay));
                }
            }
            OptimizerConfig::Sgd(c) => {
                if c.momentum.is_nan() || c.momentum < 0.0 || !(0.0..=1.0).contains(&c.dampening) || c.weight_decay.is_nan() || c.weight_decay < 0.0 {
                    return bad(format!("SGD needs momentum >= 0, dampening in [0, 1], weight_decay >= 0; got {}, {}, {}", c.momentum, c.dampening, c.weight_decay));
                }
            }
        }
        Ok(())
    }
}

/// Per-parameter state: AdamW's moments, or SGD's momentum buffer.
#[derive(Clone)]
pub(crate) enum Slot {
    Adam { m: Array, v: Array },
    Momentum(Array),
}

/// An optimizer over named parameters: its configuration, the number of updates applied
/// (`step`, AdamW's bias-correction count) and each parameter's state by name.
#[derive(Clone)]
pub struct Optimizer {
    config: OptimizerConfig,
    step: u64,
    pub(crate) slots: BTreeMap<String, Slot>,
}

impl Optimizer {
    pub fn new(config: OptimizerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Optimizer { config, step: 0, slots: BTreeMap::new() })
    }

    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Updates applied so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    pub(crate) fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Whether the optimizer holds per-parameter state (AdamW, or SGD with momentum) once it
    /// has updated.
    pub fn has_state(&self) -> bool {
        match self.config {
            OptimizerConfig::AdamW(_) => true,
            OptimizerConfig::Sgd(c) => c.momentum != 0.0,
        }
    }

    /// Apply one update with learning rate `lr` to `params` (named by `names`) given `grads`;
    /// returns the new parameters (evaluated) in the same order.
    pub fn update(&mut self, names: &[&str], params: &[Array], grads: &[Array], lr: f64) -> Result<Vec<Array>> {
        let pending = self.prepare(names, params, grads, lr)?;
        mlx_array::eval(&pending.arrays())?;
        Ok(self.commit(pending))
    }

    /// The update [`Optimizer::update`] would apply, as lazy arrays (new parameters and
    /// per-parameter state), without changing the optimizer: evaluate them together with
    /// whatever else the step computes ([`PendingUpdate::arrays`]), then
    /// [`Optimizer::commit`] them, or drop them to skip the update. AdamW's arithmetic per
    /// parameter is one [`mlx_array::ops::fused`] function (one kernel where MLX compiles on
    /// this device; the same ops one by one otherwise).
    pub fn prepare(&self, names: &[&str], params: &[Array], grads: &[Array], lr: f64) -> Result<PendingUpdate> {
        if names.len() != params.len() || params.len() != grads.len() {
            return Err(TrainError::InvalidInput(format!("{} names, {} parameters and {} gradients", names.len(), params.len(), grads.len())));
        }
        for ((n, p), g) in names.iter().zip(params).zip(grads) {
            if p.shape() != g.shape() {
                return Err(TrainError::InvalidInput(format!("{n}: parameter shape {:?}, gradient shape {:?}", p.shape(), g.shape())));
            }
            if !p.dtype().is_float() {
                return Err(TrainError::InvalidInput(format!("{n}: dtype {} is not trainable", p.dtype())));
            }
        }
        if !lr.is_finite() || lr < 0.0 {
            return Err(TrainError::Config(format!("learning rate {lr}")));
        }
        let t = self.step + 1;
        let mut out = Vec::with_capacity(params.len());
        let mut slots = Vec::with_capacity(params.len());
        for ((name, p), g) in names.iter().zip(params).zip(grads) {
            let dt = p.dtype();
            let s = |x: f64| Array::scalar_as(x as f32, dt);
            // A parameter stored column-major ([`column_major_linears`]) is updated through the
            // transposed views of itself, its gradient and state: with a column-major gradient (a
            // linear weight's is the transpose of the product that computed it) every operand
            // and result is then contiguous in memory. An elementwise update gives the same
            // values in any layout; the results are transposed back, so parameters keep their
            // layout (and a resumed run's products see the layouts an uninterrupted run's do).
            let flip = column_major(p);
            let view = |a: &Array| if flip { a.transpose(&[1, 0]) } else { Ok(a.clone()) };
            let (p, g) = (&view(p)?, view(&g.astype(dt)?)?);
            let new_p = match self.config {
                OptimizerConfig::AdamW(c) => {
                    let (m0, v0) = match self.slots.get(*name) {
                        Some(Slot::Adam { m, v }) => (view(m)?, view(v)?),
                        Some(Slot::Momentum(_)) => return Err(TrainError::InvalidInput(format!("{name}: SGD state in an AdamW optimizer"))),
                        None => {
                            let z = Array::zeros(&p.shape(), dt)?;
                            (z.clone(), z)
                        }
                    };
                    let bc1 = 1.0 - c.beta1.powi(t as i32);
                    let bc2_sqrt = (1.0 - c.beta2.powi(t as i32)).sqrt();
                    let k = [s(1.0 - lr * c.weight_decay)?, s(c.beta1)?, s(1.0 - c.beta1)?, s(c.beta2)?, s(1.0 - c.beta2)?, s(bc2_sqrt)?, s(c.eps)?, s(lr / bc1)?];
                    let mut inputs: Vec<&Array> = vec![p, &g, &m0, &v0];
                    inputs.extend(k.iter());
                    let r = mlx_array::ops::fused(adamw_fn, false, &inputs)?;
                    let mut r = r.iter().map(view);
                    let (Some(new_p), Some(m), Some(v)) = (r.next(), r.next(), r.next()) else {
                        return Err(TrainError::InvalidInput(format!("{name}: the AdamW update returned too few arrays")));
                    };
                    slots.push((name.to_string(), Slot::Adam { m: m?, v: v? }));
                    new_p?
                }
                OptimizerConfig::Sgd(c) => {
                    let g = if c.weight_decay != 0.0 { g.add(&p.mul(&s(c.weight_decay)?)?)? } else { g };
                    let d = if c.momentum != 0.0 {
                        let buf = match self.slots.get(*name) {
                            Some(Slot::Momentum(b)) => view(b)?.mul(&s(c.momentum)?)?.add(&g.mul(&s(1.0 - c.dampening)?)?)?,
                            Some(Slot::Adam { .. }) => return Err(TrainError::InvalidInput(format!("{name}: AdamW state in an SGD optimizer"))),
                            None => g,
                        };
                        slots.push((name.to_string(), Slot::Momentum(view(&buf)?)));
                        buf
                    } else {
                        g
                    };
                    view(&p.sub(&d.mul(&s(lr)?)?)?)?
                }
            };
            out.push(new_p);
        }
        Ok(PendingUpdate { params: out, slots, step: t })
    }

    /// One update of `tree`'s trainable parameters with `grads` (in
    /// [`ParameterTree::trainable_names`] order) and learning rate `lr`, evaluated. The tree
    /// and the optimizer take the new (lazy) arrays before they are evaluated: the old
    /// parameters, moments and gradients are then held by the update's graph alone (unless
    /// something else holds them), and MLX writes the new values into their buffers (donation)
    /// instead of allocating new ones.
    pub fn update_tree(&mut self, tree: &mut ParameterTree, grads: Vec<Array>, lr: f64) -> Result<()> {
        let names: Vec<String> = tree.trainable_names().iter().map(|s| s.to_string()).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let update = self.prepare(&refs, &tree.trainable_arrays(), &grads, lr)?;
        drop(grads);
        let pending: Vec<Array> = update.arrays().into_iter().cloned().collect();
        let new = self.commit(update);
        *tree = tree.with_trainable(&new)?;
        drop(new);
        mlx_array::eval(&pending.iter().collect::<Vec<_>>())?;
        Ok(())
    }

    /// Install a [`Optimizer::prepare`]d update (its state, one more step); returns the new
    /// parameters.
    pub fn commit(&mut self, pending: PendingUpdate) -> Vec<Array> {
        let PendingUpdate { params, slots, step } = pending;
        self.slots.extend(slots);
        self.step = step;
        params
    }
}

/// An update computed by [`Optimizer::prepare`] and not yet applied.
pub struct PendingUpdate {
    params: Vec<Array>,
    slots: Vec<(String, Slot)>,
    step: u64,
}

impl PendingUpdate {
    /// Every array of the update (new parameters, then new state), to evaluate.
    pub fn arrays(&self) -> Vec<&Array> {
        let state = self.slots.iter().flat_map(|(_, s)| match s {
            Slot::Adam { m, v } => vec![m, v],
            Slot::Momentum(b) => vec![b],
        });
        self.params.iter().chain(state).collect()
    }
}

/// Store `tree`'s trainable linear-projection weights ([`crate::lora::linear_projections`])
/// column-major (same values, transposed memory layout), as their gradients come: their AdamW
/// updates then run over contiguous memory ([`Optimizer::prepare`]), and keep the layout. A
/// trainer does this when it is made (new or resumed), so a run's products see the same layouts
/// at every step whether or not it was resumed (resume stays bit-exact).
pub fn column_major_linears(tree: &mut ParameterTree) -> Result<()> {
    let names: Vec<String> = crate::lora::linear_projections(tree)?.into_iter().map(|t| format!("{}.weight", t.prefix)).collect();
    for name in names {
        let Some(p) = tree.get(&name).filter(|p| p.trainable && !p.packed && p.array.ndim() == 2) else { continue };
        if column_major(&p.array) {
            continue;
        }
        let t = p.array.transpose(&[1, 0])?;
        let copy = Array::from_mlx(t.as_mlx().contiguous().map_err(|e| mlx_array::Error::Mlx { op: "contiguous", msg: e.to_string() })?);
        let col = copy.transpose(&[1, 0])?;
        col.eval()?;
        tree.set(&name, col)?;
    }
    Ok(())
}

/// Whether `a` is an evaluated matrix stored column-major (the transposed view of a row-major
/// one), not also row-major.
fn column_major(a: &Array) -> bool {
    let shape = a.shape();
    a.ndim() == 2 && shape[0] > 1 && shape[1] > 1 && a.is_available() && a.as_mlx().strides() == [1, shape[0]]
}

/// AdamW for one parameter: inputs `p, g, m, v` and the scalars `1 - lr wd, b1, 1 - b1, b2,
/// 1 - b2, sqrt(1 - b2^t), eps, lr / (1 - b1^t)` (in the parameter's dtype); outputs the new
/// `p, m, v`. The torch formula of the module docs, op for op.
fn adamw_fn(x: &[Array]) -> mlx_array::Result<Vec<Array>> {
    let [p, g, m0, v0, decay, b1, one_minus_b1, b2, one_minus_b2, bc2_sqrt, eps, step_size] = x else {
        return Err(mlx_array::Error::InvalidArgument { op: "adamw", msg: format!("12 inputs expected, got {}", x.len()) });
    };
    let decayed = p.mul(decay)?;
    let m = m0.mul(b1)?.add(&g.mul(one_minus_b1)?)?;
    let v = v0.mul(b2)?.add(&g.square()?.mul(one_minus_b2)?)?;
    let denom = v.sqrt()?.div(bc2_sqrt)?.add(eps)?;
    let new_p = decayed.sub(&m.div(&denom)?.mul(step_size)?)?;
    Ok(vec![new_p, m, v])
}

/// Gradient clipping. Both may be set: values are clipped first, then the global norm.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ClipConfig {
    /// Scale all gradients by `max_norm / (norm + 1e-6)` when their global L2 norm exceeds
    /// `max_norm` (torch's `clip_grad_norm_`). `None`: off.
    pub max_norm: Option<f64>,
    /// Clamp every gradient element to `[-v, v]` (torch's `clip_grad_value_`). `None`: off.
    pub max_value: Option<f64>,
}

/// Global L2 norm of `grads` (f32 scalar array, not evaluated).
pub fn global_norm(grads: &[Array]) -> Result<Array> {
    let mut total: Option<Array> = None;
    for g in grads {
        let sq = g.astype(DType::F32)?.square()?.sum(&[], false)?;
        total = Some(match total {
            Some(t) => t.add(&sq)?,
            None => sq,
        });
    }
    Ok(total.unwrap_or(Array::scalar(0f32)).sqrt()?)
}

/// Clip `grads` as `config` says. Returns the clipped gradients and the global norm measured
/// before norm clipping (after value clipping, as torch measures when both run in that order).
pub fn clip_gradients(grads: Vec<Array>, config: &ClipConfig) -> Result<(Vec<Array>, f32)> {
    let (grads, norm) = clip_gradients_lazy(grads, config)?;
    let norm_value = norm.item::<f32>()?;
    Ok((grads, norm_value))
}

/// [`clip_gradients`] without evaluating anything: the norm is returned as an f32 scalar array,
/// to be evaluated with the rest of the step.
pub fn clip_gradients_lazy(grads: Vec<Array>, config: &ClipConfig) -> Result<(Vec<Array>, Array)> {
    let grads = match config.max_value {
        Some(v) if v.is_nan() || v <= 0.0 => return Err(TrainError::Config(format!("clip value {v} must be > 0"))),
        Some(v) => grads.iter().map(|g| g.clip(-v as f32, v as f32)).collect::<mlx_array::Result<Vec<_>>>()?,
        None => grads,
    };
    let norm = global_norm(&grads)?;
    let grads = match config.max_norm {
        Some(m) if m.is_nan() || m <= 0.0 => return Err(TrainError::Config(format!("max grad norm {m} must be > 0 (None turns clipping off)"))),
        Some(m) => {
            // torch: coef = max_norm / (norm + 1e-6), clamped to 1, always applied
            let coef = Array::scalar(m as f32).div(&norm.add_scalar(1e-6)?)?.minimum(&Array::scalar(1f32))?;
            grads.iter().map(|g| g.mul(&coef.astype(g.dtype())?)).collect::<mlx_array::Result<Vec<_>>>()?
        }
        None => grads,
    };
    Ok((grads, norm))
}

/// How the learning rate changes over the updates.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum ScheduleKind {
    /// The peak rate throughout (after any warm-up).
    #[default]
    Constant,
    /// Half a cosine from the peak rate down to `min_lr` over the updates after warm-up.
    Cosine { min_lr: f64 },
}

/// A learning-rate schedule: linear warm-up from 0 over `warmup_steps` updates, then constant or
/// cosine decay to `total_steps` (transformers' `get_constant_schedule_with_warmup` and
/// `get_cosine_schedule_with_warmup`: the rate of update `i`, counted from 0, is
/// `lr * i / warmup` during warm-up). Default: constant, no warm-up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    pub lr: f64,
    pub warmup_steps: u64,
    pub kind: ScheduleKind,
    /// Updates the cosine spans (warm-up included); unused by a constant schedule.
    pub total_steps: u64,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule { lr: 1e-5, warmup_steps: 0, kind: ScheduleKind::Constant, total_steps: 0 }
    }
}

impl Schedule {
    pub fn validate(&self) -> Result<()> {
        if !self.lr.is_finite() || self.lr < 0.0 {
            return Err(TrainError::Config(format!("learning rate {} must be finite and >= 0", self.lr)));
        }
        if let ScheduleKind::Cosine { min_lr } = self.kind {
            if !(min_lr >= 0.0 && min_lr <= self.lr) {
                return Err(TrainError::Config(format!("cosine min_lr {min_lr} must lie in [0, lr = {}]", self.lr)));
            }
            if self.total_steps <= self.warmup_steps {
                return Err(TrainError::Config(format!("a cosine schedule needs total_steps ({}) > warmup_steps ({})", self.total_steps, self.warmup_steps)));
            }
        }
        Ok(())
    }

    /// The learning rate of update `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * step as f64 / self.warmup_steps as f64;
        }
        match self.kind {
            ScheduleKind::Constant => self.lr,
            ScheduleKind::Cosine { min_lr } => {
                let span = (self.total_steps - self.warmup_steps).max(1) as f64;
                let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
                min_lr + (self.lr - min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}
