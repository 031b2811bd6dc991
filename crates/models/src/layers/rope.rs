//! Rotary position embeddings and the scaled variants of `rope_scaling` / `rope_parameters`
//! (transformers' `modeling_rope_utils.py`): `linear`, `dynamic` (NTK), `yarn`, `llama3`.
use crate::Result;
use mlx_array::{Array, RopeConfig};
use serde::{Deserialize, Serialize};

/// `rope_scaling` of config.json (`rope_type`, or the older `type`), or a scaled
/// `rope_parameters` dict of transformers 5.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RopeScaling {
    /// Empty when the key is absent: see [`RopeScaling::kind`].
    #[serde(default)]
    pub rope_type: String,
    /// The older key `type` (transformers writes both in saved configs).
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub legacy_type: Option<String>,
    #[serde(default)]
    pub factor: Option<f32>,
    #[serde(default)]
    pub low_freq_factor: Option<f32>,
    #[serde(default)]
    pub high_freq_factor: Option<f32>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// YaRN: explicit attention factor (otherwise `0.1 ln(factor) + 1`).
    #[serde(default)]
    pub attention_factor: Option<f32>,
    #[serde(default)]
    pub beta_fast: Option<f32>,
    #[serde(default)]
    pub beta_slow: Option<f32>,
    #[serde(default)]
    pub mscale: Option<f32>,
    #[serde(default)]
    pub mscale_all_dim: Option<f32>,
    /// YaRN: round the correction range to whole dims (default true).
    #[serde(default)]
    pub truncate: Option<bool>,
}

impl RopeScaling {
    /// The scaling type: `rope_type`, else the older `type`, else `default`.
    pub fn kind(&self) -> &str {
        match (self.rope_type.as_str(), self.legacy_type.as_deref()) {
            ("", Some(t)) if !t.is_empty() => t,
            ("", _) => "default",
            (t, _) => t,
        }
    }
}

/// Dynamic NTK: the base grows with the sequence once it passes `max_position_embeddings`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamicNtk {
    pub factor: f32,
    pub max_position_embeddings: usize,
}

/// Rotary position embedding (NeoX-style halves unless `traditional`), possibly partial.
#[derive(Clone)]
pub struct Rope {
    pub dims: usize,
    pub base: f32,
    pub traditional: bool,
    pub scale: f32,
    /// Explicit wavelengths (MLX's `freqs`), for scaled variants (llama3, yarn, proportional).
    pub freqs: Option<Array>,
    /// Multiplies the rotated features of q and k (YaRN's attention factor; 1 otherwise).
    pub mscale: f32,
    pub dynamic: Option<DynamicNtk>,
}

impl Rope {
    pub fn new(dims: usize, base: f32) -> Self {
        Rope { dims, base, traditional: false, scale: 1.0, freqs: None, mscale: 1.0, dynamic: None }
    }

    /// The rope a config asks for: `dims` rotated features, base `base`, `scaling` as read from
    /// `rope_scaling` (`None` or `default`: plain). `mrope` (Qwen-VL's multimodal rope) is plain
    /// for text: its sections all see the token's one position. Unknown types and missing
    /// parameters are errors.
    pub fn scaled(dims: usize, base: f32, scaling: Option<&RopeScaling>, max_position_embeddings: usize) -> std::result::Result<Rope, String> {
        let mut rope = Rope::new(dims, base);
        let Some(s) = scaling else { return Ok(rope) };
        let factor = |kind: &str| -> std::result::Result<f32, String> {
            match s.factor {
                Some(f) if f > 0.0 && f.is_finite() => Ok(f),
                Some(f) => Err(format!("{kind} rope_scaling factor {f} must be positive")),
                None => Err(format!("{kind} rope_scaling needs factor")),
            }
        };
        match s.kind() {
            "default" | "mrope" => {}
            "linear" => rope.scale = 1.0 / factor("linear")?,
            "dynamic" => {
                if dims <= 2 {
                    return Err(format!("dynamic rope_scaling needs more than 2 rotary dims, got {dims}"));
                }
                rope.dynamic = Some(DynamicNtk { factor: factor("dynamic")?, max_position_embeddings });
            }
            "llama3" => {
                let w = llama3_wavelengths(dims, base, s)?;
                rope.freqs = Some(Array::from_slice(&w, &[dims / 2]).map_err(|e| e.to_string())?);
            }
            "yarn" => {
                let (w, mscale) = yarn(dims, base, s, max_position_embeddings)?;
                rope.freqs = Some(Array::from_slice(&w, &[dims / 2]).map_err(|e| e.to_string())?);
                rope.mscale = mscale;
            }
            other => {
                return Err(format!("rope_scaling type {other:?} is not supported (default, linear, dynamic, yarn and llama3 are)"));
            }
        }
        Ok(rope)
    }

    /// `x`: `[B, H, L, D]`; row `l` sits at position `offset + l`.
    pub fn forward(&self, x: &Array, offset: usize) -> Result<Array> {
        // transformers recomputes dynamic-NTK frequencies for the longest position of the call.
        let (x, cfg) = self.prepare(x, offset + x.dim(-2)?)?;
        Ok(x.rope(&cfg, offset)?)
    }

    /// [`Rope::forward`] with one start position per batch row (`offsets`: i32 `[B]`);
    /// `longest` is the largest position the call reaches plus one (dynamic NTK computes its base
    /// for it, as transformers does for a batch: the longest row).
    pub fn forward_rows(&self, x: &Array, offsets: &Array, longest: usize) -> Result<Array> {
        let (x, cfg) = self.prepare(x, longest)?;
        Ok(x.rope_rows(&cfg, offsets)?)
    }

    /// The rotation settings for a call reaching position `longest - 1` when they are all of it
    /// (no YaRN attention factor to apply to the rotated features).
    pub(crate) fn plain_config(&self, longest: usize) -> Option<RopeConfig<'_>> {
        if self.mscale != 1.0 {
            return None;
        }
        let base = match self.dynamic {
            Some(d) => dynamic_base(self.base, self.dims, d, longest),
            None => self.base,
        };
        Some(RopeConfig { dims: self.dims, traditional: self.traditional, base, scale: self.scale, freqs: self.freqs.as_ref() })
    }

    /// The rotation settings for a call reaching position `longest - 1`, and `x` with the YaRN
    /// attention factor applied to its rotated dimensions.
    fn prepare(&self, x: &Array, longest: usize) -> Result<(Array, RopeConfig<'_>)> {
        let base = match self.dynamic {
            Some(d) => dynamic_base(self.base, self.dims, d, longest),
            None => self.base,
        };
        let cfg = RopeConfig { dims: self.dims, traditional: self.traditional, base, scale: self.scale, freqs: self.freqs.as_ref() };
        let x = if self.mscale == 1.0 {
            x.clone()
        } else if x.dim(-1)? == self.dims {
            x.mul_scalar(self.mscale)?
        } else {
            let parts = x.split_at(&[self.dims], -1)?;
            mlx_array::ops::concatenate(&[&parts[0].mul_scalar(self.mscale)?, &parts[1]], -1)?
        };
        Ok((x, cfg))
    }
}

/// Where the tokens of a forward call sit for the rotary embedding.
#[derive(Clone, Default)]
pub enum RopeAt {
    /// At their cache positions (the usual).
    #[default]
    Cache,
    /// At their cache positions plus a shift (text after media under Qwen's M-RoPE).
    Shift(i64),
    /// Explicit angles per token: `cos` and `sin` `[L, rotary_dims / 2]` (M-RoPE over media).
    Angles { cos: Array, sin: Array },
}

/// NeoX-style rotation of the first `2 * cos.dim(-1)` features of `x` (`[.., L, D]`) by the
/// angles whose cosines and sines are `cos`, `sin` (`[L, half]`, cast to `x`'s dtype as
/// transformers does); the other features pass unchanged.
pub fn rotate_half_by(x: &Array, cos: &Array, sin: &Array) -> Result<Array> {
    let half = cos.dim(-1)?;
    let d = x.dim(-1)?;
    let dt = x.dtype();
    let (c, s) = (cos.astype(dt)?, sin.astype(dt)?);
    let parts = if 2 * half < d { x.split_at(&[half, 2 * half], -1)? } else { x.split_at(&[half], -1)? };
    let (x1, x2) = (&parts[0], &parts[1]);
    let o1 = x1.mul(&c)?.sub(&x2.mul(&s)?)?;
    let o2 = x2.mul(&c)?.add(&x1.mul(&s)?)?;
    let mut all = vec![&o1, &o2];
    all.extend(parts.get(2));
    Ok(mlx_array::ops::concatenate(&all, -1)?)
}

/// transformers' `_compute_dynamic_ntk_parameters` at `seq` positions.
pub fn dynamic_base(base: f32, dims: usize, d: DynamicNtk, seq: usize) -> f32 {
    let (seq, max) = (seq.max(d.max_position_embeddings) as f64, d.max_position_embeddings as f64);
    let f = d.factor as f64;
    (base as f64 * ((f * seq / max) - (f - 1.0)).powf(dims as f64 / (dims as f64 - 2.0))) as f32
}

/// mlx-lm's `Llama3RoPE`: wavelengths `θ^(2j/d)`, stretched by `factor` below the low-frequency
/// cut, unchanged above the high-frequency one, and smoothly interpolated between.
pub fn llama3_wavelengths(dims: usize, base: f32, s: &RopeScaling) -> std::result::Result<Vec<f32>, String> {
    let factor = s.factor.ok_or("llama3 rope_scaling needs factor")?;
    let low = s.low_freq_factor.unwrap_or(1.0);
    let high = s.high_freq_factor.unwrap_or(4.0);
    let old = s.original_max_position_embeddings.unwrap_or(8192) as f32;
    if high <= low {
        return Err(format!("llama3 rope_scaling: high_freq_factor {high} must exceed low_freq_factor {low}"));
    }
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    Ok((0..dims / 2)
        .map(|j| {
            let f = base.powf((2 * j) as f32 / dims as f32);
            let wavelen = 2.0 * std::f32::consts::PI * f;
            let f = if wavelen > low_wavelen { f * factor } else { f };
            if wavelen > high_wavelen && wavelen < low_wavelen {
                let smooth = (old / wavelen - low) / (high - low);
                f / ((1.0 - smooth) / factor + smooth)
            } else {
                f
            }
        })
        .collect())
}

/// transformers' `_compute_yarn_parameters`: the wavelengths (inverse frequencies blended
/// between interpolation and extrapolation by a linear ramp over the correction range) and the
/// attention factor.
pub fn yarn(dims: usize, base: f32, s: &RopeScaling, max_position_embeddings: usize) -> std::result::Result<(Vec<f32>, f32), String> {
    let orig = s.original_max_position_embeddings.ok_or("yarn rope_scaling needs original_max_position_embeddings")? as f64;
    let factor = match s.factor {
        Some(f) => f as f64,
        None => max_position_embeddings as f64 / orig,
    };
    if !(factor > 0.0 && factor.is_finite()) || orig <= 0.0 {
        return Err(format!("yarn rope_scaling factor {factor} and original_max_position_embeddings {orig} must be positive"));
    }
    let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let attention = match (s.attention_factor, s.mscale, s.mscale_all_dim) {
        (Some(a), _, _) => a as f64,
        (None, Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => get_mscale(factor, m as f64) / get_mscale(factor, ma as f64),
        _ => get_mscale(factor, 1.0),
    };
    let beta_fast = s.beta_fast.filter(|b| *b != 0.0).unwrap_or(32.0) as f64;
    let beta_slow = s.beta_slow.filter(|b| *b != 0.0).unwrap_or(1.0) as f64;
    let (d, b) = (dims as f64, base as f64);
    let correction = |rot: f64| (d * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * b.ln());
    let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
    if s.truncate.unwrap_or(true) {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
    if low == high {
        high += 0.001;
    }
    let w = (0..dims / 2)
        .map(|j| {
            let pos = (base as f32).powf((2 * j) as f32 / dims as f32);
            let ramp = (((j as f64 - low) / (high - low)).clamp(0.0, 1.0)) as f32;
            let extrapolation = 1.0 - ramp;
            let inv = (1.0 / (factor as f32 * pos)) * (1.0 - extrapolation) + (1.0 / pos) * extrapolation;
            1.0 / inv
        })
        .collect();
    Ok((w, attention as f32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_wavelengths_match_mlx_lm() {
        // mlx-lm Llama3RoPE(dims=8, base=500000, factor=8, low=1, high=4, old=8192)._freqs
        let s = RopeScaling {
            rope_type: "llama3".into(),
            factor: Some(8.0),
            low_freq_factor: Some(1.0),
            high_freq_factor: Some(4.0),
            original_max_position_embeddings: Some(8192),
            ..Default::default()
        };
        let w = llama3_wavelengths(8, 500000.0, &s).unwrap();
        let base: Vec<f32> = (0..4).map(|j| 500000f32.powf((2 * j) as f32 / 8.0)).collect();
        // j=0: 1 (high frequency, kept); j=1: 26.59 (kept); j=2: 707.1 (medium band: smoothed);
        // j=3: 18803 (low frequency: times 8)
        assert_eq!(w[0], base[0]);
        assert_eq!(w[1], base[1]);
        assert!(w[2] > base[2] && w[2] < base[2] * 8.0);
        assert_eq!(w[3], base[3] * 8.0);
        assert!(llama3_wavelengths(8, 1e4, &RopeScaling { factor: None, ..s.clone() }).is_err());
    }

    #[test]
    fn yarn_blends_between_extrapolation_and_interpolation() {
        let s = RopeScaling { rope_type: "yarn".into(), factor: Some(4.0), original_max_position_embeddings: Some(32), ..Default::default() };
        let (w, a) = yarn(16, 1e6, &s, 128).unwrap();
        let pos: Vec<f32> = (0..8).map(|j| 1e6f32.powf((2 * j) as f32 / 16.0)).collect();
        // correction range for d=16, base 1e6, orig 32: low = max(floor(-1.06), 0) = 0,
        // high = ceil(0.94) = 1: pair 0 extrapolates (kept), the rest interpolate (times 4)
        assert_eq!(w[0], pos[0]);
        for j in 1..8 {
            assert!((w[j] / (4.0 * pos[j]) - 1.0).abs() < 1e-5, "pair {j}: {} vs {}", w[j], pos[j]);
        }
        let (w, _) = yarn(16, 1e6, &RopeScaling { beta_slow: Some(0.25), ..s.clone() }, 128).unwrap();
        // high = ceil(1.77) = 2: pair 1 is blended half and half
        assert!((w[1] / pos[1] - 1.0 / (0.5 / 4.0 + 0.5)).abs() < 1e-5, "{} {}", w[1], pos[1]);
        assert!((a - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
        assert!(yarn(16, 1e6, &RopeScaling { original_max_position_embeddings: None, ..s }, 128).is_err());
    }

    #[test]
    fn unknown_rope_types_and_bad_factors_are_errors() {
        let s = |t: &str, f: Option<f32>| RopeScaling { rope_type: t.into(), factor: f, ..Default::default() };
        assert!(Rope::scaled(8, 1e4, Some(&s("su", Some(2.0))), 64).err().unwrap().contains("\"su\""));
        assert!(Rope::scaled(8, 1e4, Some(&s("linear", Some(0.0))), 64).is_err());
        assert!(Rope::scaled(8, 1e4, Some(&s("dynamic", None)), 64).is_err());
        assert_eq!(Rope::scaled(8, 1e4, Some(&s("linear", Some(4.0))), 64).unwrap().scale, 0.25);
        assert!(Rope::scaled(8, 1e4, Some(&s("default", None)), 64).unwrap().freqs.is_none());
    }

    #[test]
    fn dynamic_base_grows_past_the_trained_length_only() {
        let d = DynamicNtk { factor: 2.0, max_position_embeddings: 64 };
        assert_eq!(dynamic_base(1e4, 16, d, 10), 1e4);
        assert_eq!(dynamic_base(1e4, 16, d, 64), 1e4);
        let want = 1e4 * ((2.0f64 * 128.0 / 64.0) - 1.0).powf(16.0 / 14.0);
        assert!((dynamic_base(1e4, 16, d, 128) as f64 / want - 1.0).abs() < 1e-6);
    }
}
