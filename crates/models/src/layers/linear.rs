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
