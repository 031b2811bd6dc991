//! Neural-network kernels: norms, rotary embeddings, attention, convolution.
use crate::error::{Error, OpExt, Result};
use crate::ops::where_;
use crate::{Array, DType};
use mlx_rs::fast;

/// The mask of [`Array::sdpa`].
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    /// Every query sees every key.
    None,
    /// Query `i` of `L` sees keys `0..=K-L+i` (queries are the last `L` of `K` positions).
    Causal,
    /// Causal, and query at position `p` sees only keys in `p-window+1..=p`.
    SlidingWindow(usize),
    /// A mask broadcastable to `[B, H, L, K]`: boolean (true = attend) or additive (added to scores).
    Array(&'a Array),
}

/// Most queries of a GPU attention call computed as matrix products instead of MLX's fused
/// kernel (see [`Array::sdpa`]): verify steps, block drafts, a draft model's catching up after
/// plain decoding, short prompts. The scores of 64 queries over a 32k-token cache with 16 query
/// heads take 134 MB in f32.
pub const GPU_PRODUCT_ATTENTION_MAX_QUERIES: usize = 64;

static GPU_ATTENTION_KEY_BUCKET: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Pad the keys of [`Array::sdpa`]'s few-query attention on a GPU (the matrix products) to a
/// multiple of `bucket` keys, the padding masked out (process-wide; 0 or 1: no padding). A
/// verify step meets a new key count every cycle; padded, its products keep one shape for
/// `bucket` positions. Calls that the few-query attention kernel takes
/// ([`crate::ops::CudaFewRowKernels`]) read the keys unpadded: it has no per-shape set-up.
pub fn set_gpu_attention_key_bucket(bucket: usize) {
    GPU_ATTENTION_KEY_BUCKET.store(bucket, std::sync::atomic::Ordering::Relaxed);
}

/// The current [`set_gpu_attention_key_bucket`] setting.
pub fn gpu_attention_key_bucket() -> usize {
    GPU_ATTENTION_KEY_BUCKET.load(std::sync::atomic::Ordering::Relaxed)
}

/// Rotary position embedding settings (see [`Array::rope`]).
#[derive(Debug, Clone, Copy)]
pub struct RopeConfig<'a> {
    /// Number of leading feature dims rotated (`head_dim * partial_rotary_factor`).
    pub dims: usize,
    /// Rotate adjacent pairs (GPT-J) instead of the two halves (GPT-NeoX, Llama, Qwen).
    pub traditional: bool,
    pub base: f32,
    /// Position scale (1.0 = none).
    pub scale: f32,
    /// Explicit frequencies (`dims / 2` of them) replacing `base`, for scaled ropes. MLX's
    /// convention: these are the wavelengths `base^(2i / dims)` (the angle is `position / freqs[i]`),
    /// not inverse frequencies.
    pub freqs: Option<&'a Array>,
}

impl Default for RopeConfig<'_> {
    fn default() -> Self {
        RopeConfig { dims: 0, traditional: false, base: 10000.0, scale: 1.0, freqs: None }
    }
}

/// The C entry points' rotation arguments for `cfg` at `offset`.
fn rope_args(op: &'static str, cfg: &RopeConfig, offset: usize) -> Result<mlx_sys::MlxModelsRopeArgs> {
    let int = |v: usize, what: &str| i32::try_from(v).map_err(|_| Error::arg(op, format!("{what} {v} exceeds i32")));
    Ok(mlx_sys::MlxModelsRopeArgs { dims: int(cfg.dims, "rotary dims")?, traditional: cfg.traditional, has_base: cfg.freqs.is_none(), base: cfg.base, scale: cfg.scale, offset: int(offset, "offset")? })
}

/// An absent optional array argument of the C entry points.
fn empty() -> mlx_sys::mlx_array {
    mlx_sys::mlx_array { ctx: std::ptr::null_mut() }
}

/// While alive, [`Array::rms_norm`], [`Array::rope`], [`Array::sdpa`], [`Array::sdpa_merged`] and
/// [`heads`] build MLX's own ops on this thread instead of their single CPU primitives, as they
/// always do inside a function transform (`value_and_grad`, `vjp`, `compile`). A trainer holds one
/// around its untraced forwards (old and reference log-probabilities) so that they compute exactly
/// what its traced forward does. Scopes nest; the guard is tied to its thread.
#[must_use = "the scope ends when the guard is dropped"]
pub struct MlxOpsScope {
    _thread: std::marker::PhantomData<*const ()>,
}

/// Open an [`MlxOpsScope`] on this thread.
pub fn mlx_ops_only() -> MlxOpsScope {
    unsafe { mlx_sys::mlx_models_mlx_ops_only(true) };
    MlxOpsScope { _thread: std::marker::PhantomData }
}

impl Drop for MlxOpsScope {
    fn drop(&mut self) {
        unsafe { mlx_sys::mlx_models_mlx_ops_only(false) };
    }
}

impl Array {
    /// RMSNorm over the last axis: `x / sqrt(mean(x^2) + eps) * weight`.
    ///
    /// On a CPU stream a float input runs as one primitive (`mlx-sys`'s `cpukern/ops.cpp`)
    /// instead of the eleven ops MLX's CPU backend builds it from: the same arithmetic in f32,
    /// rounded to bf16/f16 where those ops round.
    pub fn rms_norm(&self, weight: Option<&Array>, eps: f32) -> Result<Array> {
        if let Some(w) = weight {
            // MLX's checks (the primitive's own validation falls back to MLX for anything else)
            if w.ndim() != 1 || self.ndim() == 0 || w.dims()[0] != *self.dims().last().unwrap_or(&0) {
                return fast::rms_norm(&self.inner, Some(&w.inner), eps).op("rms_norm").map(Array::wrap);
            }
        }
        let (x, w, s) = (self.inner.as_ptr(), weight.map_or_else(empty, |w| w.inner.as_ptr()), crate::ffi::stream());
        crate::ffi::call("rms_norm", |res| unsafe { mlx_sys::mlx_models_rms_norm(res, x, w, eps, s.as_ptr()) })
    }
    /// LayerNorm over the last axis.
    pub fn layer_norm(&self, weight: Option<&Array>, bias: Option<&Array>, eps: f32) -> Result<Array> {
        fast::layer_norm(&self.inner, weight.map(|w| &w.inner), bias.map(|b| &b.inner), eps)
            .op("layer_norm")
            .map(Array::wrap)
    }
    /// Rotary embedding of `[.., L, D]`; position of row `l` is `offset + l`. Only the first
    /// `cfg.dims` features rotate (partial rotary); the rest pass through.
    pub fn rope(&self, cfg: &RopeConfig, offset: usize) -> Result<Array> {
        let d = *self.dims().last().ok_or_else(|| Error::shape("rope", "0-d input"))? as usize;
        if cfg.dims == 0 || cfg.dims > d || cfg.dims % 2 != 0 {
            return Err(Error::arg("rope", format!("rotary dims {} for head dim {d}", cfg.dims)));
        }
        // one primitive for float input on a CPU stream (as rms_norm), MLX's op otherwise
        let r = rope_args("rope", cfg, offset)?;
        let (x, f, s) = (self.inner.as_ptr(), cfg.freqs.map_or_else(empty, |f| f.inner.as_ptr()), crate::ffi::stream());
        crate::ffi::call("rope", |res| unsafe { mlx_sys::mlx_models_rope(res, x, &r, f, s.as_ptr()) })
    }

    /// [`Array::rope`] with one start position per batch row: `self` is `[B, .., L, D]` and
    /// `offsets` an integer `[B]` array; row `b`'s position `l` is `offsets[b] + l`.
    pub fn rope_rows(&self, cfg: &RopeConfig, offsets: &Array) -> Result<Array> {
        let d = *self.dims().last().ok_or_else(|| Error::shape("rope", "0-d input"))? as usize;
        if cfg.dims == 0 || cfg.dims > d || cfg.dims % 2 != 0 {
            return Err(Error::arg("rope", format!("rotary dims {} for head dim {d}", cfg.dims)));
        }
        if offsets.ndim() != 1 || self.ndim() < 3 || offsets.dims()[0] != self.dims()[0] {
            return Err(Error::shape("rope", format!("offsets {:?} for input {:?}: need one per batch row", offsets.shape(), self.shape())));
        }
        let base = if cfg.freqs.is_some() { None } else { Some(cfg.base) };
        fast::rope_dynamic(&self.inner, cfg.dims as i32, cfg.traditional, base, cfg.scale, &offsets.inner, cfg.freqs.map(|f| &f.inner))
            .op("rope")
            .map(Array::wrap)
    }

    /// Scaled dot-product attention. `self` = queries `[B, Hq, L, D]`, keys/values `[B, Hkv, K, D]`
    /// with `Hq` a multiple of `Hkv` (grouped-query attention).
    ///
    /// On a GPU, 2 to [`GPU_PRODUCT_ATTENTION_MAX_QUERIES`] queries run as matrix products
    /// ([`Array::sdpa_by_products`]), or with the attention kernel on ([`crate::ops::CudaFewRowKernels`]) our few-query
    /// kernel ([`Array::cuda_few_query_attention`]) up to
    /// [`crate::ops::FEW_QUERY_ATTENTION_MAX_KEYS`] keys: the CUDA backend's fused
    /// attention for more than one query builds a cuDNN graph for every new (queries, keys)
    /// shape, about 37 ms on an H100, and a speculative verify step or a block draft meets a new
    /// key count every cycle (the products take 0.3 ms there, the kernel less, see `ops::cuda`).
    pub fn sdpa(&self, keys: &Array, values: &Array, scale: f32, mask: AttentionMask) -> Result<Array> {
        let (q, k) = (self.dims(), keys.dims());
        if q.len() != 4 || k.len() != 4 || values.ndim() != 4 {
            return Err(Error::shape("sdpa", format!("need 4-d q/k/v, got {:?} {:?} {:?}", q, k, values.dims())));
        }
        if (2..=GPU_PRODUCT_ATTENTION_MAX_QUERIES as i32).contains(&q[2]) && crate::default_device()? == crate::Device::Gpu {
            if super::cuda::few_query_kernel_applies(self, keys, values, &mask) {
                return self.cuda_few_query_attention(keys, values, scale, mask);
            }
            return self.sdpa_by_products_bucketed(keys, values, scale, mask, gpu_attention_key_bucket());
        }
        if k[1] == 0 || q[1] % k[1] != 0 {
            return Err(Error::shape("sdpa", format!("{} query heads for {} kv heads", q[1], k[1])));
        }
        use mlx_rs::fast::ScaledDotProductAttentionMask as M;
        let owned;
        let m = match mask {
            AttentionMask::None => None,
            AttentionMask::Causal => Some(M::Causal),
            AttentionMask::Array(a) => Some(M::Array(&a.inner)),
            // Every key is inside every query's window when there are at most `w` of them
            // (queries are the last positions): plain causal, or no mask for one query. No
            // mask array keeps the fused kernels (the GPU's vector kernel takes none).
            AttentionMask::SlidingWindow(w) if w > 0 && (k[2] as usize) <= w => (q[2] > 1).then_some(M::Causal),
            AttentionMask::SlidingWindow(w) => {
                owned = sliding_window_mask(q[2] as usize, k[2] as usize, w)?;
                Some(M::Array(&owned.inner))
            }
        };
        let causal = match m {
            None => false,
            Some(M::Causal) => true,
            Some(m) => return fast::scaled_dot_product_attention(&self.inner, &keys.inner, &values.inner, scale, m, None).op("sdpa").map(Array::wrap),
        };
        // few float queries on a CPU stream: one primitive (as rms_norm); MLX's op otherwise
        let (qp, kp, vp, s) = (self.inner.as_ptr(), keys.inner.as_ptr(), values.inner.as_ptr(), crate::ffi::stream());
        crate::ffi::call("sdpa", |res| unsafe { mlx_sys::mlx_models_sdpa(res, qp, kp, vp, scale, causal, false, s.as_ptr()) })
    }

    /// The nucleus (top-p) filter of logits `[B, V]`, `0 < p < 1`: per row, entries below the
    /// least likely of the smallest most-likely set whose probability mass reaches `p` become
    /// `-inf` (entries tied with it are kept; no normalisation of the input needed). mlx-lm's
    /// `apply_top_p`. On a CPU stream with f32 logits one primitive that finds that set without
    /// sorting the row (MLX's CPU sort of 151936 logits takes ~13 ms); elsewhere MLX's ops.
    pub fn nucleus(&self, p: f32) -> Result<Array> {
        if self.ndim() != 2 || self.dims()[1] < 1 {
            return Err(Error::shape("nucleus", format!("logits must be [B, V] with V >= 1, got {:?}", self.shape())));
        }
        if !(p > 0.0 && p < 1.0) {
            return Err(Error::arg("nucleus", format!("p {p} outside (0, 1)")));
        }
        let (xp, s) = (self.inner.as_ptr(), crate::ffi::stream());
        crate::ffi::call("nucleus", |res| unsafe { mlx_sys::mlx_models_nucleus(res, xp, p, s.as_ptr()) })
    }

    /// Per row of logits `[B, V]`: the first index of the largest value (u32 `[B]`) and its
    /// log-probability `x[t] - logsumexp(x)` (`[B]`, the logits' dtype), i.e. a greedy token and
    /// its log-prob under the softmax. On a CPU stream with f32 logits one primitive (one pass
    /// for the maximum, one vectorised pass of exp; MLX's CPU exp runs element by element
    /// through libm, ~0.75 ms for 49152 logits); elsewhere `argmax`, `take_along_axis` and
    /// `logsumexp` (the same values up to the rounding of the exp sum).
    pub fn greedy_pick(&self) -> Result<(Array, Array)> {
        if self.ndim() != 2 || self.dims()[1] < 1 {
            return Err(Error::shape("greedy_pick", format!("logits must be [B, V] with V >= 1, got {:?}", self.shape())));
        }
        let (xp, s) = (self.inner.as_ptr(), crate::ffi::stream());
        let [t, lp] = crate::ffi::call_n::<2>("greedy_pick", |r| {
            let [r0, r1] = r;
            unsafe { mlx_sys::mlx_models_greedy(r0, r1, xp, s.as_ptr()) }
        })?;
        Ok((t, lp))
    }

    /// [`Array::sdpa`] computed as matrix products (what MLX's own fallback runs): queries scaled,
    /// scores `q kᵀ` per key-value head group, the mask applied, a softmax in f32, then the
    /// weighted sum of the values. Same arguments and result as [`Array::sdpa`].
    ///
    /// For a few queries over a growing cache on the CUDA backend: its fused attention for more
    /// than one query builds a cuDNN graph per (queries, keys) shape, so a step whose key count
    /// is new each time (speculative verification) pays that build in every layer.
    pub fn sdpa_by_products(&self, keys: &Array, values: &Array, scale: f32, mask: AttentionMask) -> Result<Array> {
        self.sdpa_by_products_bucketed(keys, values, scale, mask, 0)
    }

    /// [`Array::sdpa_by_products`] with the keys and values padded by zeros to a multiple of
    /// `bucket` keys (0 or 1: none) and the padding masked out, so that the products keep one
    /// shape while the key count grows within a bucket. A mask array is not padded: with one
    /// the keys are not either. The result equals the unpadded one up to the products' rounding.
    pub fn sdpa_by_products_bucketed(&self, keys: &Array, values: &Array, scale: f32, mask: AttentionMask, bucket: usize) -> Result<Array> {
        let (q, k, vd) = (self.dims(), keys.dims(), values.dims());
        if q.len() != 4 || k.len() != 4 || vd.len() != 4 {
            return Err(Error::shape("sdpa", format!("need 4-d q/k/v, got {q:?} {k:?} {vd:?}")));
        }
        if k[1] == 0 || q[1] % k[1] != 0 || vd[1] != k[1] || vd[2] != k[2] || k[3] != q[3] || k[0] != q[0] || vd[0] != q[0] {
            return Err(Error::shape("sdpa", format!("queries {q:?} against keys {k:?} and values {vd:?}")));
        }
        let (b, hq, l, d) = (q[0], q[1], q[2], q[3]);
        let (hkv, kn, dv) = (k[1], k[2], vd[3]);
        let rep = hq / hkv;
        if l > kn && !matches!(mask, AttentionMask::None | AttentionMask::Array(_)) {
            return Err(Error::shape("sdpa", format!("{l} queries after {kn} keys under a causal mask")));
        }
        if let AttentionMask::SlidingWindow(0) = mask {
            return Err(Error::arg("sdpa", "a sliding window of 0 keys"));
        }
        // keys padded to `kp` (masked below): queries are still the last `l` of the `kn` real keys
        let kp = match bucket {
            b if b > 1 && !matches!(mask, AttentionMask::Array(_)) => (kn as usize).div_ceil(b) * b,
            _ => kn as usize,
        } as i32;
        let padded;
        let (keys, values) = if kp > kn {
            let w = [(0, 0), (0, 0), (0, (kp - kn) as usize), (0, 0)];
            padded = (keys.pad(&w, 0.0)?, values.pad(&w, 0.0)?);
            (&padded.0, &padded.1)
        } else {
            (keys, values)
        };
        // [B, Hkv, rep * L, D]: the query heads of one key-value head are consecutive
        let qs = self.mul_scalar(scale)?.reshape(&[b, hkv, rep * l, d])?;
        let scores = qs.matmul(&keys.transpose(&[0, 1, 3, 2])?)?;
        // the masks we make are additive (0 or -inf), in the scores' dtype and shape, and depend
        // on the shapes only: every layer of a forward (and the next forward of the same
        // length) reuses the first's ([`position_mask`]), and applying one is a single add
        let key = MaskKey { b, hkv, rep, l, kn, kp, causal: false, window: 0, dtype: scores.dtype() };
        let made = match mask {
            AttentionMask::None if kp == kn => None,
            AttentionMask::None => Some(position_mask(key, || Array::arange(0, kp as i64, DType::I32)?.lt(&Array::scalar(kn))?.reshape(&[1, kp]))?),
            // padded keys lie after every query's position
            AttentionMask::Causal => Some(position_mask(MaskKey { causal: true, ..key }, || {
                let qpos = Array::arange((kn - l) as i64, kn as i64, DType::I32)?.reshape(&[l, 1])?;
                let kpos = Array::arange(0, kp as i64, DType::I32)?.reshape(&[1, kp])?;
                kpos.le(&qpos)
            })?),
            AttentionMask::SlidingWindow(w) => Some(position_mask(MaskKey { causal: true, window: w, ..key }, || padded_sliding_window_mask(l as usize, kn as usize, kp as usize, w))?),
            AttentionMask::Array(_) => None,
        };
        let p = match mask {
            AttentionMask::Array(m) => {
                // a mask over [B, Hq, L, K] (or a broadcastable shape) as [B, Hkv, rep, L, K]
                let grouped = |m: &Array| -> Result<Array> {
                    let m = match m.ndim() {
                        0..=2 => return Ok(m.clone()),
                        3 => m.expand_dims(0)?,
                        4 => m.clone(),
                        n => return Err(Error::shape("sdpa", format!("a {n}-d mask"))),
                    };
                    let md = m.dims();
                    if md[1] == hq && hq > 1 {
                        m.reshape(&[md[0], hkv, rep, md[2], md[3]])
                    } else if md[1] == 1 {
                        m.expand_dims(2)
                    } else {
                        Err(Error::shape("sdpa", format!("mask {md:?} for {hq} query heads")))
                    }
                };
                let scores = scores.reshape(&[b, hkv, rep, l, kp])?;
                let scores = match m.dtype() {
                    DType::Bool => where_(&grouped(m)?, &scores, &Array::scalar_as(f32::NEG_INFINITY, scores.dtype())?)?,
                    _ => scores.add(&grouped(m)?)?,
                };
                scores.softmax(-1, true)?.reshape(&[b, hkv, rep * l, kp])?
            }
            _ => match made {
                Some(m) => scores.add(&m)?,
                None => scores,
            }
            .softmax(-1, true)?,
        };
        p.matmul(values)?.reshape(&[b, hq, l, dv])
    }

    /// [`Array::sdpa`] with the output's heads joined: `[B, L, Hq * D]` (what attention's output
    /// projection reads), in the same single primitive on the CPU for no mask or a causal one.
    pub fn sdpa_merged(&self, keys: &Array, values: &Array, scale: f32, mask: AttentionMask) -> Result<Array> {
        let causal = match mask {
            AttentionMask::None => false,
            AttentionMask::Causal if self.ndim() == 4 && self.dims()[2] > 1 => true,
            AttentionMask::Causal => false, // one query sees every key
            _ => {
                let o = self.sdpa(keys, values, scale, mask)?;
                let d = o.dims();
                return o.transpose(&[0, 2, 1, 3])?.reshape(&[d[0], d[2], d[1] * d[3]]);
            }
        };
        let (q, k) = (self.dims(), keys.dims());
        if q.len() != 4 || k.len() != 4 || values.ndim() != 4 || k[1] == 0 || q[1] % k[1] != 0 {
            return self.sdpa(keys, values, scale, mask); // its shape errors
        }
        let (qp, kp, vp, s) = (self.inner.as_ptr(), keys.inner.as_ptr(), values.inner.as_ptr(), crate::ffi::stream());
        crate::ffi::call("sdpa", |res| unsafe { mlx_sys::mlx_models_sdpa(res, qp, kp, vp, scale, causal, true, s.as_ptr()) })
    }

    /// 1-d convolution. Input `[N, L, C_in]`, weight `[C_out, K, C_in / groups]` (MLX layout).
    pub fn conv1d(&self, weight: &Array, stride: usize, padding: usize, dilation: usize, groups: usize) -> Result<Array> {
        if groups == 0 || stride == 0 || dilation == 0 {
            return Err(Error::arg("conv1d", "stride, dilation and groups must be positive"));
        }
        mlx_rs::ops::conv1d(&self.inner, &weight.inner, stride as i32, padding as i32, dilation as i32, groups as i32)
            .op("conv1d")
            .map(Array::wrap)
    }

    /// 2-d convolution. Input `[N, H, W, C_in]`, weight `[C_out, KH, KW, C_in / groups]` (MLX
    /// layout); `stride`, `padding` (zeros on both sides) and `dilation` are `(h, w)`.
    ///
    /// The padding is a separate [`Array::pad`]: MLX 0.32.2's CPU convolution corrupts the heap
    /// when it pads itself and the dilation exceeds the input's height or width (a 3x3 kernel of
    /// dilation 8 over a 7x5 map, padded by 8, aborts in `free`). A dilated convolution without
    /// groups runs as one matrix product over the `KH * KW` shifted views of the input (im2col):
    /// MLX's CPU kernel for dilation loops per element, about 3x slower.
    pub fn conv2d(&self, weight: &Array, stride: (usize, usize), padding: (usize, usize), dilation: (usize, usize), groups: usize) -> Result<Array> {
        if groups == 0 || stride.0 == 0 || stride.1 == 0 || dilation.0 == 0 || dilation.1 == 0 {
            return Err(Error::arg("conv2d", "stride, dilation and groups must be positive"));
        }
        if self.ndim() != 4 {
            return Err(Error::shape("conv2d", format!("need an [N, H, W, C] input, got {:?}", self.shape())));
        }
        let padded;
        let x = if padding == (0, 0) {
            self
        } else {
            padded = self.pad(&[(0, 0), (padding.0, padding.0), (padding.1, padding.1), (0, 0)], 0.0)?;
            &padded
        };
        if dilation != (1, 1) && groups == 1 {
            return x.conv2d_im2col(weight, stride, dilation);
        }
        let p = |(a, b): (usize, usize)| (a as i32, b as i32);
        mlx_rs::ops::conv2d(&x.inner, &weight.inner, p(stride), (0, 0), p(dilation), groups as i32)
            .op("conv2d")
            .map(Array::wrap)
    }

    /// [`Array::conv2d`] of an already padded input, without groups, as one matrix product:
    /// the `KH * KW` strided views of `self` concatenated on channels times the weight flattened
    /// to `[KH * KW * C_in, C_out]` (MLX's layout is already tap-major).
    fn conv2d_im2col(&self, weight: &Array, stride: (usize, usize), dilation: (usize, usize)) -> Result<Array> {
        let (x, w) = (self.shape(), weight.shape());
        if w.len() != 4 || w[3] != x[3] {
            return Err(Error::shape("conv2d", format!("weight {w:?} does not fit input {x:?}")));
        }
        let (n, c, o, kh, kw) = (x[0], x[3], w[0], w[1], w[2]);
        let span = |k: usize, d: usize| d * (k.max(1) - 1) + 1;
        let (sh, sw) = (span(kh, dilation.0), span(kw, dilation.1));
        if x[1] < sh || x[2] < sw || kh == 0 || kw == 0 {
            return Err(Error::shape("conv2d", format!("kernel of {sh}x{sw} (dilated) is larger than the padded input {x:?}")));
        }
        let (oh, ow) = ((x[1] - sh) / stride.0 + 1, (x[2] - sw) / stride.1 + 1);
        let mut views = Vec::with_capacity(kh * kw);
        for i in 0..kh {
            for j in 0..kw {
                let (y0, x0) = (i * dilation.0, j * dilation.1);
                let stop = [n, y0 + (oh - 1) * stride.0 + 1, x0 + (ow - 1) * stride.1 + 1, c];
                views.push(self.slice(&[0, y0, x0, 0], &stop, &[1, stride.0, stride.1, 1])?);
            }
        }
        let cols = super::concatenate(&views.iter().collect::<Vec<_>>(), 3)?;
        let k = (kh * kw * c) as i32;
        let y = cols.reshape(&[-1, k])?.matmul(&weight.reshape(&[o as i32, k])?.transpose(&[1, 0])?)?;
        y.reshape(&[n as i32, oh as i32, ow as i32, o as i32])
    }

    /// Causal 1-d convolution (stride 1): the input `[N, L, C_in]` is padded on the left with
    /// `dilation * (K - 1)` zeros, so output `t` sees inputs `..=t` only and has length `L`.
    /// With `groups == C_in == C_out` and weight `[C, K, 1]` this is the depthwise short
    /// convolution of LFM2 and GatedDeltaNet.
    pub fn conv1d_causal(&self, weight: &Array, dilation: usize, groups: usize) -> Result<Array> {
        if self.ndim() != 3 || weight.ndim() != 3 {
            return Err(Error::shape("conv1d_causal", format!("need [N, L, C] input and [C_out, K, C_in/groups] weight, got {:?} and {:?}", self.shape(), weight.shape())));
        }
        let k = weight.dims()[1] as usize;
        let left = dilation.max(1) * k.saturating_sub(1);
        self.pad(&[(0, 0), (left, 0), (0, 0)], 0.0)?.conv1d(weight, 1, 0, dilation, groups)
    }
}

/// What a mask of [`Array::sdpa_by_products_bucketed`] depends on: the scores' shape
/// `[b, hkv, rep * l, kp]` and dtype, `kn` real keys of the `kp`, whether it is `causal` (else
/// only the padding is masked), and a sliding `window` (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MaskKey {
    b: i32,
    hkv: i32,
    rep: i32,
    l: i32,
    kn: i32,
    kp: i32,
    causal: bool,
    window: usize,
    dtype: DType,
}

/// Masks kept per thread: a forward's layers ask for one or two (full and sliding attention).
const MASKS_KEPT: usize = 4;
/// Largest mask kept (elements; 8 MB in f32): a verify step of 8 queries with 32 heads over
/// 8192 keys. Larger ones (long prompts in pieces of up to 64 queries) are made per call.
const MASK_KEPT_MAX_ELEMENTS: usize = 1 << 21;

thread_local! {
    static MASKS: std::cell::RefCell<Vec<(MaskKey, crate::Device, Array)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The additive mask of `key` (`[b, hkv, rep * l, kp]`: 0 where `visible`'s boolean `[l or 1,
/// kp]` is true, -inf elsewhere, repeated for each head), made once and then shared: every
/// layer of a forward asks for the same mask, which would otherwise be 3 to 10 graph nodes in
/// each (host work per node is what a few-row forward on a GPU costs). The most recent
/// [`MASKS_KEPT`] per thread and device, of at most [`MASK_KEPT_MAX_ELEMENTS`].
fn position_mask(key: MaskKey, visible: impl FnOnce() -> Result<Array>) -> Result<Array> {
    let MaskKey { b, hkv, rep, l, kp, dtype, .. } = key;
    let elements = [b, hkv, rep, l, kp].iter().map(|&d| d.max(0) as usize).product::<usize>();
    let device = crate::default_device()?;
    let kept = elements <= MASK_KEPT_MAX_ELEMENTS;
    if let Some(m) = kept.then(|| MASKS.with(|c| c.borrow().iter().find(|(k, d, _)| *k == key && *d == device).map(|e| e.2.clone()))).flatten() {
        return Ok(m);
    }
    let v = visible()?;
    let rows = v.dims()[0];
    let add = where_(&v, &Array::scalar_as(0.0, dtype)?, &Array::scalar_as(f32::NEG_INFINITY, dtype)?)?;
    let m = add.reshape(&[1, 1, 1, rows, kp])?.broadcast_to(&[b as usize, hkv as usize, rep as usize, l as usize, kp as usize])?.reshape(&[b, hkv, rep * l, kp])?;
    if !kept {
        return Ok(m);
    }
    MASKS.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() == MASKS_KEPT {
            c.remove(0);
        }
        c.push((key, device, m.clone()));
    });
    Ok(m)
}

/// Boolean `[L, K]` mask: query `i` (at position `K-L+i`) sees keys `j` with `p-w < j <= p`.
pub fn sliding_window_mask(l: usize, k: usize, window: usize) -> Result<Array> {
    padded_sliding_window_mask(l, k, k, window)
}

/// [`sliding_window_mask`] over `padded >= k` key columns, the `padded - k` past the last query
/// masked out (they lie after every query's position).
fn padded_sliding_window_mask(l: usize, k: usize, padded: usize, window: usize) -> Result<Array> {
    if l > k || window == 0 || padded < k {
        return Err(Error::arg("sliding_window_mask", format!("{l} queries, {k} keys, window {window}")));
    }
    let qpos = Array::arange((k - l) as i64, k as i64, DType::I32)?.reshape(&[l as i32, 1])?;
    let kpos = Array::arange(0, padded as i64, DType::I32)?.reshape(&[1, padded as i32])?;
    let causal = kpos.le(&qpos)?;
    let recent = kpos.gt(&qpos.sub(&Array::scalar(window as i32))?)?;
    causal.logical_and(&recent)
}

/// One head group of [`heads`]: `heads` heads of `head_dim` features from column `col` of
/// projection output `input`, rotated when `rotate`.
#[derive(Debug, Clone, Copy)]
pub struct HeadGroup {
    pub input: usize,
    pub col: usize,
    pub heads: usize,
    pub rotate: bool,
}

/// Attention's heads from its projection outputs `xs` (1 to 3 arrays `[B, L, C]`): one
/// `[B, heads, L, head_dim]` array per group (at most 3), the rotated ones by `rope` at
/// positions `offset + l`. On a CPU stream with float inputs of one dtype this is one primitive (`mlx-sys`'s
/// `cpukern/ops.cpp`), instead of a slice, reshape and transpose per group and a rope per
/// rotated group (MLX's ops, what it runs elsewhere).
pub fn heads(xs: &[&Array], groups: &[HeadGroup], head_dim: usize, rope: &RopeConfig, offset: usize) -> Result<Vec<Array>> {
    if xs.is_empty() || xs.len() > 3 || groups.is_empty() || groups.len() > 3 {
        return Err(Error::arg("heads", format!("{} projections and {} head groups (1 to 3 each)", xs.len(), groups.len())));
    }
    let int = |v: usize, what: &str| i32::try_from(v).map_err(|_| Error::arg("heads", format!("{what} {v} exceeds i32")));
    let input: Vec<i32> = groups.iter().map(|g| int(g.input, "input")).collect::<Result<_>>()?;
    let col: Vec<i32> = groups.iter().map(|g| int(g.col, "column")).collect::<Result<_>>()?;
    let nh: Vec<i32> = groups.iter().map(|g| int(g.heads, "heads")).collect::<Result<_>>()?;
    let rot: Vec<bool> = groups.iter().map(|g| g.rotate).collect();
    let (hd, ra) = (int(head_dim, "head dim")?, rope_args("heads", rope, offset)?);
    let x = |i: usize| xs.get(i).map_or_else(empty, |a| a.inner.as_ptr());
    let f = rope.freqs.map_or_else(empty, |f| f.inner.as_ptr());
    let s = crate::ffi::stream();
    let n = groups.len();
    let outs = crate::ffi::call_n::<3>("heads", |r| {
        let [r0, r1, r2] = r;
        unsafe {
            mlx_sys::mlx_models_heads(r0, r1, r2, x(0), x(1), x(2), n as i32, input.as_ptr(), col.as_ptr(), nh.as_ptr(), rot.as_ptr(), hd, &ra, f, s.as_ptr())
        }
    })?;
    Ok(outs.into_iter().take(n).collect())
}
