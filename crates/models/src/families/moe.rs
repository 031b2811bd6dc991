//! Mixture-of-experts building blocks, generic over families: router logits → top-k →
//! gathered expert matmuls (`gather_mm`; no loop over experts, except on the CPU for long
//! prompts: one product per chosen expert, `CPU_SEGMENT_ROWS`), plus an optional shared expert.
//!
//! - [`route_topk`]: softmax (f32) over experts, the `k` best, optionally renormalized.
//! - [`SwitchGlu`]: all experts' gated MLPs stacked (`[E, …]`), applied to each token's selected
//!   experts and summed with the routing weights. Loads the fused layout of hub checkpoints
//!   (`experts.gate_up_proj [E, 2I, H]` gate first, `experts.down_proj [E, H, I]`) and the
//!   per-expert layout transformers' `save_pretrained` writes (`experts.N.{gate,up,down}_proj`,
//!   names configurable, e.g. LFM2's `w1`/`w3`/`w2`).
//! - [`SparseMoe`]: the Qwen-style block (router `gate`, routed experts, `shared_expert` scaled
//!   by `sigmoid(shared_expert_gate(x))`).
//!
//! MLX's CPU `GatherMM` only supports f32, which is the CPU compute dtype anyway.
use crate::layers::decoder::ExpertBlock;
use crate::layers::{runs_on_cpu, Activation, GatedMlp, Linear};
use crate::weights::Vb;
use crate::{ModelError, Result};
use mlx_array::{ops, Array, DType, Quantized};

/// Token-expert rows from which [`SwitchGlu`] runs one product per expert on the CPU instead of
/// MLX's `GatherMM` (see `SwitchGlu::forward_segments`). A 2048-token prefill of 4 of 16
/// experts has 8192; below about 512 the per-expert products and the read-back cost more.
pub(crate) const CPU_SEGMENT_ROWS: usize = 1024;

/// Token-expert rows up to which packed experts run the CPU packed kernels (one matrix-vector
/// product per row over its expert's packed bytes); more rows run one f32 product per chosen
/// expert over its weights dequantized on the fly (MLX's CPU `gather_qmm` is slower than both).
const CPU_PACKED_EXPERT_ROWS: usize = 8 * mlx_array::ops::CPU_PACKED_MAX_ROWS;

/// Top-k routing of `logits: [T, E]`: softmax in f32, the `k` largest probabilities (their order
/// is unspecified), renormalized to sum 1 when `normalize`. Returns `(indices u32 [T, k],
/// weights f32 [T, k])`.
pub fn route_topk(logits: &Array, k: usize, normalize: bool) -> Result<(Array, Array)> {
    let probs = logits.astype(DType::F32)?.softmax(-1, true)?;
    route_topk_probs(&probs, k, normalize)
}

/// [`route_topk`] on already-computed scores `[T, E]` (e.g. sigmoid routers, or scores with a
/// selection bias): picks the `k` largest and returns them (renormalized when `normalize`).
pub fn route_topk_probs(scores: &Array, k: usize, normalize: bool) -> Result<(Array, Array)> {
    // the choice is a constant to gradients (as mlx-lm's stop_gradient): a gather's gradient
    // with respect to its indices does not exist
    let idx = mlx_array::grad::stop_gradient(&scores.topk_indices(k, -1)?)?;
    let mut w = scores.take_along_axis(&idx, -1)?;
    if normalize {
        w = w.div(&w.sum(&[-1], true)?)?;
    }
    Ok((idx, w))
}

/// Every expert's gated MLP, stacked for `gather_mm`.
#[derive(Clone)]
pub struct SwitchGlu {
    w: ExpertWeights,
    inter: usize,
    act: Activation,
    /// Expert parallel (a tensor-parallel load): this rank holds experts `start..end` and the
    /// ranks' partial sums are added over the group.
    ep: Option<(mlx_array::distributed::Group, usize, usize)>,
}

#[derive(Clone)]
enum ExpertWeights {
    /// `gate_up: [E, H, 2I]` (transposed for `x @ w`; gate columns first, then up), `down: [E, I, H]`.
    Dense { gate_up: Array, down: Array },
    /// mlx-lm's `switch_mlp` layout with at least one projection MLX-quantized and kept packed:
    /// packed products run `gather_qmm`, float ones `gather_mm`.
    Split(Box<SplitExperts>),
}

/// `gate_proj`, `up_proj` `[E, I, H]` and `down_proj` `[E, H, I]` as mlx-lm stacks them, each
/// packed or float: mlx-lm leaves a projection float when its input width is not a multiple of
/// the group size (e.g. a 32-wide `down_proj` in groups of 64).
#[derive(Clone)]
struct SplitExperts {
    gate: ExpertProj,
    up: ExpertProj,
    down: ExpertProj,
}

/// One stacked expert projection.
#[derive(Clone)]
enum ExpertProj {
    /// Quantized `[E, out, in]` rows (quantized along `in`), as stored.
    Packed(Quantized),
    /// Float `[E, in, out]` (a transposed view of the stored `[E, out, in]`).
    Dense(Array),
}

impl ExpertProj {
    /// `xs @ W[ids]` for the rows `xs` (`[.., 1, in]`) and their experts `ids`.
    fn apply(&self, xs: &Array, ids: &Array, sorted: bool) -> Result<Array> {
        Ok(match self {
            // few (token, slot) rows on the CPU: one matrix-vector product per row over its
            // expert's packed bytes
            ExpertProj::Packed(q) if mlx_array::ops::cpu_packed_supports(q.mode) && ids.size() <= CPU_PACKED_EXPERT_ROWS && runs_on_cpu() => q.cpu_gather_matmul(xs, ids)?,
            ExpertProj::Packed(q) => ops::gather_qmm(xs, q, None, Some(ids), true, sorted)?,
            ExpertProj::Dense(w) => ops::gather_mm(xs, w, None, Some(ids), sorted)?,
        })
    }

    fn num_experts(&self) -> usize {
        match self {
            ExpertProj::Packed(q) => q.weight.shape()[0],
            ExpertProj::Dense(w) => w.shape()[0],
        }
    }

    /// Expert `j`'s `[in, out]` matrix for `x @ w`: packed weights dequantized to f32.
    fn expert(&self, j: usize) -> Result<Array> {
        let one = |a: &Array| -> Result<Array> { Ok(a.slice_axis(0, j, j + 1)?.squeeze(&[0])?) };
        Ok(match self {
            ExpertProj::Packed(q) => {
                let e = Quantized { weight: one(&q.weight)?, scales: one(&q.scales)?, biases: q.biases.as_ref().map(one).transpose()?, mode: q.mode };
                crate::layers::dequantize_f32(&e)?.swap_axes(0, 1)?
            }
            ExpertProj::Dense(w) => one(w)?,
        })
    }
}

impl SwitchGlu {
    /// `vb` at `…switch_mlp` (mlx-lm's layout; Gemma 4's `…switch_glu`): stacked `gate_proj`,
    /// `up_proj` `[E, I, H]` and `down_proj` `[E, H, I]`, each float or MLX-quantized (kept packed,
    /// or dequantized at load as the load options ask).
    ///
    /// A tensor-parallel load holds this rank's `E / N` experts (expert parallelism, as
    /// [`SwitchGlu::load`]): the slices along the expert axis of every stacked tensor (packed
    /// weights, scales and biases alike).
    pub fn load_switch_mlp(vb: &Vb, n_experts: usize, hidden: usize, inter: usize, act: Activation) -> Result<Self> {
        let ep = match crate::layers::parallel::group(vb) {
            Some(g) => {
                let local = crate::layers::parallel::per_rank(vb, "experts", n_experts)?;
                let r = g.rank();
                Some((g, r * local, (r + 1) * local))
            }
            None => None,
        };
        let (e, h, i) = (n_experts, hidden, inter);
        let dequantize_to = vb.weights().dequantize_to;
        // Each projection as stored (`[E, out, in]`), or this rank's experts of it: float, or
        // packed when kept.
        let load = |name: &str, shape: [usize; 3]| -> Result<ExpertProj> {
            let pv = vb.pp(name);
            if !pv.is_quantized() {
                return Ok(ExpertProj::Dense(match &ep {
                    Some((g, ..)) => pv.get_shard("weight", &shape, 0, g.rank(), g.size())?,
                    None => pv.get("weight", &shape)?,
                }));
            }
            let q = match &ep {
                Some((g, ..)) => pv.quantized_shard(&shape, 0, g.rank(), g.size())?,
                None => pv.quantized(&shape)?,
            };
            Ok(match dequantize_to {
                Some(dt) => ExpertProj::Dense(q.dequantize(Some(dt))?),
                None => ExpertProj::Packed(q),
            })
        };
        let (gate, up, down) = (load("gate_proj", [e, i, h])?, load("up_proj", [e, i, h])?, load("down_proj", [e, h, i])?);
        let mut glu = match (gate, up, down) {
            (ExpertProj::Dense(g), ExpertProj::Dense(u), ExpertProj::Dense(d)) => Self::from_fused(ops::concatenate(&[&g, &u], 1)?, d, act)?,
            (gate, up, down) => {
                // float projections run `x @ w`: `[E, in, out]`
                let t = |p: ExpertProj| -> Result<ExpertProj> {
                    Ok(match p {
                        ExpertProj::Dense(w) => ExpertProj::Dense(w.swap_axes(1, 2)?),
                        packed => packed,
                    })
                };
                SwitchGlu { w: ExpertWeights::Split(Box::new(SplitExperts { gate: t(gate)?, up: t(up)?, down: t(down)? })), inter, act, ep: None }
            }
        };
        glu.ep = ep;
        Ok(glu)
    }

    /// Whether some expert projection runs `gather_qmm` over packed weights.
    pub fn is_quantized(&self) -> bool {
        matches!(self.w, ExpertWeights::Split(_))
    }

    /// Build from `gate_up: [E, 2I, H]` (gate rows first) and `down: [E, H, I]` as stored.
    pub fn from_fused(gate_up: Array, down: Array, act: Activation) -> Result<Self> {
        let (gs, ds) = (gate_up.shape(), down.shape());
        if gs.len() != 3 || ds.len() != 3 || gs[0] != ds[0] || gs[1] != 2 * ds[2] || gs[2] != ds[1] {
            return Err(ModelError::InvalidInput(format!("expert shapes gate_up {gs:?} / down {ds:?} do not match [E,2I,H] / [E,H,I]")));
        }
        let w = ExpertWeights::Dense { gate_up: gate_up.swap_axes(1, 2)?, down: down.swap_axes(1, 2)? };
        Ok(SwitchGlu { inter: ds[2], w, act, ep: None })
    }

    /// `vb` at `…mlp.experts`: the fused layout (`gate_up_proj`, `down_proj`, optionally with a
    /// `.weight` suffix) or, failing that, per-expert `N.{names}` `.weight` tensors. `published`:
    /// the layout the family's hub checkpoints use, which a random checkpoint records.
    pub fn load(vb: &Vb, n_experts: usize, hidden: usize, inter: usize, names: [&str; 3], act: Activation, published: ExpertLayout) -> Result<Self> {
        if let Some(g) = crate::layers::parallel::group(vb) {
            return Self::load_expert_parallel(vb, n_experts, hidden, inter, names, act, g);
        }
        for suffix in ["", ".weight"] {
            let (gu, dn) = (format!("gate_up_proj{suffix}"), format!("down_proj{suffix}"));
            let record_fused = vb.recording() && suffix.is_empty() && published == ExpertLayout::Fused;
            if record_fused || vb.contains(&gu) {
                return Self::from_fused(vb.get(&gu, &[n_experts, 2 * inter, hidden])?, vb.get(&dn, &[n_experts, hidden, inter])?, act);
            }
        }
        let (mut gu, mut dn) = (Vec::with_capacity(n_experts), Vec::with_capacity(n_experts));
        for e in 0..n_experts {
            let ev = vb.pp(e);
            let g = ev.pp(names[0]).get("weight", &[inter, hidden])?;
            let u = ev.pp(names[1]).get("weight", &[inter, hidden])?;
            gu.push(ops::concatenate(&[&g, &u], 0)?);
            dn.push(ev.pp(names[2]).get("weight", &[hidden, inter])?);
        }
        let (gr, dr): (Vec<&Array>, Vec<&Array>) = (gu.iter().collect(), dn.iter().collect());
        Self::from_fused(ops::stack(&gr, 0)?, ops::stack(&dr, 0)?, act)
    }

    /// [`SwitchGlu::load`] of this rank's `E / N` experts (expert parallelism): the fused
    /// layout's slices, or only this rank's per-expert tensors (the others are marked read
    /// without being loaded).
    fn load_expert_parallel(vb: &Vb, n_experts: usize, hidden: usize, inter: usize, names: [&str; 3], act: Activation, g: mlx_array::distributed::Group) -> Result<Self> {
        let local = crate::layers::parallel::per_rank(vb, "experts", n_experts)?;
        let (r, n) = (g.rank(), g.size());
        let (start, end) = (r * local, (r + 1) * local);
        let mut glu = None;
        for suffix in ["", ".weight"] {
            let (gu, dn) = (format!("gate_up_proj{suffix}"), format!("down_proj{suffix}"));
            if vb.contains(&gu) {
                glu = Some(Self::from_fused(vb.get_shard(&gu, &[n_experts, 2 * inter, hidden], 0, r, n)?, vb.get_shard(&dn, &[n_experts, hidden, inter], 0, r, n)?, act)?);
                break;
            }
        }
        let mut glu = match glu {
            Some(glu) => glu,
            None => {
                let (mut gu, mut dn) = (Vec::with_capacity(local), Vec::with_capacity(local));
                for e in 0..n_experts {
                    let ev = vb.pp(e);
                    if !(start..end).contains(&e) {
                        for nm in names {
                            ev.pp(nm).skip("weight")?;
                        }
                        continue;
                    }
                    let gt = ev.pp(names[0]).get("weight", &[inter, hidden])?;
                    let u = ev.pp(names[1]).get("weight", &[inter, hidden])?;
                    gu.push(ops::concatenate(&[&gt, &u], 0)?);
                    dn.push(ev.pp(names[2]).get("weight", &[hidden, inter])?);
                }
                let (gr, dr): (Vec<&Array>, Vec<&Array>) = (gu.iter().collect(), dn.iter().collect());
                Self::from_fused(ops::stack(&gr, 0)?, ops::stack(&dr, 0)?, act)?
            }
        };
        glu.ep = Some((g, start, end));
        Ok(glu)
    }

    /// Bytes of the resident expert weights (packed weights, scales and biases when quantized).
    pub fn weight_bytes(&self) -> usize {
        let proj = |p: &ExpertProj| match p {
            ExpertProj::Packed(q) => q.weight.nbytes() + q.scales.nbytes() + q.biases.as_ref().map_or(0, |b| b.nbytes()),
            ExpertProj::Dense(w) => w.nbytes(),
        };
        match &self.w {
            ExpertWeights::Dense { gate_up, down } => gate_up.nbytes() + down.nbytes(),
            ExpertWeights::Split(s) => proj(&s.gate) + proj(&s.up) + proj(&s.down),
        }
    }

    pub fn num_experts(&self) -> usize {
        match &self.w {
            ExpertWeights::Dense { gate_up, .. } => gate_up.shape()[0],
            ExpertWeights::Split(s) => s.gate.num_experts(),
        }
    }

    /// `x: [T, H]`, `idx: [T, k]` expert ids, `weights: [T, k]` → `Σ_k w · expert_k(x)`: `[T, H]`.
    pub fn forward(&self, x: &Array, idx: &Array, weights: &Array) -> Result<Array> {
        if let Some((g, start, end)) = &self.ep {
            // This rank's experts only: other experts' slots get weight 0 (computed with local
            // expert 0 and dropped), and the ranks' partial sums add up to the whole.
            let idx = idx.astype(DType::I32)?;
            let lo = Array::scalar(*start as i32);
            let mine = idx.ge(&lo)?.logical_and(&idx.lt(&Array::scalar(*end as i32))?)?;
            let local = ops::where_(&mine, &idx.sub(&lo)?, &Array::scalar(0i32))?.astype(DType::U32)?;
            let w = ops::where_(&mine, weights, &Array::scalar_as(0.0, weights.dtype())?)?;
            return Ok(g.all_sum(&self.forward_local(x, &local, &w)?)?);
        }
        self.forward_local(x, idx, weights)
    }

    fn forward_local(&self, x: &Array, idx: &Array, weights: &Array) -> Result<Array> {
        let (t, h) = (x.dims()[0], x.dims()[1]);
        let k = idx.dims()[1];
        let n = (t * k) as usize;
        // on the CPU, from some rows on: one product per chosen expert (packed experts
        // dequantized on the fly: the packed kernels are for a few rows)
        let segments = runs_on_cpu() && if self.is_quantized() { n > CPU_PACKED_EXPERT_ROWS } else { n >= CPU_SEGMENT_ROWS };
        let y = if segments {
            self.forward_segments(x, idx, k as usize)?.reshape(&[t, k, h])?
        } else {
            // Sort the (token, slot) pairs by expert for larger batches: the gathered products
            // then walk each expert's rows contiguously.
            self.forward_gather(x, idx, n >= 64)?
        };
        let w = weights.astype(y.dtype())?.expand_dims(-1)?;
        Ok(y.mul(&w)?.sum(&[1], false)?)
    }

    /// The expert MLPs of rows `xs` (`[.., 1, H]`) picked by `ids`, with `GatherMM` (float) or
    /// `gather_qmm` (packed, as mlx-lm's `QuantizedSwitchLinear`): `[.., 1, H]`.
    fn gathered(&self, xs: &Array, ids: &Array, sorted: bool) -> Result<Array> {
        match &self.w {
            ExpertWeights::Dense { gate_up, down } => {
                let hgu = ops::gather_mm(xs, gate_up, None, Some(ids), sorted)?;
                Ok(ops::gather_mm(&self.glu(&hgu)?, down, None, Some(ids), sorted)?)
            }
            ExpertWeights::Split(s) => {
                let g = s.gate.apply(xs, ids, sorted)?;
                let u = s.up.apply(xs, ids, sorted)?;
                s.down.apply(&self.act.gated(&g, &u)?, ids, sorted)
            }
        }
    }

    /// Every `(token, slot)` row through the gathered products, rows sorted by expert when
    /// `sort`: `[T, k, H]`.
    fn forward_gather(&self, x: &Array, idx: &Array, sort: bool) -> Result<Array> {
        let (t, h) = (x.dims()[0], x.dims()[1]);
        let k = idx.dims()[1];
        let n = (t * k) as usize;
        Ok(if sort {
            let flat = idx.reshape(&[-1])?;
            let order = flat.argsort(0)?;
            let inv = order.argsort(0)?;
            let sorted_idx = flat.take(&order, 0)?;
            let rows = order.floor_divide_u32(k as u32)?;
            let xs = x.take(&rows, 0)?.reshape(&[n as i32, 1, h])?;
            self.gathered(&xs, &sorted_idx, true)?.take(&inv, 0)?.reshape(&[t, k, h])? // [n, 1, H] back in row order
        } else {
            self.gathered(&x.reshape(&[t, 1, 1, h])?, idx, false)?.reshape(&[t, k, h])? // [T, k, 1, H]
        })
    }

    /// The `(token, slot)` rows `x[i / k]` grouped by expert on the host (a counting sort of
    /// `idx`, which this reads back), one product per expert over its rows, then back in row
    /// order: `[T * k, H]`. On the CPU, from [`CPU_SEGMENT_ROWS`] rows, this is faster than
    /// MLX's `GatherMM` over the sorted rows (BENCHMARKS.md, "CPU: long prompts"); packed
    /// experts take it above `CPU_PACKED_EXPERT_ROWS` rows, each chosen expert dequantized to f32
    /// (faster than MLX's CPU `gather_qmm`, BENCHMARKS.md, "Packed CPU kernels").
    fn forward_segments(&self, x: &Array, idx: &Array, k: usize) -> Result<Array> {
        let e = self.num_experts();
        let ids = idx.reshape(&[-1])?.astype(DType::U32)?.to_vec::<u32>()?;
        let mut counts = vec![0usize; e];
        for &i in &ids {
            *counts.get_mut(i as usize).ok_or_else(|| ModelError::InvalidInput(format!("expert index {i} of {e} experts")))? += 1;
        }
        let mut starts = vec![0usize; e + 1];
        for j in 0..e {
            starts[j + 1] = starts[j] + counts[j];
        }
        let (mut next, n) = (starts.clone(), ids.len());
        let (mut order, mut inv) = (vec![0u32; n], vec![0u32; n]);
        for (r, &i) in ids.iter().enumerate() {
            let at = next[i as usize];
            order[at] = (r / k) as u32; // the token of row r
            inv[r] = at as u32;
            next[i as usize] += 1;
        }
        let xs = x.take(&Array::from_slice(&order, &[n])?, 0)?;
        let mut outs = Vec::with_capacity(e);
        for j in (0..e).filter(|&j| counts[j] > 0) {
            let rows = xs.slice_axis(0, starts[j], starts[j + 1])?;
            outs.push(match &self.w {
                ExpertWeights::Dense { gate_up, down } => {
                    let gu = rows.matmul(&gate_up.slice_axis(0, j, j + 1)?.squeeze(&[0])?)?;
                    self.glu(&gu)?.matmul(&down.slice_axis(0, j, j + 1)?.squeeze(&[0])?)?
                }
                ExpertWeights::Split(s) => {
                    let (g, u) = (rows.matmul(&s.gate.expert(j)?)?, rows.matmul(&s.up.expert(j)?)?);
                    self.act.gated(&g, &u)?.matmul(&s.down.expert(j)?)?.astype(x.dtype())?
                }
            });
        }
        let refs: Vec<&Array> = outs.iter().collect();
        Ok(ops::concatenate(&refs, 0)?.take(&Array::from_slice(&inv, &[n])?, 0)?)
    }

    fn glu(&self, gu: &Array) -> Result<Array> {
        let parts = gu.split_at(&[self.inter], -1)?;
        self.act.gated(&parts[0], &parts[1])
    }
}

/// Integer helpers kept local (the array API has no integer floor-divide by a scalar).
trait FloorDivU32 {
    fn floor_divide_u32(&self, d: u32) -> Result<Array>;
}
impl FloorDivU32 for Array {
    fn floor_divide_u32(&self, d: u32) -> Result<Array> {
        let a = self.astype(DType::U32)?;
        let r = a.remainder(&Array::scalar(d))?;
        Ok(a.sub(&r)?.div(&Array::scalar(d))?.astype(DType::U32)?)
    }
}

/// Float expert weights are the trainable arrays; packed ones stay constants.
impl crate::layers::LayerArrays for SwitchGlu {
    fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut Array)) {
        match &mut self.w {
            ExpertWeights::Dense { gate_up, down } => {
                f(gate_up);
                f(down);
            }
            ExpertWeights::Split(s) => {
                for p in [&mut s.gate, &mut s.up, &mut s.down] {
                    if let ExpertProj::Dense(w) = p {
                        f(w);
                    }
                }
            }
        }
    }
}

/// A Qwen-style sparse MoE block (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE).
#[derive(Clone)]
pub struct SparseMoe {
    router: Linear,
    experts: SwitchGlu,
    shared: Option<GatedMlp>,
    shared_gate: Option<Linear>,
    top_k: usize,
    norm_topk_prob: bool,
}

crate::layers::layer_arrays!(SparseMoe { router, experts, shared, shared_gate });

/// How a family's published checkpoints store routed experts (both load; a random checkpoint
/// writes this one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `experts.gate_up_proj` `[E, 2I, H]` (gate first) and `experts.down_proj` `[E, H, I]`.
    Fused,
    /// `experts.N.{gate,up,down}` `.weight` per expert.
    PerExpert,
}

/// Shapes and options of [`SparseMoe`].
#[derive(Debug, Clone)]
pub struct SparseMoeConfig {
    pub hidden: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub moe_intermediate: usize,
    /// 0: no shared expert.
    pub shared_intermediate: usize,
    pub norm_topk_prob: bool,
    pub act: Activation,
}

impl SparseMoe {
    /// `vb` at `…mlp`: `gate` (router `[E, H]`), `experts`, and when configured `shared_expert`
    /// and `shared_expert_gate` (`[1, H]`, optional).
    pub fn load(vb: &Vb, cfg: &SparseMoeConfig) -> Result<Self> {
        if cfg.top_k == 0 || cfg.top_k > cfg.num_experts {
            return Err(ModelError::InvalidInput(format!("num_experts_per_tok {} must be in 1..={}", cfg.top_k, cfg.num_experts)));
        }
        let (shared, shared_gate) = if cfg.shared_intermediate > 0 {
            let s = GatedMlp::load(&vb.pp("shared_expert"), cfg.hidden, cfg.shared_intermediate, cfg.act)?;
            // Qwen3.5 / Qwen3-Next checkpoints carry the gate; a random one records it.
            let g = if vb.recording() || vb.contains("shared_expert_gate.weight") { Some(Linear::load(&vb.pp("shared_expert_gate"), cfg.hidden, 1, false)?) } else { None };
            (Some(s), g)
        } else {
            (None, None)
        };
        Ok(SparseMoe {
            router: Linear::load(&vb.pp("gate"), cfg.hidden, cfg.num_experts, false)?,
            // HF's `experts` (fused or per expert), or mlx-lm's stacked `switch_mlp`.
            experts: if vb.contains("switch_mlp.gate_proj.weight") {
                SwitchGlu::load_switch_mlp(&vb.pp("switch_mlp"), cfg.num_experts, cfg.hidden, cfg.moe_intermediate, cfg.act)?
            } else {
                SwitchGlu::load(&vb.pp("experts"), cfg.num_experts, cfg.hidden, cfg.moe_intermediate, ["gate_proj", "up_proj", "down_proj"], cfg.act, ExpertLayout::Fused)?
            },
            shared,
            shared_gate,
            top_k: cfg.top_k,
            norm_topk_prob: cfg.norm_topk_prob,
        })
    }

    /// `x: [B, L, H]` → `[B, L, H]`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let dims = x.dims().to_vec();
        let flat = x.reshape(&[-1, dims[2]])?;
        let (idx, w) = route_topk(&self.router.forward(&flat)?, self.top_k, self.norm_topk_prob)?;
        let mut y = self.experts.forward(&flat, &idx, &w)?;
        if let Some(s) = &self.shared {
            let mut sh = s.forward(&flat)?;
            if let Some(g) = &self.shared_gate {
                sh = sh.mul(&g.forward(&flat)?.sigmoid()?)?;
            }
            y = y.add(&sh)?;
        }
        Ok(y.reshape(&dims)?)
    }
}

impl ExpertBlock for SparseMoe {
    fn forward_experts(&self, x: &Array) -> Result<Array> {
        self.forward(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_array::random;

    fn glu_experts(e: usize, h: usize, i: usize, seed: u64) -> (SwitchGlu, Vec<f32>, Vec<f32>) {
        let ks = random::Key::new(seed).unwrap().split_n(2).unwrap();
        let gu = random::normal(&[e, 2 * i, h], DType::F32, &ks[0]).unwrap();
        let dn = random::normal(&[e, h, i], DType::F32, &ks[1]).unwrap();
        let (g, d) = (gu.to_vec::<f32>().unwrap(), dn.to_vec::<f32>().unwrap());
        (SwitchGlu::from_fused(gu, dn, Activation::Silu).unwrap(), g, d)
    }

    /// `expert(x)` computed row by row on the host from the stored `[E, 2I, H]` / `[E, H, I]`.
    fn naive(gu: &[f32], dn: &[f32], h: usize, i: usize, e: usize, x: &[f32]) -> Vec<f32> {
        let dot = |w: &[f32], v: &[f32]| w.iter().zip(v).map(|(a, b)| a * b).sum::<f32>();
        let mid: Vec<f32> = (0..i)
            .map(|j| {
                let g = dot(&gu[(e * 2 * i + j) * h..][..h], x);
                let u = dot(&gu[(e * 2 * i + i + j) * h..][..h], x);
                g / (1.0 + (-g).exp()) * u
            })
            .collect();
        (0..h).map(|r| dot(&dn[(e * h + r) * i..][..i], &mid)).collect()
    }

    /// The per-expert products against a host reference and against the GatherMM path, with
    /// one expert chosen by no row. Wrong row bookkeeping (order or inverse) moves rows to the
    /// wrong tokens, far past the tolerance.
    #[test]
    fn expert_segments_match_gather_and_reference() {
        let (e, h, i, t, k) = (6, 16, 8, 300, 4);
        let (glu, gu, dn) = glu_experts(e, h, i, 3);
        let x = random::normal(&[t, h], DType::F32, &random::Key::new(9).unwrap()).unwrap();
        // experts 0..5 only (expert 5 never chosen), every slot of a token a different expert
        let ids: Vec<u32> = (0..t * k).map(|r| ((r / k * 7 + (r % k)) % (e - 1)) as u32).collect();
        let idx = Array::from_slice(&ids, &[t, k]).unwrap();
        let seg = glu.forward_segments(&x, &idx, k).unwrap().to_vec::<f32>().unwrap();
        let gat = glu.forward_gather(&x, &idx, true).unwrap().reshape(&[-1]).unwrap().to_vec::<f32>().unwrap();
        let xs = x.to_vec::<f32>().unwrap();
        let (mut d_gather, mut d_ref) = (0f32, 0f32);
        for r in 0..t * k {
            let want = naive(&gu, &dn, h, i, ids[r] as usize, &xs[r / k * h..][..h]);
            for c in 0..h {
                let s = seg[r * h + c];
                d_gather = d_gather.max((s - gat[r * h + c]).abs());
                d_ref = d_ref.max((s - want[c]).abs() / (1.0 + want[c].abs()));
            }
        }
        assert!(d_gather < 1e-4 && d_ref < 1e-4, "vs gather {d_gather}, vs reference {d_ref}");
    }

    /// mlx-lm's stacked experts from its quantized Gemma 4 MoE fixtures: kept packed they run
    /// `gather_qmm` over about bits/32 of the f32 bytes (a projection mlx-lm left float, the
    /// 32-wide `down_proj` in groups of 64, runs `gather_mm`), with the products of the
    /// experts dequantized at load.
    #[test]
    fn quantized_switch_experts_stay_packed_unless_asked() {
        use crate::weights::{QuantSpec, Weights};
        let (e, h, i) = (4usize, 64usize, 32usize);
        let f32_bytes = e * 3 * h * i * 4;
        // (fixture, resident bytes kept packed): affine 4/64 packs gate and up (4 bits + f32 scale
        // and bias per 64) and keeps down f32; mxfp4 packs all three (4 bits + a u8 scale per 32).
        for (name, packed_bytes) in [("gemma4_text_moe_q4", e * 2 * h * i * 5 / 8 + e * h * i * 4), ("gemma4_text_moe_mxfp4", e * 3 * h * i * 17 / 32)] {
            let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny").join(name);
            let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
            let mut w = Weights::load(&dir, Some(DType::F32)).unwrap();
            w.quant = QuantSpec::from_config(&cfg).unwrap();
            let load = |w: &Weights| SwitchGlu::load_switch_mlp(&w.root().pp("model.layers.1.experts.switch_glu"), e, h, i, Activation::GeluTanh).unwrap();
            let q = load(&w);
            assert!(q.is_quantized(), "{name}");
            assert_eq!(q.weight_bytes(), packed_bytes, "{name}");
            w.dequantize_to = Some(DType::F32);
            let d = load(&w);
            assert!(!d.is_quantized(), "{name}");
            assert_eq!(d.weight_bytes(), f32_bytes, "{name}");
            let ks = random::Key::new(3).unwrap().split_n(2).unwrap();
            let x = random::normal(&[40, h], DType::F32, &ks[0]).unwrap();
            let idx = random::randint(&[40, 2], 0, e as i32, DType::U32, &ks[1]).unwrap();
            let wts = Array::full(&[40, 2], 0.5, DType::F32).unwrap();
            // 80 rows: the sorted gather path; 2 rows: the unsorted one
            for t in [40, 1] {
                let (xs, ids, ws) = (x.slice_axis(0, 0, t).unwrap(), idx.slice_axis(0, 0, t).unwrap(), wts.slice_axis(0, 0, t).unwrap());
                let a = q.forward(&xs, &ids, &ws).unwrap().to_vec::<f32>().unwrap();
                let b = d.forward(&xs, &ids, &ws).unwrap().to_vec::<f32>().unwrap();
                let err = a.iter().zip(&b).map(|(p, r)| (p - r).abs() / (1.0 + r.abs())).fold(0f32, f32::max);
                assert!(err < 1e-5, "{name} {t} tokens: gather_qmm vs dequantized experts {err}");
            }
        }
    }

    #[test]
    fn expert_segments_refuse_unknown_experts() {
        let (glu, _, _) = glu_experts(3, 8, 4, 1);
        let x = Array::zeros(&[2, 8], DType::F32).unwrap();
        let idx = Array::from_slice(&[0u32, 1, 2, 3], &[2, 2]).unwrap();
        assert!(glu.forward_segments(&x, &idx, 2).is_err());
    }
}
