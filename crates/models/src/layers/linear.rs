use crate::calibrate::ActSite;
use super::parallel::Shard;
use crate::weights::Vb;
use crate::{ModelError, Result};
use mlx_array::{Array, DType, Quantized};

/// The weight of a [`Linear`]: float `W^T` (`[in, out]`, a view of the stored `[out, in]`), or
/// MLX-quantized `[out, in]` rows run with `quantized_matmul`.
#[derive(Clone)]
enum LinearWeight {
    Dense(Array),
    Quantized(Quantized),
}

/// `y = x W^T (+ b)` with `W` stored `[out, in]` as in the checkpoint (float, or quantized in
/// mlx-lm's layout: `weight` packed u32, `scales`, `biases`).
#[derive(Clone)]
pub struct Linear {
    w: LinearWeight,
    /// A dense weight's `W^T` viewed as `[1, in, out]`, made with it (lazy like it, and evaluated
    /// by the first forward that reads it: [`crate::Model::materialize`]'s on a GPU): a
    /// `[1, L, in]` input's product on a GPU reads it instead of making the view each time
    /// ([`Array::matmul_weight_t_held`]; each graph node of a decode step is host work). The CPU
    /// paths never read it. Remade whenever the weight may be replaced.
    batched: Option<Array>,
    /// A dense weight as stored, `[out, in]` (a view of `W^T`, made with it): the CPU kernels'
    /// operand, evaluated by the first forward that reads it ([`crate::Model::materialize`]'s on
    /// the CPU), after which their products take it without a transpose and a contiguous node
    /// each. Remade whenever the weight may be replaced.
    stored: Option<Array>,
    bias: Option<Array>,
    /// An activation-quantised projection ([`crate::calibrate`]).
    act: Option<ActSite>,
    /// A low-rank adapter added to the output ([`LoraSettings`]).
    lora: Option<LoraAdapter>,
    /// An input-sharded tensor-parallel projection: the partial products are summed over this
    /// group before the bias is added ([`super::parallel`]).
    reduce: Option<mlx_array::distributed::Group>,
}

/// How a model built over tensors that include LoRA adapters runs them: a projection
/// `prefix` with `prefix.lora_a` (`[in, r]`) and `prefix.lora_b` (`[r, out]`) computes
/// `y = base(x) + scale * ((dropout(x) A) B)` (mlx-lm's `LoRALinear`; the adapter's product is
/// cast to the input's dtype before the sum).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSettings {
    pub scale: f32,
    /// Probability of zeroing an input element before `A` (inverted dropout), in `[0, 1)`.
    pub dropout: f32,
    /// Dropout is applied only when this is set: each projection draws its mask from a key made
    /// of this seed and its name, so two models built with the same seed draw the same masks.
    pub dropout_seed: Option<u64>,
}

#[derive(Clone)]
struct LoraAdapter {
    a: Array,
    b: Array,
    scale: f32,
    dropout: Option<(f32, mlx_array::random::Key)>,
}

impl LoraAdapter {
    /// The adapter under `vb` (`lora_a`, `lora_b`), if the tensors are there.
    fn load(vb: &Vb, in_dim: usize, out_dim: usize) -> Result<Option<Self>> {
        if !vb.contains("lora_a") && !vb.contains("lora_b") {
            return Ok(None);
        }
        let name = vb.prefix().to_string();
        let s = vb.weights().lora.clone().ok_or_else(|| ModelError::InvalidInput(format!("{name} has LoRA tensors but the model is built without LoRA settings")))?;
        let a = vb.get_any("lora_a")?;
        let r = match a.shape().as_slice() {
            [i, r] if *i == in_dim && *r > 0 => *r,
            sh => return Err(ModelError::InvalidInput(format!("{name}.lora_a has shape {sh:?}, expected [{in_dim}, rank]"))),
        };
        let b = vb.get("lora_b", &[r, out_dim])?;
        if !(0.0..1.0).contains(&s.dropout) {
            return Err(ModelError::InvalidInput(format!("LoRA dropout {} is not in [0, 1)", s.dropout)));
        }
        let dropout = match s.dropout_seed {
            Some(seed) if s.dropout > 0.0 => {
                // FNV-1a of the projection's name, mixed with the seed
                let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
                Some((s.dropout, mlx_array::random::Key::new(seed ^ h)?))
            }
            _ => None,
        };
        Ok(Some(LoraAdapter { a, b, scale: s.scale, dropout }))
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let xd = match &self.dropout {
            Some((p, key)) => {
                let keep = Array::from_slice(&[1.0 - *p], &[])?;
                let mask = mlx_array::random::bernoulli(&keep, &x.shape(), key)?.astype(x.dtype())?;
                x.mul(&mask)?.mul_scalar(1.0 / (1.0 - *p))?
            }
            None => x.clone(),
        };
        Ok(xd.matmul(&self.a)?.matmul(&self.b)?.mul_scalar(self.scale)?.astype(x.dtype())?)
    }
}

impl Linear {
    pub fn new(weight: Array, bias: Option<Array>) -> Result<Self> {
        Self::new_transposed(weight.swap_axes(0, 1)?, bias)
    }
    /// A dense weight given as `W^T` (`[in, out]`).
    fn new_transposed(wt: Array, bias: Option<Array>) -> Result<Self> {
        Ok(Linear { batched: Some(wt.expand_dims(0)?), stored: Some(wt.swap_axes(0, 1)?), w: LinearWeight::Dense(wt), bias, act: None, lora: None, reduce: None })
    }
    /// A quantized `[out, in]` weight.
    pub fn quantized(q: Quantized, bias: Option<Array>) -> Self {
        Linear { w: LinearWeight::Quantized(q), batched: None, stored: None, bias, act: None, lora: None, reduce: None }
    }
    /// `prefix.weight` of shape `[out, in]` (or its quantized form, dequantized at load when the
    /// load options ask) and, if `bias`, `prefix.bias`; with `prefix.lora_a`/`prefix.lora_b`
    /// when present (see [`LoraSettings`]).
    pub fn load(vb: &Vb, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        let lora = LoraAdapter::load(vb, in_dim, out_dim)?;
        let mut l = Self::load_base(vb, in_dim, out_dim, bias)?;
        l.lora = lora;
        Ok(l)
    }
    fn load_base(vb: &Vb, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        let b = if bias { Some(vb.get("bias", &[out_dim])?) } else { None };
        if vb.is_fp8() {
            let w = vb.fp8_dequantized(out_dim, in_dim)?;
            let w = match vb.weights().float_dtype() {
                Some(dt) if dt != mlx_array::DType::F32 => w.astype(dt)?,
                _ => w,
            };
            return Self::new(w, b);
        }
        let act = ActSite::for_layer(vb)?;
        if vb.is_quantized() {
            let q = vb.quantized(&[out_dim, in_dim])?;
            let mut l = match vb.weights().dequantize_to {
                Some(dt) => Self::new(q.dequantize(Some(dt))?, b)?,
                None => Self::quantized(q, b),
            };
            l.act = act;
            return Ok(l);
        }
        Self::new(vb.get("weight", &[out_dim, in_dim])?, b)
    }
    /// [`Linear::load`], holding only this rank's `shard` of the weight when the load is tensor
    /// parallel ([`super::parallel`]): output-sharded, it computes `out_dim / N` outputs;
    /// input-sharded, it takes `in_dim / N` inputs and sums its product over the ranks. The
    /// whole layer without a tensor-parallel group.
    pub fn load_parallel(vb: &Vb, in_dim: usize, out_dim: usize, bias: bool, shard: Shard) -> Result<Self> {
        let Some(g) = super::parallel::group(vb) else { return Self::load(vb, in_dim, out_dim, bias) };
        if vb.is_fp8() {
            return Err(ModelError::UnsupportedOption(format!("tensor parallelism over FP8 layers ({}) is not supported", vb.prefix())));
        }
        if ActSite::for_layer(vb)?.is_some() {
            return Err(ModelError::UnsupportedOption(format!("tensor parallelism over an activation-quantised projection ({}) is not supported", vb.prefix())));
        }
        let (r, n) = (g.rank(), g.size());
        if vb.is_quantized() {
            // the packed rows (output-sharded) or whole groups of the packed columns
            // (input-sharded): Vb::quantized_shard cuts weight, scales and biases alike
            let (axis, b) = match shard {
                Shard::Output => (0, if bias { Some(vb.get_shard("bias", &[out_dim], 0, r, n)?) } else { None }),
                Shard::Input => (1, if bias { Some(vb.get("bias", &[out_dim])?) } else { None }),
            };
            let q = vb.quantized_shard(&[out_dim, in_dim], axis, r, n)?;
            let mut l = match vb.weights().dequantize_to {
                Some(dt) => Self::new(q.dequantize(Some(dt))?, b)?,
                None => Self::quantized(q, b),
            };
            l.reduce = (shard == Shard::Input).then_some(g);
            return Ok(l);
        }
        match shard {
            Shard::Output => {
                let b = if bias { Some(vb.get_shard("bias", &[out_dim], 0, r, n)?) } else { None };
                Self::new(vb.get_shard("weight", &[out_dim, in_dim], 0, r, n)?, b)
            }
            Shard::Input => {
                let b = if bias { Some(vb.get("bias", &[out_dim])?) } else { None };
                let mut l = Self::new(vb.get_shard("weight", &[out_dim, in_dim], 1, r, n)?, b)?;
                l.reduce = Some(g);
                Ok(l)
            }
        }
    }
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let xq = match &self.act {
            Some(site) => site.input(x)?,
            None => None,
        };
        let x = xq.as_ref().unwrap_or(x);
        let stored = |wt: &Array| -> Result<Array> {
            match &self.stored {
                Some(r) => Ok(r.clone()),
                None => Ok(wt.swap_axes(0, 1)?),
            }
        };
        let limit = match &self.w {
            LinearWeight::Dense(wt) if wt.dtype() != DType::BF16 => mlx_array::ops::CPU_PACKED_MAX_ROWS,
            _ => mlx_array::ops::CPU_PACKED_NARROW_MAX_ROWS,
        };
        let y = match (&self.w, cpu_rows(x, limit)) {
            // bf16 weights on the CPU: our kernel for up to CPU_PACKED_NARROW_MAX_ROWS rows; more
            // rows run the f32 BLAS product of the upcast operands (MLX's CPU bf16 matmul is
            // 10-20x slower than f32)
            (LinearWeight::Dense(wt), Some(few)) if wt.dtype() == DType::BF16 => match few {
                true => x.cpu_matmul_bf16(&stored(wt)?)?,
                false => x.astype(DType::F32)?.matmul(&wt.astype(DType::F32)?)?.astype(x.dtype())?,
            },
            // f32 weights on the CPU, few rows: our kernel reads each weight row once for all of
            // them (the BLAS product of a few rows repacks the whole weight: 2 rows cost 1.7x
            // one, a speculative verify step more than a plain step)
            (LinearWeight::Dense(wt), Some(true)) if wt.dtype() == DType::F32 => x.cpu_matmul_f32(&stored(wt)?)?,
            // on a GPU: few rows by our kernel when it is on, MLX's matmul otherwise, a
            // `[1, L, in]` input against the held `[1, in, out]` view (Array::matmul_weight_t_held)
            (LinearWeight::Dense(wt), None) => x.matmul_weight_t_held(wt, self.batched.as_ref())?,
            // the CPU's other float products (many rows, or dtypes its kernels lack)
            (LinearWeight::Dense(wt), _) => x.matmul_weight_t(wt)?,
            // packed weights on the CPU: our kernel for few rows; more rows run the f32 BLAS
            // product of the weight dequantized on the fly ([`dequantize_f32`]; MLX's CPU
            // quantized_matmul is ~10x slower at prefill sizes, BENCHMARKS.md)
            (LinearWeight::Quantized(q), Some(few)) if mlx_array::ops::cpu_packed_supports(q.mode) => match few {
                true => q.cpu_matmul(x)?,
                false => {
                    // quantized_matmul's output dtype
                    x.astype(DType::F32)?.matmul(&dequantize_f32(q)?.swap_axes(0, 1)?)?.astype(q.matmul_dtype(x.dtype()))?
                }
            },
            (LinearWeight::Quantized(q), _) => q.matmul(x, true)?,
        };
        let y = match &self.reduce {
            Some(g) => g.all_sum(&y)?,
            None => y,
        };
        let y = match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        };
        Ok(match &self.lora {
            Some(l) => y.add(&l.forward(x)?)?,
            None => y,
        })
    }
    pub fn out_dim(&self) -> usize {
        match &self.w {
            LinearWeight::Dense(wt) => wt.shape()[1],
            LinearWeight::Quantized(q) => q.out_features(),
        }
    }
    /// Whether the weight stays quantized (products run `quantized_matmul`).
    pub fn is_quantized(&self) -> bool {
        matches!(self.w, LinearWeight::Quantized(_))
    }
    /// Bytes of the resident weight (packed weight, scales and biases when quantized).
    pub fn weight_bytes(&self) -> usize {
        match &self.w {
            LinearWeight::Dense(wt) => wt.nbytes(),
            LinearWeight::Quantized(q) => q.weight.nbytes() + q.scales.nbytes() + q.biases.as_ref().map_or(0, |b| b.nbytes()),
        }
    }
    /// Output columns `start..end` only: `x W[start..end]^T (+ b[start..end])`. The rows of the
    /// stored `[out, in]` weight are contiguous, so the slice is a view the matmul reads as a
    /// transposed operand (no copy). Fused projections are never quantized.
    fn forward_cols(&self, x: &Array, start: usize, end: usize) -> Result<Array> {
        let LinearWeight::Dense(wt) = &self.w else {
            return Err(ModelError::InvalidInput("column slices of a quantized projection".into()));
        };
        let y = x.matmul(&wt.slice_axis(1, start, end)?)?;
        Ok(match &self.bias {
            Some(b) => y.add(&b.slice_axis(0, start, end)?)?,
            None => y,
        })
    }
}

/// A packed weight as f32 (`[.., N, K]`) for a product of many rows: on the CPU, in modes its
/// kernels take, by [`mlx_array::Quantized::cpu_dequantize`] (one pass; MLX's CPU dequantize is
/// a graph of shifts and broadcasts: a forward of 9 / 129 tokens through a 4-bit g64
/// SmolLM2-135M in f32 took 422 / 778 ms with it, 153 / 490 ms with ours, where the f32 model
/// takes 70 / 414), else MLX's `dequantize`, which gives the same values.
pub(crate) fn dequantize_f32(q: &mlx_array::Quantized) -> Result<Array> {
    if super::runs_on_cpu() && mlx_array::ops::cpu_packed_supports(q.mode) {
        return Ok(q.cpu_dequantize()?);
    }
    Ok(q.dequantize(Some(DType::F32))?)
}

/// On the CPU: whether the input `x` has at most `limit` rows (tokens), the most the CPU kernels
/// take for the weight's kind ([`mlx_array::ops::CPU_PACKED_MAX_ROWS`] for f32 weights,
/// [`mlx_array::ops::CPU_PACKED_NARROW_MAX_ROWS`] for bf16 and packed ones: decode and short
/// prefills). `None` off the CPU.
fn cpu_rows(x: &Array, limit: usize) -> Option<bool> {
    super::runs_on_cpu().then_some(rows_of(x) <= limit)
}

/// Rows of `x` `[..., in]`: the product of its leading dimensions.
fn rows_of(x: &Array) -> usize {
    x.size() / x.dims().last().map_or(1, |&d| d.max(1) as usize)
}

/// Inputs of at most this many rows (tokens) run a fused projection as one product; larger ones
/// (prefill) run one product per part over views of the fused weight. At a few rows the product
/// is bound by reading the weight and one launch wins; at prefill sizes it is compute-bound
/// either way, and parts that are views of one fused output keep the whole output alive as
/// long as any part is (the K/V parts reach the cache): measured on the H200, Qwen3-0.6B's peak
/// at a 2048-token prefill was 3.20 GB fused against 2.39 GB separate (mlx-lm 2.14-2.43).
const FUSED_MAX_ROWS: usize = 16;

/// Several projections of the same input. On the GPU they run as one matmul: the
/// checkpoint's weights (`prefix.<name>.weight`, each `[out_i, in]`) are concatenated along the
/// output axis at load, and the parts come back as views of the product (no copy).
///
/// At decode time a matmul is a matrix-vector product bound by reading the weight, and on the
/// GPU each one is a kernel launch: one `[in, sum out_i]` product reads the same bytes with
/// fewer launches and better occupancy for small outputs (Qwen3-8B's k/v are 1024 wide; H200
/// kernel time per decode step 6.20 -> 5.62 ms, see BENCHMARKS.md). On the CPU (OpenBLAS) the
/// separate float products measured as fast or faster, and their outputs are contiguous, so
/// float projections stay separate there; packed ones are joined on the CPU
/// (`FusedLinear::load_packed`: one graph node and one pass over the threads per step). The device is the default device at load, where the
/// weights live; [`crate::LoadOptions::fuse_projections`] overrides it.
#[derive(Clone)]
pub enum FusedLinear {
    Fused {
        lin: Linear,
        /// Cumulative split points (one fewer than parts).
        splits: Vec<usize>,
    },
    Separate(Vec<Linear>),
}

impl FusedLinear {
    /// Loads `names` under `vb`, each `[outs[i], in_dim]` (and `[outs[i]]` biases if `bias`).
    /// Fusing takes them out of the checkpoint map, so the unfused copies are freed.
    pub fn load(vb: &Vb, names: &[&str], in_dim: usize, outs: &[usize], bias: bool) -> Result<Self> {
        assert_eq!(names.len(), outs.len(), "one output size per projection");
        // Quantized projections stay separate (each is its own quantized product).
        // So do projections with LoRA adapters (each adds its own low-rank product).
        let quantized = names.iter().any(|n| vb.pp(n).is_quantized() || vb.pp(n).is_fp8() || vb.pp(n).contains("lora_a"));
        if names.len() > 1 && super::runs_on_cpu() && vb.weights().fuse_projections != Some(false) {
            if let Some(f) = Self::load_packed(vb, names, in_dim, outs, bias)? {
                return Ok(f);
            }
        }
        let fuse = names.len() > 1 && !quantized && vb.weights().fuse_projections()?;
        if fuse {
            // float projections: an input_amax on one of them is an error, as in Linear::load
            for n in names {
                ActSite::for_layer(&vb.pp(n))?;
            }
        }
        if !fuse {
            let parts = names.iter().zip(outs).map(|(n, &o)| Linear::load(&vb.pp(n), in_dim, o, bias)).collect::<Result<Vec<_>>>()?;
            return Ok(FusedLinear::Separate(parts));
        }
        let mut ws = Vec::with_capacity(names.len());
        let mut bs = Vec::with_capacity(names.len());
        for (n, &o) in names.iter().zip(outs) {
            let v = vb.pp(n);
            ws.push(v.take("weight", &[o, in_dim])?);
            if bias {
                bs.push(v.take("bias", &[o])?);
            }
        }
        let held = vb.weights().sources_held;
        let cat = |parts: &[Array]| -> Result<Array> {
            let refs: Vec<&Array> = parts.iter().collect();
            let a = mlx_array::ops::concatenate(&refs, 0)?;
            if !held {
                a.eval()?; // materialise now: the parts are freed when this returns
            }
            Ok(a)
        };
        let w = cat(&ws)?;
        let b = if bias { Some(cat(&bs)?) } else { None };
        let mut splits = Vec::with_capacity(outs.len() - 1);
        let mut acc = 0;
        for &o in &outs[..outs.len() - 1] {
            acc += o;
            splits.push(acc);
        }
        Ok(FusedLinear::Fused { lin: Linear::new(w, b)?, splits })
    }

    /// On the CPU, packed projections of one input kept packed and all in the same mode the CPU
    /// kernels run (`q/k/v`, `gate/up`): their rows joined into one packed weight, so a decode
    /// step runs one product (one graph node, one pass over the threads) instead of one per
    /// projection. `None` when they do not qualify (then they load as before).
    fn load_packed(vb: &Vb, names: &[&str], in_dim: usize, outs: &[usize], bias: bool) -> Result<Option<Self>> {
        let plain = |n: &&str| {
            let v = vb.pp(n);
            v.is_quantized() && !v.contains("lora_a")
        };
        if vb.weights().dequantize_to.is_some() || !names.iter().all(plain) {
            return Ok(None);
        }
        for n in names {
            if ActSite::for_layer(&vb.pp(n))?.is_some() {
                return Ok(None);
            }
        }
        let qs = names.iter().zip(outs).map(|(n, &o)| vb.pp(n).quantized(&[o, in_dim])).collect::<Result<Vec<_>>>()?;
        let (mode, sdt) = (qs[0].mode, qs[0].scales.dtype());
        if !mlx_array::ops::cpu_packed_supports(mode) || qs.iter().any(|q| q.mode != mode || q.scales.dtype() != sdt) {
            return Ok(None);
        }
        let held = vb.weights().sources_held;
        let cat = |parts: Vec<&Array>| -> Result<Array> {
            let a = mlx_array::ops::concatenate(&parts, 0)?;
            if !held {
                a.eval()?; // materialise now: the parts are freed below
            }
            Ok(a)
        };
        let weight = cat(qs.iter().map(|q| &q.weight).collect())?;
        let scales = cat(qs.iter().map(|q| &q.scales).collect())?;
        let biases = match qs.iter().map(|q| q.biases.as_ref()).collect::<Option<Vec<_>>>() {
            Some(b) => Some(cat(b)?),
            None => None,
        };
        let b = if bias { Some(cat(names.iter().zip(outs).map(|(n, &o)| vb.pp(n).get("bias", &[o])).collect::<Result<Vec<_>>>()?.iter().collect())?) } else { None };
        if !held {
            // the joined copies replace the parts (as `take` does for float projections)
            for ((n, q), &o) in names.iter().zip(&qs).zip(outs) {
                let v = vb.pp(n);
                v.take("weight", &q.weight.shape())?;
                v.take("scales", &q.scales.shape())?;
                if let Some(b) = &q.biases {
                    v.take("biases", &b.shape())?;
                }
                if bias {
                    v.take("bias", &[o])?;
                }
            }
        }
        let mut splits = Vec::with_capacity(outs.len() - 1);
        let mut acc = 0;
        for &o in &outs[..outs.len() - 1] {
            acc += o;
            splits.push(acc);
        }
        Ok(Some(FusedLinear::Fused { lin: Linear::quantized(mlx_array::Quantized { weight, scales, biases, mode }, b), splits }))
    }

    /// [`FusedLinear::load`] with every part output-sharded over a tensor-parallel load's ranks
    /// (`outs` are the whole layer's sizes; this rank computes `outs[i] / N` of each). The same
    /// as [`FusedLinear::load`] without a tensor-parallel group.
    pub fn load_sharded(vb: &Vb, names: &[&str], in_dim: usize, outs: &[usize], bias: bool) -> Result<Self> {
        if super::parallel::group(vb).is_none() {
            return Self::load(vb, names, in_dim, outs, bias);
        }
        let parts = names.iter().zip(outs).map(|(n, &o)| Linear::load_parallel(&vb.pp(n), in_dim, o, bias, Shard::Output)).collect::<Result<Vec<_>>>()?;
        if parts.len() < 2 || parts.iter().any(Linear::is_quantized) || !vb.weights().fuse_projections()? {
            return Ok(FusedLinear::Separate(parts));
        }
        // W^T parts are [in, out_i / N]: join them along the output axis.
        let wts: Vec<&Array> = parts.iter().filter_map(|p| match &p.w {
            LinearWeight::Dense(wt) => Some(wt),
            LinearWeight::Quantized(_) => None,
        }).collect();
        let wt = mlx_array::ops::concatenate(&wts, 1)?;
        let bias = if bias {
            let bs: Vec<&Array> = parts.iter().filter_map(|p| p.bias.as_ref()).collect();
            Some(mlx_array::ops::concatenate(&bs, 0)?)
        } else {
            None
        };
        if !vb.weights().sources_held {
            mlx_array::eval(&[&wt])?;
        }
        let mut splits = Vec::with_capacity(parts.len() - 1);
        let mut acc = 0;
        for p in &parts[..parts.len() - 1] {
            acc += p.out_dim();
            splits.push(acc);
        }
        Ok(FusedLinear::Fused { lin: Linear::new_transposed(wt, bias)?, splits })
    }

    /// Part `i` of the output only (`x W_i^T`): the other parts' columns are not computed.
    pub fn part(&self, i: usize, x: &Array) -> Result<Array> {
        match self {
            FusedLinear::Separate(parts) => parts[i].forward(x),
            FusedLinear::Fused { lin, splits } if lin.is_quantized() => {
                // packed rows: the whole product, then the part's columns
                let start = if i == 0 { 0 } else { splits[i - 1] };
                let end = splits.get(i).copied().unwrap_or(lin.out_dim());
                Ok(lin.forward(x)?.slice_axis(-1, start, end)?)
            }
            FusedLinear::Fused { lin, splits } => {
                let start = if i == 0 { 0 } else { splits[i - 1] };
                let end = splits.get(i).copied().unwrap_or(lin.out_dim());
                lin.forward_cols(x, start, end)
            }
        }
    }

    /// `silu(gate(x)) * up(x)` in one CPU primitive, for a packed `[gate; up]` pair
    /// ([`FusedLinear::load_packed`]) and inputs of at most
    /// [`mlx_array::ops::CPU_PACKED_NARROW_MAX_ROWS`] rows on the CPU; `None` otherwise.
    pub(crate) fn swiglu_packed(&self, x: &Array) -> Result<Option<Array>> {
        let FusedLinear::Fused { lin, splits } = self else { return Ok(None) };
        let LinearWeight::Quantized(q) = &lin.w else { return Ok(None) };
        let halves = splits.len() == 1 && 2 * splits[0] == lin.out_dim();
        if !halves || lin.bias.is_some() || lin.act.is_some() || lin.lora.is_some() || lin.reduce.is_some() || cpu_rows(x, mlx_array::ops::CPU_PACKED_NARROW_MAX_ROWS) != Some(true) {
            return Ok(None);
        }
        Ok(Some(q.cpu_swiglu(x)?))
    }

    /// The projections of `x` for [`mlx_array::ops::heads`]: the joined product of a fused
    /// layer when it runs as one (the parts then sit at their split points), else one product
    /// per part.
    pub(crate) fn forward_for_heads(&self, x: &Array) -> Result<(Vec<Array>, Vec<usize>)> {
        match self {
            FusedLinear::Fused { lin, splits } => {
                if self.returns_views(rows_of(x)) {
                    let mut cols = vec![0];
                    cols.extend_from_slice(splits);
                    return Ok((vec![lin.forward(x)?], cols));
                }
                let parts = self.forward(x)?;
                let n = parts.len();
                Ok((parts, vec![0; n]))
            }
            FusedLinear::Separate(parts) => {
                let ys = parts.iter().map(|l| l.forward(x)).collect::<Result<Vec<_>>>()?;
                Ok((ys, vec![0; parts.len()]))
            }
        }
    }

    /// For inputs `[B, L, in]` of a joined float projection run as one product
    /// ([`FusedLinear::returns_views`]) whose parts are `heads[i]` heads of `head_dim` features
    /// each: part `i` heads-first, `[B, heads[i], L, head_dim]`, by one reshape of the joined
    /// product (and one transpose for `L > 1`) and one split, instead of a split, a reshape per
    /// part and a transpose per part (each a graph node: host work in a few-row step). `None`
    /// for projections that are not one float product, or other inputs.
    pub(crate) fn forward_heads<const N: usize>(&self, x: &Array, heads: &[usize; N], head_dim: usize) -> Result<Option<[Array; N]>> {
        let FusedLinear::Fused { lin, splits } = self else { return Ok(None) };
        let xd = x.dims();
        let fits = splits.len() + 1 == N && heads.iter().sum::<usize>() * head_dim == lin.out_dim();
        if lin.is_quantized() || !fits || xd.len() != 3 || !self.returns_views(rows_of(x)) {
            return Ok(None);
        }
        let mut at = Vec::with_capacity(N - 1);
        let mut acc = 0;
        for (i, h) in heads[..N - 1].iter().enumerate() {
            acc += h;
            if acc * head_dim != splits[i] {
                return Ok(None);
            }
            at.push(acc);
        }
        let (total, d) = (heads.iter().sum::<usize>() as i32, head_dim as i32);
        let y = match xd[1] {
            1 => lin.forward(x)?.reshape(&[xd[0], total, 1, d])?,
            l => lin.forward(x)?.reshape(&[xd[0], l, total, d])?.transpose(&[0, 2, 1, 3])?,
        };
        let parts = y.split_at(&at, 1)?;
        Ok(parts.try_into().ok())
    }

    /// Whether [`FusedLinear::forward`] of `rows` rows returns its parts as views of one
    /// joined product (columns of wider rows) rather than arrays of their own.
    pub(crate) fn returns_views(&self, rows: usize) -> bool {
        match self {
            FusedLinear::Fused { lin, .. } => rows <= FUSED_MAX_ROWS || lin.is_quantized(),
            FusedLinear::Separate(_) => false,
        }
    }

    /// The projections of `x`, in load order, each `[..., out_i]`.
    pub fn forward(&self, x: &Array) -> Result<Vec<Array>> {
        match self {
            FusedLinear::Separate(parts) => parts.iter().map(|l| l.forward(x)).collect(),
            FusedLinear::Fused { lin, splits } => {
                if self.returns_views(rows_of(x)) {
                    return Ok(lin.forward(x)?.split_at(splits, -1)?);
                }
                let mut bounds = Vec::with_capacity(splits.len() + 2);
                bounds.push(0);
                bounds.extend_from_slice(splits);
                bounds.push(lin.out_dim());
                bounds.windows(2).map(|w| lin.forward_cols(x, w[0], w[1])).collect()
            }
        }
    }
}

/// Token embedding table `[vocab, hidden]`, also usable as a tied output head. Quantized tables
/// (mlx-lm's `QuantizedEmbedding`) dequantize the looked-up rows, and their tied head runs
/// `quantized_matmul`.
#[derive(Clone)]
pub struct Embedding {
    table: EmbeddingTable,
    rows: usize,
    /// Tensor parallel: this rank holds rows `start..end` of the table ([`super::parallel`]).
    shard: Option<(mlx_array::distributed::Group, usize, usize)>,
}

#[derive(Clone)]
enum EmbeddingTable {
    Dense(Array),
    /// With the dtype the rows dequantize to.
    Quantized(Quantized, mlx_array::DType),
}

impl Embedding {
    pub fn load(vb: &Vb, vocab: usize, hidden: usize) -> Result<Self> {
        let shard = match super::parallel::group(vb) {
            Some(g) => {
                let local = super::parallel::per_rank(vb, "vocabulary rows", vocab)?;
                let r = g.rank();
                Some((g, r * local, (r + 1) * local))
            }
            None => None,
        };
        let table = if vb.is_quantized() {
            // a tensor-parallel rank holds its vocabulary rows of the packed table
            let q = match &shard {
                Some((g, ..)) => vb.quantized_shard(&[vocab, hidden], 0, g.rank(), g.size())?,
                None => vb.quantized(&[vocab, hidden])?,
            };
            match vb.weights().dequantize_to {
                Some(dt) => EmbeddingTable::Dense(q.dequantize(Some(dt))?),
                None => {
                    // Rows come out in the compute dtype (the checkpoint's other floats; scales
                    // kept bf16 on the CPU do not set it), else the scales' float dtype.
                    let dt = vb.weights().float_dtype().or_else(|| q.scales.dtype().is_float().then(|| q.scales.dtype())).unwrap_or(mlx_array::DType::F32);
                    EmbeddingTable::Quantized(q, dt)
                }
            }
        } else {
            match &shard {
                Some((g, ..)) => EmbeddingTable::Dense(vb.get_shard("weight", &[vocab, hidden], 0, g.rank(), g.size())?),
                None => EmbeddingTable::Dense(vb.get("weight", &[vocab, hidden])?),
            }
        };
        Ok(Embedding { table, rows: vocab, shard })
    }
    /// A float table.
    pub fn from_weight(weight: Array) -> Self {
        let rows = weight.shape().first().copied().unwrap_or(0);
        Embedding { table: EmbeddingTable::Dense(weight), rows, shard: None }
    }
    /// Vocabulary rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// The dtype of looked-up rows.
    pub fn dtype(&self) -> mlx_array::DType {
        match &self.table {
            EmbeddingTable::Dense(w) => w.dtype(),
            EmbeddingTable::Quantized(_, dt) => *dt,
        }
    }
    /// The float table (`None` when quantized).
    pub fn dense_weight(&self) -> Option<&Array> {
        match &self.table {
            EmbeddingTable::Dense(w) => Some(w),
            EmbeddingTable::Quantized(..) => None,
        }
    }
    /// `[B, L]` integer ids to `[B, L, hidden]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        if let Some((g, start, end)) = &self.shard {
            // This rank's rows; ids outside them look up row 0 and are zeroed, and the sum over
            // the ranks (one non-zero term per id) is the whole table's row, exactly.
            let ids = ids.astype(mlx_array::DType::I32)?;
            let lo = Array::scalar(*start as i32);
            let mine = ids.ge(&lo)?.logical_and(&ids.lt(&Array::scalar(*end as i32))?)?;
            let local = mlx_array::ops::where_(&mine, &ids.sub(&lo)?, &Array::scalar(0i32))?;
            let zero = Array::scalar_as(0.0, self.dtype())?;
            let rows = mlx_array::ops::where_(&mine.expand_dims(-1)?, &self.lookup(&local)?, &zero)?;
            return Ok(g.all_sum(&rows)?);
        }
        self.lookup(ids)
    }
    /// The rows of the held table at `ids`.
    fn lookup(&self, ids: &Array) -> Result<Array> {
        match &self.table {
            EmbeddingTable::Dense(w) => Ok(w.take(ids, 0)?),
            EmbeddingTable::Quantized(q, dt) => {
                let rows = Quantized {
                    weight: q.weight.take(ids, 0)?,
                    scales: q.scales.take(ids, 0)?,
                    biases: q.biases.as_ref().map(|b| b.take(ids, 0)).transpose()?,
                    mode: q.mode,
                };
                Ok(rows.dequantize(Some(*dt))?)
            }
        }
    }
    /// Tied output projection: `x @ E^T`.
    pub fn as_linear(&self) -> Result<Linear> {
        match &self.table {
            EmbeddingTable::Dense(w) => Linear::new(w.clone(), None),
            EmbeddingTable::Quantized(q, _) => Ok(Linear::quantized(q.clone(), None)),
        }
    }
    /// Bytes of the resident table.
    pub fn weight_bytes(&self) -> usize {
        match &self.table {
            EmbeddingTable::Dense(w) => w.nbytes(),
            EmbeddingTable::Quantized(q, _) => q.weight.nbytes() + q.scales.nbytes() + q.biases.as_ref().map_or(0, |b| b.nbytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::{QuantSpec, Weights};
    use mlx_array::DType;

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny").join(name)
    }

    /// A quantized checkpoint's layers keep their packed weights (products run
    /// `quantized_matmul`): 4-bit weights with f32 scales and biases in groups of 64 take 5/32
    /// of the f32 bytes; dequantized at load they are f32 again, with the same products.
    #[test]
    fn quantized_layers_stay_packed_unless_asked() {
        let dir = fixture("llama_q4");
        let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let mut w = Weights::load(&dir, Some(DType::F32)).unwrap();
        w.quant = QuantSpec::from_config(&cfg).unwrap();
        let vb = w.root().pp("model.layers.0.mlp.down_proj");
        let q = Linear::load(&vb, 128, 64, false).unwrap();
        assert!(q.is_quantized());
        assert_eq!(q.weight_bytes(), 64 * 128 * 5 / 8, "4 bits + 2 f32 per 64 = 5 bits a weight");
        let e = Embedding::load(&w.root().pp("model.embed_tokens"), 512, 64).unwrap();
        assert_eq!(e.weight_bytes(), 512 * 64 * 5 / 8);
        let x = mlx_array::random::normal(&[1, 3, 128], DType::F32, &mlx_array::random::Key::new(1).unwrap()).unwrap();
        let yq = q.forward(&x).unwrap().to_vec::<f32>().unwrap();
        w.dequantize_to = Some(DType::F32);
        let vb = w.root().pp("model.layers.0.mlp.down_proj");
        let d = Linear::load(&vb, 128, 64, false).unwrap();
        assert!(!d.is_quantized());
        assert_eq!(d.weight_bytes(), 64 * 128 * 4);
        let yd = d.forward(&x).unwrap().to_vec::<f32>().unwrap();
        let err = yq.iter().zip(&yd).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-4, "quantized_matmul vs dequantized product: {err}");
        // a layer stored quantized without a quantization entry in config.json is an error
        w.quant = None;
        assert!(Linear::load(&w.root().pp("model.layers.0.mlp.down_proj"), 128, 64, false).is_err());
    }
}

impl super::LayerArrays for Linear {
    fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut Array)) {
        if let LinearWeight::Dense(w) = &mut self.w {
            f(w);
            // the view follows the weight (a checkpointed layer's copy reads its inputs)
            self.batched = w.expand_dims(0).ok();
            self.stored = w.swap_axes(0, 1).ok();
        }
        if let Some(b) = &mut self.bias {
            f(b);
        }
        if let Some(l) = &mut self.lora {
            f(&mut l.a);
            f(&mut l.b);
        }
    }
}

impl super::LayerArrays for FusedLinear {
    fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut Array)) {
        match self {
            FusedLinear::Fused { lin, .. } => super::LayerArrays::visit_arrays(lin, f),
            FusedLinear::Separate(parts) => parts.iter_mut().for_each(|p| super::LayerArrays::visit_arrays(p, f)),
        }
    }
}
