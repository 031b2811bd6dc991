use crate::weights::Vb;
use crate::Result;
use mlx_array::Array;

/// `y = x W^T (+ b)` with `W` stored `[out, in]` as in the checkpoint.
#[derive(Clone)]
pub struct Linear {
    wt: Array,
    bias: Option<Array>,
}

impl Linear {
    pub fn new(weight: Array, bias: Option<Array>) -> Result<Self> {
        Ok(Linear { wt: weight.swap_axes(0, 1)?, bias })
    }
    /// `prefix.weight` of shape `[out, in]` and, if `bias`, `prefix.bias`.
    pub fn load(vb: &Vb, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        let w = vb.get("weight", &[out_dim, in_dim])?;
        let b = if bias { Some(vb.get("bias", &[out_dim])?) } else { None };
        Self::new(w, b)
    }
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = x.matmul(&self.wt)?;
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
    pub fn out_dim(&self) -> usize {
        self.wt.shape()[1]
    }
    /// Output columns `start..end` only: `x W[start..end]^T (+ b[start..end])`. The rows of the
    /// stored `[out, in]` weight are contiguous, so the slice is a view the matmul reads as a
    /// transposed operand (no copy).
    fn forward_cols(&self, x: &Array, start: usize, end: usize) -> Result<Array> {
        let y = x.matmul(&self.wt.slice_axis(1, start, end)?)?;
        Ok(match &self.bias {
            Some(b) => y.add(&b.slice_axis(0, start, end)?)?,
            None => y,
        })
    }
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
/// separate products measured as fast or faster, and their outputs are contiguous, so the
/// projections stay separate there. The device is the default device at load, where the
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
        let fuse = names.len() > 1 && vb.weights().fuse_projections()?;
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
        let cat = |parts: &[Array]| -> Result<Array> {
            let refs: Vec<&Array> = parts.iter().collect();
            let a = mlx_array::ops::concatenate(&refs, 0)?;
            a.eval()?; // materialise now: the parts are freed when this returns
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

    /// Part `i` of the output only (`x W_i^T`): the other parts' columns are not computed.
    pub fn part(&self, i: usize, x: &Array) -> Result<Array> {
        match self {
            FusedLinear::Separate(parts) => parts[i].forward(x),
            FusedLinear::Fused { lin, splits } => {
                let start = if i == 0 { 0 } else { splits[i - 1] };
                let end = splits.get(i).copied().unwrap_or(lin.out_dim());
                lin.forward_cols(x, start, end)
            }
        }
    }

    /// The projections of `x`, in load order, each `[..., out_i]`.
    pub fn forward(&self, x: &Array) -> Result<Vec<Array>> {
        match self {
            FusedLinear::Separate(parts) => parts.iter().map(|l| l.forward(x)).collect(),
            FusedLinear::Fused { lin, splits } => {
                let rows = x.size() / x.dims().last().map_or(1, |&d| d.max(1) as usize);
                if rows <= FUSED_MAX_ROWS {
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

/// Token embedding table `[vocab, hidden]`, also usable as a tied output head.
#[derive(Clone)]
pub struct Embedding {
    pub weight: Array,
}

impl Embedding {
    pub fn load(vb: &Vb, vocab: usize, hidden: usize) -> Result<Self> {
        Ok(Embedding { weight: vb.get("weight", &[vocab, hidden])? })
    }
    /// `[B, L]` integer ids to `[B, L, hidden]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        Ok(self.weight.take(ids, 0)?)
    }
    /// Tied output projection: `x @ E^T`.
    pub fn as_linear(&self) -> Result<Linear> {
        Linear::new(self.weight.clone(), None)
    }
}
