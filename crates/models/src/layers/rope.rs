use crate::Result;
use mlx_array::{Array, RopeConfig};

/// Rotary position embedding (NeoX-style halves unless `traditional`), possibly partial.
#[derive(Clone)]
pub struct Rope {
    pub dims: usize,
    pub base: f32,
    pub traditional: bool,
    pub scale: f32,
    /// Explicit inverse frequencies, for scaled variants (llama3, yarn, proportional).
    pub freqs: Option<Array>,
}

impl Rope {
    pub fn new(dims: usize, base: f32) -> Self {
        Rope { dims, base, traditional: false, scale: 1.0, freqs: None }
    }
    /// `x`: `[B, H, L, D]`; row `l` sits at position `offset + l`.
    pub fn forward(&self, x: &Array, offset: usize) -> Result<Array> {
        let cfg = RopeConfig { dims: self.dims, traditional: self.traditional, base: self.base, scale: self.scale, freqs: self.freqs.as_ref() };
        Ok(x.rope(&cfg, offset)?)
    }
}
