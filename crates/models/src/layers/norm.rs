use crate::weights::Vb;
use crate::Result;
use mlx_array::{Array, DType};

/// RMSNorm over the last axis. Checkpoints that store `w` for an `x * (1 + w)` norm
/// (Qwen3.5, Qwen3-Next) load with `offset = 1.0`: the `1 + w` is done once, in f32.
#[derive(Clone)]
pub struct RmsNorm {
    weight: Option<Array>,
    eps: f32,
}

impl RmsNorm {
    pub fn load(vb: &Vb, dim: usize, eps: f32, offset: f32) -> Result<Self> {
        // a random checkpoint's norms scale by about 1: w ~ 1 + N(0, 0.1) as stored for `x * w`,
        // w ~ N(0, 0.1) for `x * (1 + w)`
        let w = vb.get_init("weight", &[dim], crate::weights::Init::normal(1.0 - offset, 0.1))?;
        let w = if offset != 0.0 {
            let d = w.dtype();
            w.astype(DType::F32)?.add_scalar(offset)?.astype(d)?
        } else {
            w
        };
        Ok(RmsNorm { weight: Some(w), eps })
    }
    /// A norm with no learned scale (Gemma 4's v_norm).
    pub fn unit(eps: f32) -> Self {
        RmsNorm { weight: None, eps }
    }
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(x.rms_norm(self.weight.as_ref(), self.eps)?)
    }
}

impl super::LayerArrays for RmsNorm {
    fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut Array)) {
        if let Some(w) = &mut self.weight {
            f(w);
        }
    }
}
