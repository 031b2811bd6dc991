//! Gemma 4 audio encoder and its feature extractor, as transformers' `modeling_gemma4.py`
//! (`Gemma4AudioModel`, `Gemma4MultimodalEmbedder`) and `feature_extraction_gemma4.py`
//! (`Gemma4AudioFeatureExtractor`) define them.
//!
//! Features (16 kHz mono): `frame_length / 2` zeros prepended, frames of `frame_length + 1`
//! samples every `hop_length` (optional pre-emphasis), a periodic Hann window, the magnitude
//! of a real FFT of `fft_length` points, an HTK mel filter bank (no norm) and
//! `log(mel + mel_floor)`, optionally standardised per bin. Only frames whose whole window is
//! real audio are produced: the extractor's right padding (to a multiple of 128 samples)
//! yields frames the model masks out and drops.
//!
//! Encoder: two 3x3 stride-2 convolutions with LayerNorm and ReLU (time and frequency
//! subsampled by 4), a projection to `hidden_size`, conformer layers (half-step feed-forward,
//! chunked local self-attention with a learned per-dimension query scale, sinusoidal relative
//! position keys and logit soft-capping, a light causal depthwise convolution, a second
//! feed-forward), `output_proj`, then `embed_audio` (a scale-free RMSNorm and a projection into
//! the language model). The chunked attention is computed as full attention over the same
//! window: query `i` sees keys `j` with `0 <= i - j < attention_context_left - 1` or
//! `0 < j - i < attention_context_right`, and its relative-position term is that of
//! transformers' blocked layout and shift.
use super::gemma4_vision::{default_eps, ClipLinear, MediaEmbedder};
use crate::config::default_usize;
use crate::layers::{Activation, Linear, RmsNorm};
use crate::weights::Vb;
use crate::{ModelError, Result};
use mlx_array::{ops, Array, DType};
use serde::Deserialize;
use serde_json::Value;

fn f<const N: i64>() -> f32 {
    N as f32
}
fn half() -> f32 {
    0.5
}
fn invalid_logit() -> f32 {
    -1.0e9
}
fn grad_clip() -> f32 {
    1.0e10
}
fn yes() -> bool {
    true
}
fn silu() -> String {
    "silu".into()
}
fn conv_channels() -> Vec<usize> {
    vec![128, 32]
}

/// `audio_config` of a Gemma 4 checkpoint (defaults as transformers' `Gemma4AudioConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma4AudioConfig {
    #[serde(default = "default_usize::<1024>")]
    pub hidden_size: usize,
    #[serde(default = "default_usize::<12>")]
    pub num_hidden_layers: usize,
    #[serde(default = "default_usize::<8>")]
    pub num_attention_heads: usize,
    #[serde(default = "silu")]
    pub hidden_act: String,
    #[serde(default = "conv_channels")]
    pub subsampling_conv_channels: Vec<usize>,
    #[serde(default = "default_usize::<5>")]
    pub conv_kernel_size: usize,
    #[serde(default = "half")]
    pub residual_weight: f32,
    #[serde(default = "default_usize::<12>")]
    pub attention_chunk_size: usize,
    #[serde(default = "default_usize::<13>")]
    pub attention_context_left: usize,
    #[serde(default)]
    pub attention_context_right: usize,
    #[serde(default = "f::<50>")]
    pub attention_logit_cap: f32,
    #[serde(default = "invalid_logit")]
    pub attention_invalid_logits_value: f32,
    #[serde(default = "yes")]
    pub use_clipped_linears: bool,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "grad_clip")]
    pub gradient_clipping: f32,
    #[serde(default = "default_usize::<1536>")]
    pub output_proj_dims: usize,
}

impl Gemma4AudioConfig {
    fn past(&self) -> usize {
        self.attention_context_left.saturating_sub(1)
    }

    /// Relative positions of the attention (`context // 2 + 1`).
    fn rel_positions(&self) -> usize {
        (self.attention_chunk_size + self.past() + self.attention_context_right) / 2 + 1
    }

    /// Checks the settings before any tensor is read.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let (h, n) = (self.hidden_size, self.num_attention_heads);
        if h == 0 || n == 0 || h % n != 0 || self.num_hidden_layers == 0 || self.output_proj_dims == 0 {
            return Err(format!(
                "audio_config: hidden_size {h} must be a positive multiple of num_attention_heads {n}, with layers and output_proj_dims positive"
            ));
        }
        if h % 2 != 0 {
            return Err("audio_config: hidden_size must be even (sinusoidal positions)".into());
        }
        if self.subsampling_conv_channels.len() != 2 || self.subsampling_conv_channels.contains(&0) {
            return Err(format!("audio_config: subsampling_conv_channels must be two positive sizes, got {:?}", self.subsampling_conv_channels));
        }
        if self.conv_kernel_size == 0 || self.attention_chunk_size == 0 {
            return Err("audio_config: conv_kernel_size and attention_chunk_size must be positive".into());
        }
        if self.attention_context_left < 2 {
            return Err("audio_config: attention_context_left must be at least 2 (each position attends to itself)".into());
        }
        // transformers' relative shift reads the zero padding of the previous row for keys left of
        // the query inside a block only when the relative table is long enough to wrap around.
        let (c, p, r) = (self.attention_chunk_size, self.past(), self.attention_context_right);
        if p + r + 1 < (c + p + r) / 2 {
            return Err(format!("audio_config: attention_chunk_size {c} is too large for context left {} / right {r}", self.attention_context_left));
        }
        if self.attention_logit_cap.is_nan() || self.attention_logit_cap <= 0.0 {
            return Err("audio_config: attention_logit_cap must be positive".into());
        }
        if Activation::parse(&self.hidden_act).is_none() {
            return Err(format!("audio_config: unknown hidden_act {:?}", self.hidden_act));
        }
        Ok(())
    }
}

fn default_sr() -> usize {
    16_000
}
fn frame_ms() -> f32 {
    20.0
}
fn hop_ms() -> f32 {
    10.0
}
fn max_freq() -> f32 {
    8000.0
}
fn one() -> f32 {
    1.0
}
fn mel_floor() -> f64 {
    1e-3
}

/// Settings of `Gemma4AudioFeatureExtractor` (`feature_extractor` of `processor_config.json`,
/// or `preprocessor_config.json`; defaults as transformers').
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma4AudioFeatureConfig {
    #[serde(default = "default_usize::<128>")]
    pub feature_size: usize,
    #[serde(default = "default_sr")]
    pub sampling_rate: usize,
    #[serde(default = "frame_ms")]
    pub frame_length_ms: f32,
    #[serde(default = "hop_ms")]
    pub hop_length_ms: f32,
    #[serde(default)]
    pub min_frequency: f32,
    #[serde(default = "max_freq")]
    pub max_frequency: f32,
    #[serde(default)]
    pub preemphasis: f32,
    #[serde(default = "yes")]
    pub preemphasis_htk_flavor: bool,
    #[serde(default)]
    pub fft_overdrive: bool,
    #[serde(default)]
    pub dither: f32,
    #[serde(default = "one")]
    pub input_scale_factor: f32,
    #[serde(default = "mel_floor")]
    pub mel_floor: f64,
    #[serde(default)]
    pub per_bin_mean: Option<Vec<f64>>,
    #[serde(default)]
    pub per_bin_stddev: Option<Vec<f64>>,
}

impl Default for Gemma4AudioFeatureConfig {
    fn default() -> Self {
        serde_json::from_value(serde_json::json!({})).expect("all fields have defaults")
    }
}

/// The log-mel feature extractor.
#[derive(Debug, Clone)]
pub struct Gemma4AudioFeatureExtractor {
    cfg: Gemma4AudioFeatureConfig,
    frame_length: usize,
    hop_length: usize,
    fft_length: usize,
    window: Vec<f32>,
    /// `[fft_length / 2 + 1][feature_size]`.
    mel: Vec<Vec<f64>>,
}

/// The longest input the extractor takes (30 s at 16 kHz); longer audio is truncated, as the
/// extractor's default `max_length` does.
pub const MAX_SAMPLES: usize = 480_000;

impl Gemma4AudioFeatureExtractor {
    pub fn new(cfg: Gemma4AudioFeatureConfig) -> Result<Self> {
        let bad = |m: String| Err(ModelError::InvalidInput(format!("audio feature extractor: {m}")));
        if cfg.dither != 0.0 {
            return bad(format!("dither {} adds random noise; only 0 (deterministic features) is supported", cfg.dither));
        }
        let frame_length = (cfg.sampling_rate as f64 * cfg.frame_length_ms as f64 / 1000.0).round() as usize;
        let hop_length = (cfg.sampling_rate as f64 * cfg.hop_length_ms as f64 / 1000.0).round() as usize;
        if cfg.feature_size == 0 || frame_length < 2 || hop_length == 0 {
            return bad(format!("feature_size {}, frame length {frame_length} and hop {hop_length} samples must be positive", cfg.feature_size));
        }
        if cfg.max_frequency.is_nan() || cfg.max_frequency <= cfg.min_frequency || cfg.min_frequency < 0.0 {
            return bad(format!("frequency range {}..{} Hz", cfg.min_frequency, cfg.max_frequency));
        }
        for (name, v) in [("per_bin_mean", &cfg.per_bin_mean), ("per_bin_stddev", &cfg.per_bin_stddev)] {
            if v.as_ref().is_some_and(|v| v.len() != cfg.feature_size) {
                return bad(format!("{name} must have feature_size ({}) values", cfg.feature_size));
            }
        }
        let mut fft_length = frame_length.next_power_of_two();
        if cfg.fft_overdrive {
            fft_length *= 2;
        }
        // periodic Hann (numpy's hanning(n + 1)[:-1]), in f32 as the extractor keeps it
        let window = (0..frame_length).map(|n| (0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / frame_length as f64).cos()) as f32).collect();
        let mel = mel_filter_bank(fft_length / 2 + 1, cfg.feature_size, cfg.min_frequency as f64, cfg.max_frequency as f64, cfg.sampling_rate);
        Ok(Gemma4AudioFeatureExtractor { cfg, frame_length, hop_length, fft_length, window, mel })
    }

    /// The extractor of a checkpoint: `feature_extractor` of `processor_config.json`, or
    /// `preprocessor_config.json`, or the defaults.
    pub fn for_checkpoint(dir: &std::path::Path) -> Result<Self> {
        for name in ["processor_config.json", "preprocessor_config.json"] {
            let p = dir.join(name);
            let Ok(text) = std::fs::read_to_string(&p) else { continue };
            let v: Value = serde_json::from_str(&text).map_err(|e| ModelError::MalformedConfig { path: p.clone(), reason: e.to_string() })?;
            let fe = v.get("feature_extractor").unwrap_or(&v);
            if fe.get("feature_size").is_some() || fe.get("feature_extractor_type").is_some() {
                let cfg = serde_json::from_value(fe.clone()).map_err(|e| ModelError::MalformedConfig { path: p.clone(), reason: e.to_string() })?;
                return Self::new(cfg);
            }
        }
        Self::new(Gemma4AudioFeatureConfig::default())
    }

    pub fn config(&self) -> &Gemma4AudioFeatureConfig {
        &self.cfg
    }

    /// Mel frames of `samples` mono samples (after truncation to [`MAX_SAMPLES`]).
    pub fn num_frames(&self, samples: usize) -> usize {
        let n = samples.min(MAX_SAMPLES) + self.frame_length / 2;
        if n < self.frame_length + 1 {
            0
        } else {
            (n - self.frame_length - 1) / self.hop_length + 1
        }
    }

    /// Log-mel features `[frames, feature_size]` (f32) of mono PCM at the extractor's sampling
    /// rate, in `[-1, 1]`.
    pub fn extract(&self, samples: &[f32]) -> Result<Array> {
        let samples = &samples[..samples.len().min(MAX_SAMPLES)];
        let frames = self.num_frames(samples.len());
        if frames == 0 {
            return Err(ModelError::InvalidInput(format!("audio of {} samples is shorter than one {}-sample frame", samples.len(), self.frame_length + 1)));
        }
        let (fl, pad) = (self.frame_length, self.frame_length / 2);
        let scale = self.cfg.input_scale_factor;
        let wave: Vec<f32> = std::iter::repeat_n(0.0, pad).chain(samples.iter().map(|s| if scale != 1.0 { s * scale } else { *s })).collect();
        let (bins, nm) = (self.fft_length / 2 + 1, self.cfg.feature_size);
        let p = self.cfg.preemphasis;
        let mut out = Vec::with_capacity(frames * nm);
        let mut frame = vec![0f32; fl];
        let (mut re, mut im) = (vec![0f64; self.fft_length], vec![0f64; self.fft_length]);
        let mut mag = vec![0f64; bins];
        for t in 0..frames {
            let x = &wave[t * self.hop_length..t * self.hop_length + fl + 1];
            if p > 0.0 {
                if self.cfg.preemphasis_htk_flavor {
                    frame[0] = x[0] * (1.0 - p);
                    for j in 1..fl {
                        frame[j] = x[j] - p * x[j - 1];
                    }
                } else {
                    for j in 0..fl {
                        frame[j] = x[j + 1] - p * x[j];
                    }
                }
            } else {
                frame.copy_from_slice(&x[..fl]);
            }
            re.iter_mut().for_each(|v| *v = 0.0);
            im.iter_mut().for_each(|v| *v = 0.0);
            for j in 0..fl {
                re[j] = (frame[j] * self.window[j]) as f64;
            }
            fft(&mut re, &mut im);
            for (k, m) in mag.iter_mut().enumerate() {
                *m = (re[k] * re[k] + im[k] * im[k]).sqrt();
            }
            for m in 0..nm {
                let mut s = 0.0;
                for (k, mk) in mag.iter().enumerate() {
                    s += mk * self.mel[k][m];
                }
                let mut v = (s + self.cfg.mel_floor).ln();
                if let Some(mean) = &self.cfg.per_bin_mean {
                    v -= mean[m];
                }
                if let Some(sd) = &self.cfg.per_bin_stddev {
                    v /= sd[m];
                }
                out.push(v as f32);
            }
        }
        Ok(Array::from_slice(&out, &[frames, nm])?)
    }
}

/// transformers' `mel_filter_bank(norm=None, mel_scale="htk")`: `[bins][filters]`.
fn mel_filter_bank(bins: usize, filters: usize, fmin: f64, fmax: f64, sr: usize) -> Vec<Vec<f64>> {
    let to_mel = |f: f64| 2595.0 * (1.0 + f / 700.0).log10();
    let to_hz = |m: f64| 700.0 * (10f64.powf(m / 2595.0) - 1.0);
    let linspace = |a: f64, b: f64, n: usize| -> Vec<f64> {
        let step = (b - a) / (n - 1) as f64;
        (0..n).map(|i| if i == n - 1 { b } else { a + i as f64 * step }).collect()
    };
    let hz: Vec<f64> = linspace(to_mel(fmin), to_mel(fmax), filters + 2).into_iter().map(to_hz).collect();
    let fft_freqs = linspace(0.0, (sr / 2) as f64, bins);
    fft_freqs
        .iter()
        .map(|&fq| {
            (0..filters)
                .map(|m| {
                    let down = -(hz[m] - fq) / (hz[m + 1] - hz[m]);
                    let up = (hz[m + 2] - fq) / (hz[m + 2] - hz[m + 1]);
                    down.min(up).max(0.0)
                })
                .collect()
        })
        .collect()
}

/// In-place iterative radix-2 FFT (`re.len()` a power of two).
fn fft(re: &mut [f64], im: &mut [f64]) {
    let n = re.len();
    let mut j = 0;
    for i in 1..n {
        let mut bit = n >> 1;
        while j & bit != 0 {
            j ^= bit;
            bit >>= 1;
        }
        j |= bit;
        if i < j {
            re.swap(i, j);
            im.swap(i, j);
        }
    }
    let mut len = 2;
    while len <= n {
        let ang = -2.0 * std::f64::consts::PI / len as f64;
        for start in (0..n).step_by(len) {
            for k in 0..len / 2 {
                let (s, c) = (ang * k as f64).sin_cos();
                let (a, b) = (start + k, start + k + len / 2);
                let (tr, ti) = (re[b] * c - im[b] * s, re[b] * s + im[b] * c);
                re[b] = re[a] - tr;
                im[b] = im[a] - ti;
                re[a] += tr;
                im[a] += ti;
            }
        }
        len <<= 1;
    }
}

/// One 3x3 stride-2 convolution (padding 1, no bias), LayerNorm over channels (no bias), ReLU.
struct SubsampleLayer {
    /// `[9 * C_in, C_out]`, rows ordered (kernel row, kernel column, input channel).
    w: Array,
    norm: Array,
    eps: f32,
}

impl SubsampleLayer {
    fn load(vb: &Vb, cin: usize, cout: usize, eps: f32) -> Result<Self> {
        let w = vb.get("conv.weight", &[cout, cin, 3, 3])?.transpose(&[2, 3, 1, 0])?.reshape(&[(9 * cin) as i32, cout as i32])?;
        Ok(SubsampleLayer { w, norm: vb.get("norm.weight", &[cout])?, eps })
    }

    /// `x`: `[1, T, F, C_in]` → `[1, ceil(T/2), ceil(F/2), C_out]`.
    fn forward(&self, x: &Array) -> Result<Array> {
        let s = x.shape();
        let (t, f, c) = (s[1], s[2], s[3]);
        let (to, fo) = ((t - 1) / 2 + 1, (f - 1) / 2 + 1);
        let xp = x.pad(&[(0, 0), (1, 1), (1, 1), (0, 0)], 0.0)?;
        let mut cols = Vec::with_capacity(9);
        for di in 0..3 {
            for dj in 0..3 {
                cols.push(xp.slice(&[0, di, dj, 0], &[1, di + 2 * (to - 1) + 1, dj + 2 * (fo - 1) + 1, c], &[1, 2, 2, 1])?);
            }
        }
        let cols = ops::concatenate(&cols.iter().collect::<Vec<_>>(), -1)?;
        let y = cols.matmul(&self.w)?.layer_norm(Some(&self.norm), None, self.eps)?;
        Ok(y.maximum(&Array::scalar_as(0.0, y.dtype())?)?)
    }
}

struct FeedForward {
    l1: ClipLinear,
    l2: ClipLinear,
    pre: RmsNorm,
    post: RmsNorm,
}

struct AudioAttn {
    q: ClipLinear,
    k: ClipLinear,
    v: ClipLinear,
    post: ClipLinear,
    /// Relative position keys `[H, D, R]` (`relative_k_proj` of the sinusoidal table).
    rel_k: Array,
    /// `head_dim^-0.5 / ln 2 * softplus(per_dim_scale)`, `[D]`.
    q_scale: Array,
    heads: usize,
    head_dim: usize,
}

struct LightConv {
    start: ClipLinear,
    end: ClipLinear,
    /// Depthwise causal kernel `[H, K, 1]` (MLX layout).
    conv: Array,
    pre: RmsNorm,
    norm: RmsNorm,
}

struct AudioLayer {
    ff1: FeedForward,
    ff2: FeedForward,
    attn: AudioAttn,
    lconv: LightConv,
    norm_pre_attn: RmsNorm,
    norm_post_attn: RmsNorm,
    norm_out: RmsNorm,
}

/// transformers' fixed 1e-6 of the conformer norms built without the config's epsilon.
const NORM_EPS: f32 = 1e-6;

/// Index and masks of the windowed attention over `t` positions: for each (query, key) the
/// relative-position column, whether that column exists, and whether the key is attended.
struct Window {
    rel_idx: Array,
    rel_ok: Array,
    attend: Array,
}

impl Window {
    fn new(cfg: &Gemma4AudioConfig, t: usize) -> Result<Self> {
        let (p, r, rp) = (cfg.past() as i64, cfg.attention_context_right as i64, cfg.rel_positions() as i64);
        let (mut idx, mut ok, mut att) = (Vec::with_capacity(t * t), Vec::with_capacity(t * t), Vec::with_capacity(t * t));
        for i in 0..t as i64 {
            for j in 0..t as i64 {
                let rel = p + j - i;
                idx.push(rel.clamp(0, rp - 1) as i32);
                ok.push((0..rp).contains(&rel));
                let d = i - j;
                att.push((0..p).contains(&d) || (d < 0 && -d < r));
            }
        }
        Ok(Window { rel_idx: Array::from_slice(&idx, &[1, t, t])?, rel_ok: Array::from_slice(&ok, &[1, t, t])?, attend: Array::from_slice(&att, &[1, t, t])? })
    }
}

impl AudioAttn {
    fn forward(&self, x: &Array, win: &Window, cap: f32, invalid: f32) -> Result<Array> {
        let t = x.dim(1)? as i32;
        let (h, d) = (self.heads as i32, self.head_dim as i32);
        let heads = |a: Array| a.astype(DType::F32)?.reshape(&[t, h, d])?.transpose(&[1, 0, 2]);
        let q = heads(self.q.forward(x)?)?.mul(&self.q_scale)?;
        let k = heads(self.k.forward(x)?)?.mul_scalar((1.0 + std::f32::consts::E).ln() / std::f32::consts::LN_2)?;
        let v = heads(self.v.forward(x)?)?;
        let ac = q.matmul(&k.swap_axes(1, 2)?)?;
        let bd = q.matmul(&self.rel_k)?;
        let bd = bd.take_along_axis(&win.rel_idx.broadcast_to(&[h as usize, t as usize, t as usize])?, 2)?;
        let bd = ops::where_(&win.rel_ok, &bd, &Array::scalar_as(0.0, DType::F32)?)?;
        let logits = ac.add(&bd)?.softcap(cap)?;
        let logits = ops::where_(&win.attend, &logits, &Array::scalar_as(invalid, DType::F32)?)?;
        let o = logits.softmax(-1, true)?.matmul(&v)?.transpose(&[1, 0, 2])?.reshape(&[1, t, h * d])?;
        self.post.forward(&o.astype(x.dtype())?)
    }
}

/// The audio encoder with its `embed_audio` projection.
pub struct Gemma4AudioTower {
    cfg: Gemma4AudioConfig,
    sub0: SubsampleLayer,
    sub1: SubsampleLayer,
    input_proj: Linear,
    layers: Vec<AudioLayer>,
    output_proj: Linear,
    embed: MediaEmbedder,
    act: Activation,
    feature_size: usize,
}

/// Sinusoidal relative positions `[R, hidden]`: `[sin, cos]` of `(R - 1 - r) * inv_timescale`.
fn rel_position_table(cfg: &Gemma4AudioConfig) -> Result<Array> {
    let (h, r) = (cfg.hidden_size, cfg.rel_positions());
    let nt = h / 2;
    let inc = (10_000f64.ln() / (nt.max(2) - 1) as f64) as f32;
    let inv: Vec<f32> = (0..nt).map(|t| (t as f32 * -inc).exp()).collect();
    let mut v = Vec::with_capacity(r * h);
    for i in 0..r {
        let pos = (r - 1 - i) as f32;
        v.extend(inv.iter().map(|x| (pos * x).sin()));
        v.extend(inv.iter().map(|x| (pos * x).cos()));
    }
    Ok(Array::from_slice(&v, &[r, h])?)
}

impl Gemma4AudioTower {
    /// `tower`: the `audio_tower` tensors; `embed`: the `embed_audio` tensors; `feature_size`:
    /// mel bins of the features it takes.
    pub fn load(tower: &Vb, embed: &Vb, cfg: Gemma4AudioConfig, feature_size: usize, text_hidden: usize) -> Result<Self> {
        cfg.validate().map_err(ModelError::InvalidInput)?;
        let (h, nh, clip, eps) = (cfg.hidden_size, cfg.num_attention_heads, cfg.use_clipped_linears, cfg.rms_norm_eps);
        let d = h / nh;
        let (c0, c1) = (cfg.subsampling_conv_channels[0], cfg.subsampling_conv_channels[1]);
        let sp = tower.pp("subsample_conv_projection");
        let f2 = ((feature_size - 1) / 2) / 2 + 1;
        let table = rel_position_table(&cfg)?;
        let ff = |vb: Vb| -> Result<FeedForward> {
            Ok(FeedForward {
                l1: ClipLinear::load(&vb.pp("ffw_layer_1"), clip, h, 4 * h)?,
                l2: ClipLinear::load(&vb.pp("ffw_layer_2"), clip, 4 * h, h)?,
                pre: RmsNorm::load(&vb.pp("pre_layer_norm"), h, NORM_EPS, 0.0)?,
                post: RmsNorm::load(&vb.pp("post_layer_norm"), h, NORM_EPS, 0.0)?,
            })
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let vb = tower.pp("layers").pp(i);
                let a = vb.pp("self_attn");
                let pds = a.get("per_dim_scale", &[d])?;
                let rel_k = Linear::load(&a.pp("relative_k_proj"), h, h, false)?.forward(&table.astype(pds.dtype())?)?;
                let rel_k = rel_k.astype(DType::F32)?.reshape(&[-1, nh as i32, d as i32])?.transpose(&[1, 2, 0])?;
                let pds: Vec<f32> = pds.astype(DType::F32)?.to_vec()?;
                let base = (d as f32).powf(-0.5) / std::f32::consts::LN_2;
                let qs: Vec<f32> = pds.iter().map(|&x| base * if x > 20.0 { x } else { x.exp().ln_1p() }).collect();
                let lc = vb.pp("lconv1d");
                let k = cfg.conv_kernel_size;
                Ok(AudioLayer {
                    ff1: ff(vb.pp("feed_forward1"))?,
                    ff2: ff(vb.pp("feed_forward2"))?,
                    attn: AudioAttn {
                        q: ClipLinear::load(&a.pp("q_proj"), clip, h, h)?,
                        k: ClipLinear::load(&a.pp("k_proj"), clip, h, h)?,
                        v: ClipLinear::load(&a.pp("v_proj"), clip, h, h)?,
                        post: ClipLinear::load(&a.pp("post"), clip, h, h)?,
                        rel_k,
                        q_scale: Array::from_slice(&qs, &[d])?,
                        heads: nh,
                        head_dim: d,
                    },
                    lconv: LightConv {
                        start: ClipLinear::load(&lc.pp("linear_start"), clip, h, 2 * h)?,
                        end: ClipLinear::load(&lc.pp("linear_end"), clip, h, h)?,
                        conv: lc.get("depthwise_conv1d.weight", &[h, 1, k])?.transpose(&[0, 2, 1])?,
                        pre: RmsNorm::load(&lc.pp("pre_layer_norm"), h, eps, 0.0)?,
                        norm: RmsNorm::load(&lc.pp("conv_norm"), h, eps, 0.0)?,
                    },
                    norm_pre_attn: RmsNorm::load(&vb.pp("norm_pre_attn"), h, NORM_EPS, 0.0)?,
                    norm_post_attn: RmsNorm::load(&vb.pp("norm_post_attn"), h, NORM_EPS, 0.0)?,
                    norm_out: RmsNorm::load(&vb.pp("norm_out"), h, NORM_EPS, 0.0)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Gemma4AudioTower {
            sub0: SubsampleLayer::load(&sp.pp("layer0"), 1, c0, eps)?,
            sub1: SubsampleLayer::load(&sp.pp("layer1"), c0, c1, eps)?,
            input_proj: Linear::load(&sp.pp("input_proj_linear"), f2 * c1, h, false)?,
            layers,
            output_proj: Linear::load(&tower.pp("output_proj"), h, cfg.output_proj_dims, true)?,
            embed: MediaEmbedder::load(embed, cfg.output_proj_dims, text_hidden, eps)?,
            act: Activation::parse(&cfg.hidden_act).expect("validated"),
            feature_size,
            cfg,
        })
    }

    pub fn config(&self) -> &Gemma4AudioConfig {
        &self.cfg
    }

    /// Soft tokens of `frames` mel frames (two stride-2 subsamplings).
    pub fn num_tokens(frames: usize) -> usize {
        let half = |t: usize| if t == 0 { 0 } else { (t - 1) / 2 + 1 };
        half(half(frames))
    }

    fn clip(&self, x: &Array) -> Result<Array> {
        let g = self.cfg.gradient_clipping.min(f32::MAX);
        Ok(x.clip(-g, g)?)
    }

    fn feed_forward(&self, f: &FeedForward, x: &Array) -> Result<Array> {
        let h = f.pre.forward(&self.clip(x)?)?;
        let h = f.l2.forward(&self.act.apply(&f.l1.forward(&h)?)?)?;
        Ok(f.post.forward(&self.clip(&h)?)?.mul_scalar(self.cfg.residual_weight)?.add(x)?)
    }

    fn light_conv(&self, c: &LightConv, x: &Array) -> Result<Array> {
        let h = c.start.forward(&c.pre.forward(x)?)?;
        let hs = self.cfg.hidden_size;
        let h = h.slice_axis(-1, 0, hs)?.mul(&h.slice_axis(-1, hs, 2 * hs)?.sigmoid()?)?;
        let h = h.conv1d_causal(&c.conv.astype(h.dtype())?, 1, hs)?;
        let h = self.act.apply(&c.norm.forward(&self.clip(&h)?)?)?;
        Ok(c.end.forward(&h)?.add(x)?)
    }

    /// The encoder's output (`Gemma4AudioModel`'s `last_hidden_state`, `[tokens,
    /// output_proj_dims]`) for log-mel `features` `[frames, feature_size]`.
    pub fn encode(&self, features: &Array) -> Result<Array> {
        if features.ndim() != 2 || features.dim(1)? != self.feature_size || features.dim(0)? == 0 {
            return Err(ModelError::InvalidInput(format!("audio features must be [frames > 0, {}], got {:?}", self.feature_size, features.shape())));
        }
        let wdt = self.output_proj_dtype();
        let x = features.astype(wdt)?.expand_dims(0)?.expand_dims(-1)?;
        let x = self.sub1.forward(&self.sub0.forward(&x)?)?;
        let (t, f, c) = (x.dim(1)?, x.dim(2)?, x.dim(3)?);
        let mut x = self.input_proj.forward(&x.reshape(&[1, t as i32, (f * c) as i32])?)?;
        let win = Window::new(&self.cfg, t)?;
        let (cap, invalid) = (self.cfg.attention_logit_cap, self.cfg.attention_invalid_logits_value);
        for l in &self.layers {
            x = self.feed_forward(&l.ff1, &x)?;
            let a = l.attn.forward(&l.norm_pre_attn.forward(&self.clip(&x)?)?, &win, cap, invalid)?;
            x = l.norm_post_attn.forward(&self.clip(&a)?)?.add(&x)?;
            x = self.light_conv(&l.lconv, &x)?;
            x = self.feed_forward(&l.ff2, &x)?;
            x = l.norm_out.forward(&self.clip(&x)?)?;
        }
        Ok(self.output_proj.forward(&x)?.squeeze(&[0])?)
    }

    fn output_proj_dtype(&self) -> DType {
        self.sub0.w.dtype()
    }

    /// The audio's soft tokens in the language model's space (`[tokens, text hidden]`).
    pub fn embed(&self, features: &Array) -> Result<Array> {
        self.embed.forward(&self.encode(features)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fft_matches_a_direct_dft() {
        let n = 16;
        let x: Vec<f64> = (0..n).map(|i| ((i * 7 % 5) as f64 - 2.0) * 0.3).collect();
        let (mut re, mut im) = (x.clone(), vec![0.0; n]);
        fft(&mut re, &mut im);
        for k in 0..n {
            let (mut r, mut i) = (0.0, 0.0);
            for (t, v) in x.iter().enumerate() {
                let a = -2.0 * std::f64::consts::PI * (k * t) as f64 / n as f64;
                r += v * a.cos();
                i += v * a.sin();
            }
            assert!((re[k] - r).abs() < 1e-12 && (im[k] - i).abs() < 1e-12, "bin {k}");
        }
    }

    #[test]
    fn frame_and_token_counts() {
        let fe = Gemma4AudioFeatureExtractor::new(Gemma4AudioFeatureConfig::default()).unwrap();
        // 1 s at 16 kHz: (16000 + 160 - 321) / 160 + 1 = 99 frames, 25 tokens
        assert_eq!(fe.num_frames(16_000), 99);
        assert_eq!(Gemma4AudioTower::num_tokens(99), 25);
        // 30 s (the cap) gives the processor's 750 tokens; longer audio is truncated
        assert_eq!(Gemma4AudioTower::num_tokens(fe.num_frames(480_000)), 750);
        assert_eq!(fe.num_frames(10 * 480_000), fe.num_frames(480_000));
        assert_eq!(fe.num_frames(160), 0);
        assert!(fe.extract(&[0.0; 100]).is_err());
        let dither = Gemma4AudioFeatureConfig { dither: 1e-4, ..Default::default() };
        assert!(Gemma4AudioFeatureExtractor::new(dither).is_err());
    }
}
