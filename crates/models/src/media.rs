//! Images and sounds in chat messages, and the hook through which a vision-language family turns
//! a prompt with media into input embeddings.
//!
//! - [`ImageInput`]: an encoded file (path or bytes, PNG or JPEG, decoded with the `image` crate)
//!   or decoded 8-bit RGB pixels; [`ImageInput::decode`] gives an [`RgbImage`].
//! - [`AudioInput`]: 16 kHz mono f32 PCM, or a WAV file (path or bytes: 8/16/24/32-bit integer
//!   or 32/64-bit float PCM at 16 kHz; several channels are averaged to mono); any other rate
//!   is an error (nothing is resampled).
//! - [`resize`]: Pillow's `Image.resize` (antialiased separable convolution, 8-bit fixed-point
//!   accumulation, clipping between the passes, Pillow 13's pass order) for the
//!   bicubic and bilinear filters, the resize the Hugging Face image processors run on PIL
//!   images.
//! - [`MediaModel`]: what a vision-language family implements. The chat template writes one
//!   placeholder token per image (or clip); [`MediaModel::prepare`] preprocesses an item and says
//!   how many tokens it becomes, [`MediaModel::expand`] rewrites the placeholders of a tokenized
//!   prompt into those tokens, [`MediaModel::embed`] builds the input embeddings (tower outputs
//!   merged at the media tokens) and positions of a prompt piece, and
//!   [`MediaModel::forward_embedded`] runs the language model on them.
use crate::cache::Cache;
use crate::runtime::{ForwardOutput, Logits};
use crate::{ModelError, Result};
use mlx_array::Array;
use serde::{Deserialize, Serialize};
use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Sample rate of [`AudioInput`] PCM.
pub const AUDIO_SAMPLE_RATE: u32 = 16_000;

/// Why a media item could not be read.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("cannot decode image{}: {reason}", origin(.path))]
    Image { path: Option<PathBuf>, reason: String },
    #[error("RGB image of {width}x{height} needs {expected} bytes, got {got}")]
    RgbSize { width: u32, height: u32, expected: usize, got: usize },
    #[error("invalid WAV{}: {reason}", origin(.path))]
    Wav { path: Option<PathBuf>, reason: String },
    #[error("audio must be {AUDIO_SAMPLE_RATE} Hz, got {rate} Hz (resample it first)")]
    SampleRate { rate: u32 },
    #[error("empty {0}")]
    Empty(&'static str),
}

fn origin(p: &Option<PathBuf>) -> String {
    p.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default()
}

impl From<MediaError> for ModelError {
    fn from(e: MediaError) -> Self {
        ModelError::InvalidInput(e.to_string())
    }
}

/// Decoded 8-bit RGB pixels, row-major, 3 bytes a pixel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

impl RgbImage {
    /// Checks that `data` holds `width * height` pixels and that the image is not empty.
    pub fn new(width: u32, height: u32, data: Vec<u8>) -> std::result::Result<Self, MediaError> {
        let expected = width as usize * height as usize * 3;
        if data.len() != expected {
            return Err(MediaError::RgbSize { width, height, expected, got: data.len() });
        }
        if expected == 0 {
            return Err(MediaError::Empty("image"));
        }
        Ok(RgbImage { width, height, data })
    }
    /// Channel `c` of pixel (`x`, `y`).
    pub fn at(&self, x: usize, y: usize, c: usize) -> u8 {
        self.data[(y * self.width as usize + x) * 3 + c]
    }
}

/// An image in a chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageInput {
    /// An image file (PNG or JPEG).
    Path(PathBuf),
    /// An encoded image (PNG or JPEG bytes).
    Bytes(Vec<u8>),
    /// Decoded pixels.
    Rgb(RgbImage),
}

impl ImageInput {
    pub fn path(p: impl Into<PathBuf>) -> Self {
        ImageInput::Path(p.into())
    }
    /// Decode to RGB (alpha dropped, grey expanded).
    pub fn decode(&self) -> std::result::Result<RgbImage, MediaError> {
        let (bytes, path) = match self {
            ImageInput::Rgb(img) => return RgbImage::new(img.width, img.height, img.data.clone()),
            ImageInput::Bytes(b) => (std::borrow::Cow::Borrowed(b.as_slice()), None),
            ImageInput::Path(p) => (std::borrow::Cow::Owned(read(p)?), Some(p.clone())),
        };
        let img = image::load_from_memory(&bytes).map_err(|e| MediaError::Image { path: path.clone(), reason: e.to_string() })?;
        let rgb = img.to_rgb8();
        let (w, h) = rgb.dimensions();
        RgbImage::new(w, h, rgb.into_raw()).map_err(|e| MediaError::Image { path, reason: e.to_string() })
    }
}

fn read(p: &Path) -> std::result::Result<Vec<u8>, MediaError> {
    std::fs::read(p).map_err(|source| MediaError::Io { path: p.to_path_buf(), source })
}

/// A sound in a chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AudioInput {
    /// 16 kHz mono samples in [-1, 1].
    Pcm(Vec<f32>),
    /// A WAV file.
    Wav(PathBuf),
    /// WAV bytes.
    WavBytes(Vec<u8>),
}

impl AudioInput {
    /// The 16 kHz mono samples.
    pub fn samples(&self) -> std::result::Result<Vec<f32>, MediaError> {
        let s = match self {
            AudioInput::Pcm(s) => s.clone(),
            AudioInput::Wav(p) => decode_wav(&read(p)?).map_err(|reason| MediaError::Wav { path: Some(p.clone()), reason })??,
            AudioInput::WavBytes(b) => decode_wav(b).map_err(|reason| MediaError::Wav { path: None, reason })??,
        };
        if s.is_empty() {
            return Err(MediaError::Empty("audio clip"));
        }
        Ok(s)
    }
}

/// The samples of a RIFF/WAVE file, channels averaged. Outer error: malformed file; inner:
/// a rate other than 16 kHz.
fn decode_wav(b: &[u8]) -> std::result::Result<std::result::Result<Vec<f32>, MediaError>, String> {
    if b.len() < 12 || &b[0..4] != b"RIFF" || &b[8..12] != b"WAVE" {
        return Err("not a RIFF/WAVE file".into());
    }
    let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let (mut fmt, mut data) = (None, None);
    let mut i = 12;
    while i + 8 <= b.len() {
        let (id, len) = (&b[i..i + 4], u32_at(i + 4) as usize);
        let body = i + 8;
        let end = body.checked_add(len).filter(|&e| e <= b.len()).ok_or_else(|| format!("chunk {:?} runs past the end", String::from_utf8_lossy(id)))?;
        match id {
            b"fmt " if len >= 16 => fmt = Some((u16_at(body), u16_at(body + 2), u32_at(body + 4), u16_at(body + 14), len, body)),
            b"data" => data = Some(&b[body..end]),
            _ => {}
        }
        i = end + (len & 1);
    }
    let (mut format, channels, rate, bits, len, body) = fmt.ok_or("no fmt chunk")?;
    let data = data.ok_or("no data chunk")?;
    if format == 0xFFFE && len >= 26 {
        format = u16_at(body + 24); // WAVE_FORMAT_EXTENSIBLE: the subformat's first two bytes
    }
    if channels == 0 {
        return Err("zero channels".into());
    }
    let width = bits as usize / 8;
    let sample = |s: &[u8]| -> Option<f32> {
        Some(match (format, bits) {
            (1, 8) => (s[0] as f32 - 128.0) / 128.0,
            (1, 16) => i16::from_le_bytes([s[0], s[1]]) as f32 / 32768.0,
            (1, 24) => (i32::from_le_bytes([0, s[0], s[1], s[2]]) >> 8) as f32 / 8_388_608.0,
            (1, 32) => i32::from_le_bytes([s[0], s[1], s[2], s[3]]) as f32 / 2_147_483_648.0,
            (3, 32) => f32::from_le_bytes([s[0], s[1], s[2], s[3]]),
            (3, 64) => f64::from_le_bytes(s[..8].try_into().ok()?) as f32,
            _ => return None,
        })
    };
    if width == 0 || sample(&[0; 8]).is_none() {
        return Err(format!("unsupported sample format {format} with {bits} bits (integer PCM 8/16/24/32 or float 32/64 are read)"));
    }
    if rate != AUDIO_SAMPLE_RATE {
        return Ok(Err(MediaError::SampleRate { rate }));
    }
    let frame = width * channels as usize;
    Ok(Ok(data
        .chunks_exact(frame)
        .map(|f| f.chunks_exact(width).map(|s| sample(s).unwrap_or(0.0)).sum::<f32>() / channels as f32)
        .collect()))
}

/// Pillow's resampling filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Bilinear,
    Bicubic,
}

impl Filter {
    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
        }
    }
    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bilinear => (1.0 - x).max(0.0),
            Filter::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
        }
    }
}

/// Fixed-point fraction bits of Pillow's 8-bit resampling.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Per output pixel: the first input index and the fixed-point weights (Pillow's
/// `precompute_coeffs` + `normalize_coeffs_8bpc`).
fn coefficients(in_size: usize, out_size: usize, filter: Filter) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // C's (int) truncates toward zero, as `as` does; the reciprocal multiplies as in Pillow
            let (xmin, ss) = (((center - support + 0.5) as i64).max(0) as usize, 1.0 / filterscale);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let w: Vec<f64> = (xmin..xmax).map(|x| filter.weight((x as f64 - center + 0.5) * ss)).collect();
            let total: f64 = w.iter().sum();
            let k = w
                .iter()
                .map(|&v| {
                    let v = if total != 0.0 { v / total } else { v };
                    let f = v * (1u32 << PRECISION_BITS) as f64;
                    (if f < 0.0 { f - 0.5 } else { f + 0.5 }) as i32
                })
                .collect();
            (xmin, k)
        })
        .collect()
}

fn clip8(v: i64) -> u8 {
    if v <= 0 {
        0
    } else {
        (v >> PRECISION_BITS).min(255) as u8
    }
}

/// Resize as Pillow 13's `Image.resize(size, filter)` does for an RGB image
/// (`ImagingResampleInner` over the whole image): a horizontal pass where the width changes and
/// a vertical one where the height changes, each rounded to 8 bits. The vertical pass runs first
/// when the height shrinks by more than twice as many pixels as the width does
/// (`ih - oh > 0 && ih - oh > 2 * (iw - ow)`), the horizontal one first otherwise (Pillow 12 and
/// older always run it first). The same size returns a copy.
pub fn resize(img: &RgbImage, width: u32, height: u32, filter: Filter) -> std::result::Result<RgbImage, MediaError> {
    if width == 0 || height == 0 {
        return Err(MediaError::Empty("resize target"));
    }
    let (shrink_w, shrink_h) = (img.width as i64 - width as i64, img.height as i64 - height as i64);
    let (ow, oh) = (width as usize, height as usize);
    Ok(if shrink_h > 0 && shrink_h > 2 * shrink_w {
        pass(&pass(img, oh, false, filter), ow, true, filter)
    } else {
        pass(&pass(img, ow, true, filter), oh, false, filter)
    })
}

/// One of Pillow's resampling passes: along the rows (`horizontal`) to `out` columns, or along
/// the columns to `out` rows.
fn pass(img: &RgbImage, out: usize, horizontal: bool, filter: Filter) -> RgbImage {
    let (w, h) = (img.width as usize, img.height as usize);
    let n = if horizontal { w } else { h };
    if out == n {
        return img.clone();
    }
    let k = coefficients(n, out, filter);
    let (ow, oh) = if horizontal { (out, h) } else { (w, out) };
    let mut data = vec![0u8; ow * oh * 3];
    for y in 0..oh {
        for x in 0..ow {
            let (i0, wts) = if horizontal { &k[x] } else { &k[y] };
            for c in 0..3 {
                let mut s: i64 = 1 << (PRECISION_BITS - 1);
                for (j, &wj) in wts.iter().enumerate() {
                    let v = if horizontal { img.at(i0 + j, y, c) } else { img.at(x, i0 + j, c) };
                    s += v as i64 * wj as i64;
                }
                data[(y * ow + x) * 3 + c] = clip8(s);
            }
        }
    }
    RgbImage { width: ow as u32, height: oh as u32, data }
}

/// One media item of a conversation, in template order.
#[derive(Debug, Clone, PartialEq)]
pub enum MediaItem {
    Image(ImageInput),
    Audio(AudioInput),
}

/// The kind of a media item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MediaKind {
    Image,
    Audio,
}

impl MediaItem {
    pub fn kind(&self) -> MediaKind {
        match self {
            MediaItem::Image(_) => MediaKind::Image,
            MediaItem::Audio(_) => MediaKind::Audio,
        }
    }
}

/// A media item after the family's preprocessing.
#[derive(Clone)]
pub struct PreparedMedia {
    pub kind: MediaKind,
    /// Tokens the item's placeholder expands into ([`MediaModel::expand`]).
    pub tokens: usize,
    /// A hash of the preprocessed input (a session reuses cached media tokens only when it
    /// matches).
    pub fingerprint: u64,
    /// The family's preprocessed tensors (for [`MediaModel::embed`]).
    pub data: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for PreparedMedia {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedMedia").field("kind", &self.kind).field("tokens", &self.tokens).field("fingerprint", &self.fingerprint).finish()
    }
}

/// A hash of `bytes` (for [`PreparedMedia::fingerprint`]).
pub fn fingerprint(bytes: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// The language model's input for a prompt piece with media: embeddings with the tower outputs
/// merged in, and the family's positions.
pub struct MediaEmbeddings {
    /// The (expanded) token ids of the piece, `[1, L]` (paged caches key blocks by them).
    pub ids: Array,
    /// `[1, L, hidden]`.
    pub embeds: Array,
    /// Family-defined positions (Qwen's M-RoPE: `[3, L]` i32 temporal/height/width), `None` for
    /// the usual `offset..offset + L`.
    pub positions: Option<Array>,
    /// What to add to a cache position to get the rotary position of the tokens that follow the
    /// piece (Qwen's `rope_deltas`; 0 for families without).
    pub position_delta: i64,
}

/// A vision-language family: preprocessing, placeholder expansion, embedding, and the language
/// model over embeddings. [`crate::ModelRuntime::media`] returns it.
pub trait MediaModel {
    /// The token the chat template writes once per item of `kind` (`None`: the kind is not taken).
    fn placeholder(&self, kind: MediaKind) -> Option<u32>;
    /// Decode and preprocess one item.
    fn prepare(&self, item: &MediaItem) -> Result<PreparedMedia>;
    /// Replace the placeholders of `ids` (a tokenized prompt or prompt piece) in order with the
    /// tokens of `media`; the count of placeholders must equal `media.len()`.
    fn expand(&self, ids: &[u32], media: &[PreparedMedia]) -> Result<Vec<u32>> {
        expand_placeholders(ids, media, |k| self.placeholder(k), |m| vec![self.placeholder(m.kind).unwrap_or_default(); m.tokens])
    }
    /// The input of expanded `ids` (the uncached end of a prompt, starting at `cache`'s position)
    /// whose media tokens belong to `media`, in order.
    fn embed(&self, ids: &[u32], media: &[PreparedMedia], cache: &Cache) -> Result<MediaEmbeddings>;
    /// The language model over `input`, appended to `cache` (which then keeps
    /// [`MediaEmbeddings::position_delta`] for the tokens after it).
    fn forward_embedded(&self, input: &MediaEmbeddings, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput>;
}

/// Expand each placeholder of `ids` into `tokens(item)`, taking the items of `media` in order.
pub fn expand_placeholders(
    ids: &[u32],
    media: &[PreparedMedia],
    placeholder: impl Fn(MediaKind) -> Option<u32>,
    tokens: impl Fn(&PreparedMedia) -> Vec<u32>,
) -> Result<Vec<u32>> {
    let marks: Vec<(MediaKind, u32)> = [MediaKind::Image, MediaKind::Audio].into_iter().filter_map(|k| placeholder(k).map(|p| (k, p))).collect();
    let mut out = Vec::with_capacity(ids.len() + media.iter().map(|m| m.tokens).sum::<usize>());
    let mut next = media.iter();
    let mut found = 0;
    for &id in ids {
        match marks.iter().find(|(_, p)| *p == id) {
            Some((kind, _)) => {
                found += 1;
                let m = next.next().ok_or_else(|| ModelError::InvalidInput(format!("the prompt has more media placeholders than the {} media items given", media.len())))?;
                if m.kind != *kind {
                    return Err(ModelError::InvalidInput(format!("media placeholder {found} is for {kind:?} but item {found} is {:?}", m.kind)));
                }
                out.extend(tokens(m));
            }
            None => out.push(id),
        }
    }
    if found != media.len() {
        return Err(ModelError::InvalidInput(format!(
            "the prompt has {found} media placeholders for {} media items (a chat template that writes something else for a media part, a text marker such as `<image>`, needs the placeholder token's text in the message content)",
            media.len()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wav_reads_16_bit_stereo_and_refuses_other_rates() {
        let wav = |rate: u32, samples: &[i16], channels: u16| {
            let data: Vec<u8> = samples.iter().flat_map(|s| s.to_le_bytes()).collect();
            let mut b = b"RIFF".to_vec();
            b.extend(((36 + data.len()) as u32).to_le_bytes());
            b.extend(b"WAVEfmt ");
            b.extend(16u32.to_le_bytes());
            b.extend(1u16.to_le_bytes());
            b.extend(channels.to_le_bytes());
            b.extend(rate.to_le_bytes());
            b.extend((rate * 2 * channels as u32).to_le_bytes());
            b.extend((2 * channels).to_le_bytes());
            b.extend(16u16.to_le_bytes());
            b.extend(b"data");
            b.extend((data.len() as u32).to_le_bytes());
            b.extend(data);
            b
        };
        let s = AudioInput::WavBytes(wav(16000, &[16384, 0, -32768, -16384], 2)).samples().unwrap();
        assert_eq!(s, vec![0.25, -0.75]);
        assert!(matches!(AudioInput::WavBytes(wav(44100, &[1, 2], 1)).samples(), Err(MediaError::SampleRate { rate: 44100 })));
        assert!(matches!(AudioInput::WavBytes(b"RIFF0000WAVX".to_vec()).samples(), Err(MediaError::Wav { .. })));
        assert!(matches!(AudioInput::Pcm(vec![]).samples(), Err(MediaError::Empty(_))));
    }

    #[test]
    fn rgb_size_is_checked_and_same_size_resize_is_a_copy() {
        assert!(matches!(RgbImage::new(2, 2, vec![0; 11]), Err(MediaError::RgbSize { expected: 12, .. })));
        let img = RgbImage::new(3, 2, (0..18).collect()).unwrap();
        assert_eq!(resize(&img, 3, 2, Filter::Bicubic).unwrap(), img);
        // a constant image stays constant through both passes (weights sum to one)
        let flat = RgbImage::new(5, 7, vec![77; 105]).unwrap();
        let r = resize(&flat, 3, 11, Filter::Bicubic).unwrap();
        assert!(r.data.iter().all(|&v| v == 77), "{:?}", r.data);
    }

    #[test]
    fn placeholders_expand_in_order_and_counts_must_match() {
        let item = |kind, tokens| PreparedMedia { kind, tokens, fingerprint: 0, data: Arc::new(()) };
        let ph = |k| match k {
            MediaKind::Image => Some(9),
            MediaKind::Audio => Some(8),
        };
        let media = [item(MediaKind::Image, 2), item(MediaKind::Audio, 3)];
        let out = expand_placeholders(&[1, 9, 2, 8], &media, ph, |m| vec![if m.kind == MediaKind::Image { 9 } else { 8 }; m.tokens]).unwrap();
        assert_eq!(out, vec![1, 9, 9, 2, 8, 8, 8]);
        assert!(expand_placeholders(&[1, 9], &media, ph, |_| vec![]).is_err());
        assert!(expand_placeholders(&[8, 9], &media, ph, |_| vec![]).is_err());
    }
}
