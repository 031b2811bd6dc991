use super::parallel::Shard;
use super::{FusedLinear, Linear};
use crate::weights::Vb;
use crate::Result;
use mlx_array::Array;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// tanh-approximated GELU (`gelu_pytorch_tanh`).
    GeluTanh,
    Gelu,
}

impl Activation {
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Activation::GeluTanh,
            "gelu" => Activation::Gelu,
            _ => return None,
        })
    }
    pub fn apply(self, x: &Array) -> Result<Array> {
        Ok(match self {
            Activation::Silu => x.silu()?,
            Activation::GeluTanh => x.gelu_tanh()?,
            Activation::Gelu => x.gelu()?,
        })
    }
    /// `act(x) * up`, as one fused kernel where `mlx_array`'s fusion can compile (SwiGLU, GeGLU).
    pub fn gated(self, x: &Array, up: &Array) -> Result<Array> {
        Ok(match self {
            Activation::Silu => x.swiglu(up)?,
            Activation::GeluTanh => x.geglu_tanh(up)?,
            act => act.apply(x)?.mul(up)?,
        })
    }
}

/// `down(act(gate(x)) * up(x))` (SwiGLU / GeGLU).
#[derive(Clone)]
pub struct GatedMlp {
    /// `gate` and `up` as one product.
    gate_up: FusedLinear,
    down: Linear,
    act: Activation,
}

impl GatedMlp {
    /// Checkpoint names `gate_proj`, `up_proj`, `down_proj` (pass others for LFM2's w1/w3/w2).
    pub fn load_named(vb: &Vb, names: [&str; 3], hidden: usize, inter: usize, act: Activation) -> Result<Self> {
        Self::load_biased(vb, names, hidden, inter, act, false)
    }
    /// [`GatedMlp::load_named`], with biases on all three projections when `bias` (Llama `mlp_bias`).
    pub fn load_biased(vb: &Vb, names: [&str; 3], hidden: usize, inter: usize, act: Activation, bias: bool) -> Result<Self> {
        Ok(GatedMlp {
            gate_up: FusedLinear::load_sharded(vb, &names[..2], hidden, &[inter, inter], bias)?,
            down: Linear::load_parallel(&vb.pp(names[2]), inter, hidden, bias, Shard::Input)?,
            act,
        })
    }
    pub fn load(vb: &Vb, hidden: usize, inter: usize, act: Activation) -> Result<Self> {
        Self::load_named(vb, ["gate_proj", "up_proj", "down_proj"], hidden, inter, act)
    }
    pub fn forward(&self, x: &Array) -> Result<Array> {
        if self.act == Activation::Silu {
            if let Some(h) = self.gate_up.swiglu_packed(x)? {
                return self.down.forward(&h);
            }
        }
        let gu = self.gate_up.forward(x)?;
        self.down.forward(&self.act.gated(&gu[0], &gu[1])?)
    }
}

super::layer_arrays!(GatedMlp { gate_up, down });
