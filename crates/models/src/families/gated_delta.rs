//! GatedDeltaNet linear attention (Qwen3.5, Qwen3-Next): the recurrent token mixer of the hybrid
//! stacks. Mirrors transformers' `Qwen3_5GatedDeltaNet` and mlx-lm's `gated_delta.py`.
//!
//! Per layer:
//! 1. `in_proj_qkv` → `[q | k | v]` (`2·Hk·Dk + Hv·Dv` channels), `in_proj_z` → gate `z`,
//!    `in_proj_b` → `β = sigmoid(b)`, `in_proj_a` → `g = -exp(A_log) · softplus(a + dt_bias)`.
//! 2. A depthwise causal conv1d (kernel `K`, no bias) over the qkv channels, then SiLU. The cache
//!    keeps the last `K - 1` conv *inputs* (slot 0, `[B, K-1, C]`).
//! 3. `q`, `k` are L2-normalized per head (eps 1e-6), `q` is scaled by `Dk^-1/2`, and key heads are
//!    repeated (interleaved) to the value heads.
//! 4. The gated delta rule over the state `S` (`Dk × Dv` per head; slot 1, f32, stored
//!    transposed as `Sᵀ: [B, Hv, Dv, Dk]`, as mlx-lm does, so the decode step's two reductions
//!    run over the contiguous last axis):
//!    `S ← S·exp(g_t)`, `S ← S + k_t ⊗ β_t (v_t − Sᵀk_t)`, `y_t = Sᵀ q_t`.
//!    Prefill runs it chunk-wise (64 positions per chunk, the UT transform of the DeltaNet paper,
//!    as transformers' `torch_chunk_gated_delta_rule`); a single decode token takes the plain
//!    recurrent step. Both continue from the cached state, so prompts may be fed in pieces.
//! 5. Per-head gated RMSNorm `rms(y)·w·silu(z)` (plain `w`, not `1 + w`), then `out_proj`.
//!
//! All of the recurrence (decays, state, norms) is computed in f32 whatever the weight dtype.
use crate::layers::decoder::RecurrentMixer;
use crate::layers::{FusedLinear, Linear};
use crate::weights::{Init, Vb};
use crate::{ModelError, Result};
use mlx_array::{ops, Array, DType};

/// Shapes of one GatedDeltaNet layer.
#[derive(Debug, Clone)]
pub struct GatedDeltaConfig {
    pub hidden: usize,
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub head_k_dim: usize,
    pub head_v_dim: usize,
    pub conv_kernel: usize,
    pub eps: f32,
}

impl GatedDeltaConfig {
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.head_k_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.head_v_dim
    }
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// Positions per chunk of the chunked prefill (as transformers and FLA).
pub(crate) const CHUNK: usize = 64;

/// Cache slots of a GatedDeltaNet layer: conv inputs and recurrent state.
pub(crate) const SLOTS: usize = 2;

#[derive(Clone)]
pub struct GatedDeltaNet {
    cfg: GatedDeltaConfig,
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` as one product.
    in_proj: FusedLinear,
    /// MLX layout `[C, K, 1]`.
    conv_w: Array,
    /// `-exp(A_log)`, f32 `[Hv]`.
    neg_a: Array,
    dt_bias: Array,
    norm_w: Array,
    out: Linear,
}

fn f32(a: &Array) -> Result<Array> {
    Ok(if a.dtype() == DType::F32 { a.clone() } else { a.astype(DType::F32)? })
}

impl GatedDeltaNet {
    /// `vb` points at `…layers.N.linear_attn`.
    pub fn load(vb: &Vb, cfg: GatedDeltaConfig) -> Result<Self> {
        let (h, c, hv) = (cfg.hidden, cfg.conv_dim(), cfg.num_v_heads);
        if cfg.num_k_heads == 0 || hv % cfg.num_k_heads != 0 {
            return Err(ModelError::InvalidInput(format!("linear_num_value_heads {hv} must be a multiple of linear_num_key_heads {}", cfg.num_k_heads)));
        }
        if let Some(g) = crate::layers::parallel::group(vb) {
            return Self::load_sharded(vb, cfg, g.rank(), g.size());
        }
        // transformers stores `[C, 1, K]`, mlx-lm `[C, K, 1]` (the layout the conv runs in)
        let k = cfg.conv_kernel;
        let conv = vb.get_either("conv1d.weight", &[&[c, 1, k], &[c, k, 1]], Init::normal(0.0, 0.2))?;
        let conv_w = if conv.shape() == [c, 1, k] && k > 1 { conv.swap_axes(1, 2)? } else { conv };
        let a_log = f32(&vb.get_init("A_log", &[hv], Init::normal(1.0, 0.5))?)?;
        Ok(GatedDeltaNet {
            in_proj: FusedLinear::load(vb, &["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], h, &[c, cfg.value_dim(), hv, hv], false)?,
            conv_w,
            neg_a: a_log.exp()?.neg()?,
            dt_bias: f32(&vb.get_init("dt_bias", &[hv], Init::normal(1.0, 0.1))?)?,
            norm_w: f32(&vb.pp("norm").get_init("weight", &[cfg.head_v_dim], Init::normal(1.0, 0.1))?)?,
            out: Linear::load(&vb.pp("out_proj"), cfg.value_dim(), h, false)?,
            cfg,
        })
    }

    /// Tensor parallel: this rank's `1/N` of the key and value heads (their q, k and v rows of
    /// `in_proj_qkv` and conv channels, z, b, a, A_log and dt_bias), and the matching inputs of
    /// `out_proj` (summed over the ranks). The recurrence runs on the local heads unchanged.
    fn load_sharded(vb: &Vb, cfg: GatedDeltaConfig, r: usize, n: usize) -> Result<Self> {
        use crate::layers::parallel::{per_rank, Shard};
        let (h, c, hv) = (cfg.hidden, cfg.conv_dim(), cfg.num_v_heads);
        if cfg.num_k_heads == 0 || hv % cfg.num_k_heads != 0 {
            return Err(ModelError::InvalidInput(format!("linear_num_value_heads {hv} must be a multiple of linear_num_key_heads {}", cfg.num_k_heads)));
        }
        if ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"].iter().any(|p| vb.pp(p).is_quantized() || vb.pp(p).is_fp8()) {
            return Err(ModelError::UnsupportedOption(format!("tensor parallelism over quantized or FP8 layers ({}) is not supported", vb.prefix())));
        }
        let local = GatedDeltaConfig { num_k_heads: per_rank(vb, "linear-attention key heads", cfg.num_k_heads)?, num_v_heads: per_rank(vb, "linear-attention value heads", hv)?, ..cfg };
        let (kd, vd, lk, lv) = (cfg.key_dim(), cfg.value_dim(), local.key_dim(), local.value_dim());
        // q, k and v rows of this rank, in that order (the channel order the conv and the split use).
        let ranges = [(r * lk, (r + 1) * lk), (kd + r * lk, kd + (r + 1) * lk), (2 * kd + r * lv, 2 * kd + (r + 1) * lv)];
        let rows = |t: &Vb, name: &str, shape: &[usize]| -> Result<Array> {
            let parts = ranges.iter().map(|&(s, e)| t.get_range(name, shape, 0, s, e)).collect::<Result<Vec<_>>>()?;
            Ok(ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?)
        };
        let k = cfg.conv_kernel;
        let hf_layout = vb.weights().shape_of(&format!("{}.conv1d.weight", vb.prefix())).is_none_or(|s| s == [c, 1, k]);
        let conv_w = if hf_layout {
            let w = rows(vb, "conv1d.weight", &[c, 1, k])?;
            if k > 1 { w.swap_axes(1, 2)? } else { w }
        } else {
            rows(vb, "conv1d.weight", &[c, k, 1])?
        };
        let qkv = Linear::new(rows(&vb.pp("in_proj_qkv"), "weight", &[c, h])?, None)?;
        let part = |name: &str, out: usize| Linear::load_parallel(&vb.pp(name), h, out, false, Shard::Output);
        let a_log = f32(&vb.get_shard("A_log", &[hv], 0, r, n)?)?;
        Ok(GatedDeltaNet {
            in_proj: FusedLinear::Separate(vec![qkv, part("in_proj_z", vd)?, part("in_proj_b", hv)?, part("in_proj_a", hv)?]),
            conv_w,
            neg_a: a_log.exp()?.neg()?,
            dt_bias: f32(&vb.get_shard("dt_bias", &[hv], 0, r, n)?)?,
            norm_w: f32(&vb.pp("norm").get("weight", &[cfg.head_v_dim])?)?,
            out: Linear::load_parallel(&vb.pp("out_proj"), vd, h, false, Shard::Input)?,
            cfg: local,
        })
    }

    /// `x`: `[B, L, hidden]`; `state`: this layer's `SLOTS` cache slots (updated).
    pub fn forward(&self, x: &Array, state: &mut [Option<Array>]) -> Result<Array> {
        self.forward_valid(x, state, None)
    }

    /// [`GatedDeltaNet::forward`] over a batch whose positions `valid` (`[B, L, 1]`) marks
    /// false are padding (before each row's tokens): there the conv input, `β` and `g` are zero
    /// and the conv window skips them (`crate::batch::conv_input`), so the state is left as it
    /// was (no write, no decay).
    pub fn forward_valid(&self, x: &Array, state: &mut [Option<Array>], valid: Option<&Array>) -> Result<Array> {
        self.forward_rows(x, state, valid, None)
    }

    /// [`GatedDeltaNet::forward_valid`]; with `packed`, `x` is a packed step (`[1, T, H]`): the
    /// projections run over its tokens, the convolution and the recurrence over its rows.
    fn forward_rows(&self, x: &Array, state: &mut [Option<Array>], valid: Option<&Array>, packed: Option<&crate::batch::Ragged>) -> Result<Array> {
        let c = &self.cfg;
        if state.len() != SLOTS {
            return Err(ModelError::Cache(format!("GatedDeltaNet needs {SLOTS} recurrent slots, cache has {}", state.len())));
        }
        let (hk, hv, dk, dv) = (c.num_k_heads as i32, c.num_v_heads as i32, c.head_k_dim as i32, c.head_v_dim as i32);
        let mut proj = self.in_proj.forward(x)?.into_iter();
        let mut next = || proj.next().ok_or_else(|| ModelError::Cache("fused projection parts".into()));
        let (qkv, z, b_in, a_in) = (next()?, next()?, next()?, next()?);
        let rows = |a: Array| -> Result<Array> { packed.map_or(Ok(a.clone()), |g| g.to_rows(&a, 1)) };
        let (qkv, b_in, a_in) = (rows(qkv)?, rows(b_in)?, rows(a_in)?);
        let (b, l) = (qkv.dims()[0], qkv.dims()[1]);
        let qkv = crate::batch::zero_padding(&qkv, valid)?;
        let beta = crate::batch::zero_padding(&f32(&b_in)?.sigmoid()?, valid)?; // [B, L, Hv]
        let a = f32(&a_in)?.add(&self.dt_bias)?;
        let g = crate::batch::zero_padding(&softplus(&a)?.mul(&self.neg_a)?, valid)?; // [B, L, Hv], ≤ 0

        // Causal depthwise conv over [conv state | new inputs].
        let k1 = c.conv_kernel - 1;
        let prev = match state[0].take() {
            Some(s) => s,
            None => Array::zeros(&[b as usize, k1, c.conv_dim()], qkv.dtype())?,
        };
        let xin = crate::batch::conv_input(&prev, &qkv, valid)?;
        let t = xin.dim(1)?;
        state[0] = Some(xin.slice_axis(1, t - k1, t)?);
        let mixed = xin.conv1d(&self.conv_w, 1, 0, 1, c.conv_dim())?.silu()?; // [B, L, C]

        let parts = mixed.split_at(&[c.key_dim(), 2 * c.key_dim()], -1)?;
        let q = f32(&parts[0].reshape(&[b, l, hk, dk])?)?;
        let k = f32(&parts[1].reshape(&[b, l, hk, dk])?)?;
        let v = f32(&parts[2].reshape(&[b, l, hv, dv])?)?;
        let (q, k) = (l2norm(&q)?.mul_scalar((dk as f32).powf(-0.5))?, l2norm(&k)?);
        let rep = (hv / hk) as usize;
        let (q, k) = if rep > 1 { (repeat_heads(&q, rep)?, repeat_heads(&k, rep)?) } else { (q, k) };

        let s0 = match state[1].take() {
            Some(s) => s,
            None => Array::zeros(&[b as usize, hv as usize, dv as usize, dk as usize], DType::F32)?,
        };
        let (y, s) = if l == 1 { recurrent(&q, &k, &v, &g, &beta, s0)? } else { chunked(&q, &k, &v, &g, &beta, s0)? };
        state[1] = Some(s);

        // Gated norm per head, in f32, then back to the compute dtype.
        let y = match packed {
            Some(g) => g.to_packed(&y)?,
            None => y,
        };
        let (b, l) = (x.dims()[0], x.dims()[1]);
        let z = f32(&z.reshape(&[b, l, hv, dv])?)?;
        let y = y.rms_norm(Some(&self.norm_w), c.eps)?.mul(&z.silu()?)?;
        let y = y.reshape(&[b, l, -1])?.astype(x.dtype())?;
        self.out.forward(&y)
    }
}

/// `log(1 + exp(x))`, stable.
fn softplus(x: &Array) -> Result<Array> {
    Ok(x.logaddexp(&Array::scalar(0f32))?)
}

/// `x / sqrt(sum(x²) + 1e-6)` over the last axis (FLA's l2norm).
fn l2norm(x: &Array) -> Result<Array> {
    Ok(x.mul(&x.square()?.sum(&[-1], true)?.add_scalar(1e-6)?.rsqrt()?)?)
}

/// `[B, L, H, D]` → `[B, L, H·rep, D]`, each head repeated `rep` times in place (repeat_interleave).
fn repeat_heads(x: &Array, rep: usize) -> Result<Array> {
    let s = x.shape();
    let e = x.expand_dims(3)?.broadcast_to(&[s[0], s[1], s[2], rep, s[3]])?;
    Ok(e.reshape(&[s[0] as i32, s[1] as i32, (s[2] * rep) as i32, s[3] as i32])?)
}

/// One token at a time. Inputs `[B, L, H, D]` (f32), `g`/`beta` `[B, L, H]`, state
/// `Sᵀ: [B, H, Dv, Dk]`. Returns `y: [B, L, H, Dv]` and the final state (same layout).
pub fn recurrent(q: &Array, k: &Array, v: &Array, g: &Array, beta: &Array, mut s: Array) -> Result<(Array, Array)> {
    let l = q.dim(1)?;
    let mut ys = Vec::with_capacity(l);
    for t in 0..l {
        let at = |a: &Array| a.slice_axis(1, t, t + 1).and_then(|x| x.squeeze(&[1]));
        let (qt, kt, vt) = (at(q)?, at(k)?, at(v)?); // [B, H, D]
        let (gt, bt) = (at(g)?, at(beta)?); // [B, H]
        // One fused kernel per step where MLX can compile (mlx-lm compiles this step too).
        let mut out = ops::fused(delta_step, false, &[&qt, &kt, &vt, &gt, &bt, &s])?;
        s = out.pop().expect("two outputs");
        ys.push(out.pop().expect("two outputs").expand_dims(1)?);
    }
    let refs: Vec<&Array> = ys.iter().collect();
    Ok((ops::concatenate(&refs, 1)?, s))
}

/// One delta-rule step: `[q, k, v, g, beta, Sᵀ]` (`[B, H, D]`, `[B, H]`, `[B, H, Dv, Dk]`) to
/// `[y, Sᵀ']`.
fn delta_step(x: &[Array]) -> mlx_array::Result<Vec<Array>> {
    let (qt, kt, vt, gt, bt, s) = (&x[0], &x[1], &x[2], &x[3], &x[4], &x[5]);
    let kt = kt.expand_dims(-2)?; // [B, H, 1, Dk]
    let s = s.mul(&gt.exp()?.expand_dims(-1)?.expand_dims(-1)?)?;
    let kv_mem = s.mul(&kt)?.sum(&[-1], false)?; // [B, H, Dv]
    let delta = vt.sub(&kv_mem)?.mul(&bt.expand_dims(-1)?)?;
    let s = s.add(&delta.expand_dims(-1)?.mul(&kt)?)?;
    let y = s.mul(&qt.expand_dims(-2)?)?.sum(&[-1], false)?;
    Ok(vec![y, s])
}

/// Chunked form (transformers' `torch_chunk_gated_delta_rule`): within a chunk of `CHUNK`
/// positions the delta-rule updates are folded into matmuls through the UT transform
/// `(I + tril(β K Kᵀ ⊙ Γ, -1))⁻¹`; the state is carried across chunks. The unit lower-triangular
/// inverse is built by forward substitution over the rows of the chunk (as transformers does
/// without a triangular solver). Same inputs and outputs as [`recurrent`].
pub fn chunked(q: &Array, k: &Array, v: &Array, g: &Array, beta: &Array, mut s: Array) -> Result<(Array, Array)> {
    let (b, l, h, dk) = (q.dim(0)?, q.dim(1)?, q.dim(2)?, q.dim(3)?);
    let dv = v.dim(3)?;
    let c = CHUNK.min(l);
    let pad = (c - l % c) % c;
    let n = (l + pad) / c;
    // [B, H, N, C, D] and [B, H, N, C].
    let prep = |x: &Array, d: usize| -> Result<Array> {
        let x = x.transpose(&[0, 2, 1, 3])?;
        let x = if pad > 0 { x.pad(&[(0, 0), (0, 0), (0, pad), (0, 0)], 0.0)? } else { x };
        Ok(x.reshape(&[b as i32, h as i32, n as i32, c as i32, d as i32])?)
    };
    let prep2 = |x: &Array| -> Result<Array> {
        let x = x.transpose(&[0, 2, 1])?;
        let x = if pad > 0 { x.pad(&[(0, 0), (0, 0), (0, pad)], 0.0)? } else { x };
        Ok(x.reshape(&[b as i32, h as i32, n as i32, c as i32])?)
    };
    let (q, k, v) = (prep(q, dk)?, prep(k, dk)?, prep(v, dv)?);
    let (g, beta) = (prep2(g)?, prep2(beta)?);
    let bexp = beta.expand_dims(-1)?;
    let (k_beta, v_beta) = (k.mul(&bexp)?, v.mul(&bexp)?);
    let cum = g.cumsum(-1, false, true)?; // [B, H, N, C]
    // decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0.
    let diff = cum.expand_dims(-1)?.sub(&cum.expand_dims(-2)?)?;
    let lower = Array::ones(&[c, c], DType::F32)?.tril(0)?;
    let decay = ops::where_(&lower.gt(&Array::scalar(0f32))?, &diff, &Array::scalar(f32::NEG_INFINITY))?.exp()?;
    let kt = k.swap_axes(-1, -2)?;
    // Strictly lower part of the UT system; A = -tril(βK Kᵀ ⊙ decay, -1).
    let strict = Array::ones(&[c, c], DType::F32)?.tril(-1)?;
    let a = k_beta.matmul(&kt)?.mul(&decay)?.mul(&strict)?.neg()?;
    let t_inv = unit_lower_inverse(&a, c)?; // (I - A)^-1 with A strictly lower
    let new_v = t_inv.matmul(&v_beta)?; // [B, H, N, C, Dv]
    let k_cumdecay = t_inv.matmul(&k_beta.mul(&cum.exp()?.expand_dims(-1)?)?)?; // [B, H, N, C, Dk]
    let intra = q.matmul(&kt)?.mul(&decay)?; // [B, H, N, C, C], causal incl. diagonal
    let q_dec = q.mul(&cum.exp()?.expand_dims(-1)?)?;
    let last = cum.slice_axis(3, c - 1, c)?; // [B, H, N, 1]
    let k_dec = k.mul(&last.sub(&cum)?.exp()?.expand_dims(-1)?)?;
    let chunk_decay = last.exp()?.expand_dims(-1)?; // [B, H, N, 1, 1]
    let mut outs = Vec::with_capacity(n);
    let at = |x: &Array, i: usize| x.slice_axis(2, i, i + 1).and_then(|y| y.squeeze(&[2]));
    for i in 0..n {
        let st = s.swap_axes(-1, -2)?; // S: [B, H, Dk, Dv] (a view of the stored Sᵀ)
        let v_new = at(&new_v, i)?.sub(&at(&k_cumdecay, i)?.matmul(&st)?)?; // [B, H, C, Dv]
        let o = at(&q_dec, i)?.matmul(&st)?.add(&at(&intra, i)?.matmul(&v_new)?)?;
        outs.push(o);
        // Sᵀ ← Sᵀ·decay + v_newᵀ k_dec
        s = s.mul(&at(&chunk_decay, i)?)?.add(&v_new.swap_axes(-1, -2)?.matmul(&at(&k_dec, i)?)?)?;
    }
    let refs: Vec<&Array> = outs.iter().collect();
    let y = ops::concatenate(&refs, 2)?; // [B, H, N·C, Dv]
    let y = y.slice_axis(2, 0, l)?.transpose(&[0, 2, 1, 3])?;
    Ok((y, s))
}

/// `(I - A)⁻¹` for strictly lower-triangular `A: [..., C, C]`, by forward substitution on rows:
/// row `i` of the inverse is `e_i + Σ_{j<i} A[i, j] · row_j`.
fn unit_lower_inverse(a: &Array, c: usize) -> Result<Array> {
    let shape = a.shape();
    let batch: Vec<usize> = shape[..shape.len() - 2].to_vec();
    let eye_row = |i: usize| -> Result<Array> {
        let mut e = vec![0f32; c];
        e[i] = 1.0;
        let mut s = batch.clone();
        s.push(1);
        s.push(c);
        Ok(Array::from_slice(&e, &[1, c])?.broadcast_to(&s)?)
    };
    let nd = shape.len() as i32;
    let mut rows: Vec<Array> = Vec::with_capacity(c);
    rows.push(eye_row(0)?);
    for i in 1..c {
        // a[..., i, :i] @ stacked rows[:i]  → [..., 1, C]
        let coeff = a.slice_axis(nd - 2, i, i + 1)?.slice_axis(nd - 1, 0, i)?; // [..., 1, i]
        let prev_refs: Vec<&Array> = rows.iter().collect();
        let prev = ops::concatenate(&prev_refs, nd - 2)?; // [..., i, C]
        rows.push(eye_row(i)?.add(&coeff.matmul(&prev)?)?);
    }
    let refs: Vec<&Array> = rows.iter().collect();
    Ok(ops::concatenate(&refs, nd - 2)?)
}

crate::layers::layer_arrays!(GatedDeltaNet { in_proj, conv_w, neg_a, dt_bias, norm_w, out });

impl RecurrentMixer for GatedDeltaNet {
    const SLOTS: usize = SLOTS;
    fn forward_slots(&self, x: &Array, slots: &mut [Option<Array>], _i: usize, valid: Option<&Array>) -> Result<Array> {
        self.forward_valid(x, slots, valid)
    }
    fn forward_packed(&self, x: &Array, slots: &mut [Option<Array>], _i: usize, valid: Option<&Array>, g: &crate::batch::Ragged) -> Result<Array> {
        self.forward_rows(x, slots, valid, Some(g))
    }
}
