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
        Ok(GatedMlp {
            gate_up: FusedLinear::load(vb, &names[..2], hidden, &[inter, inter], false)?,
            down: Linear::load(&vb.pp(names[2]), inter, hidden, false)?,
            act,
        })
    }
    pub fn load(vb: &Vb, hidden: usize, inter: usize, act: Activation) -> Result<Self> {
        Self::load_named(vb, ["gate_proj", "up_proj", "down_proj"], hidden, inter, act)
    }
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let gu = self.gate_up.forward(x)?;
        let h = match self.act {
            Activation::Silu => gu[0].swiglu(&gu[1])?,
            Activation::GeluTanh => gu[0].geglu_tanh(&gu[1])?,
            act => act.apply(&gu[0])?.mul(&gu[1])?,
        };
        self.down.forward(&h)
    }
}
