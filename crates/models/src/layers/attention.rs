use super::parallel::{per_rank, Shard};
use super::{FusedLinear, Linear, RmsNorm, Rope, RopeAt};
use crate::cache::{KvCache, LayerKv};
use crate::weights::Vb;
use crate::Result;
use mlx_array::{ops, Array, AttentionMask};

/// The shape and options of a multi-head (grouped-query) attention layer.
#[derive(Clone, Debug)]
pub struct AttentionConfig {
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Bias on the q/k/v projections.
    pub bias: bool,
    /// Bias on the output projection (Llama's `attention_bias` covers it, Qwen2's does not).
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k (Qwen3, Gemma 4), with this eps.
    pub qk_norm: Option<f32>,
    /// Norm weight offset (1.0 for `x * (1 + w)` checkpoints).
    pub norm_offset: f32,
    /// `q_proj` also produces a sigmoid output gate (Qwen3.5 full attention).
    pub output_gate: bool,
    /// Softmax scale (default `head_dim^-0.5`).
    pub scale: Option<f32>,
    /// Output projection name (`o_proj`, LFM2: `out_proj`).
    pub o_name: &'static str,
}

impl AttentionConfig {
    /// Plain grouped-query attention: no biases, no q/k norms, no output gate, the default scale,
    /// `o_proj`; a family sets what differs with `..AttentionConfig::new(..)`.
    pub fn new(hidden: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Self {
        AttentionConfig { hidden, n_heads, n_kv_heads, head_dim, bias: false, o_bias: false, qk_norm: None, norm_offset: 0.0, output_gate: false, scale: None, o_name: "o_proj" }
    }
}

/// Self-attention with rotary positions over a [`KvCache`].
#[derive(Clone)]
pub struct Attention {
    /// `q_proj`, `k_proj`, `v_proj` as one product.
    qkv: FusedLinear,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    rope: Rope,
    cfg: AttentionConfig,
}

impl Attention {
    pub fn load(vb: &Vb, cfg: AttentionConfig, rope: Rope, names: [&str; 2]) -> Result<Self> {
        let (h, d) = (cfg.hidden, cfg.head_dim);
        let q_out = cfg.n_heads * d * if cfg.output_gate { 2 } else { 1 };
        let (qn, kn) = (names[0], names[1]);
        let norm = |n: &str| -> Result<Option<RmsNorm>> {
            cfg.qk_norm.map(|eps| RmsNorm::load(&vb.pp(n), d, eps, cfg.norm_offset)).transpose()
        };
        // Tensor parallel: this rank's heads (whole heads per rank, q with its KV group).
        let local = AttentionConfig { n_heads: per_rank(vb, "attention heads", cfg.n_heads)?, n_kv_heads: per_rank(vb, "KV heads", cfg.n_kv_heads)?, ..cfg.clone() };
        Ok(Attention {
            qkv: FusedLinear::load_sharded(vb, &["q_proj", "k_proj", "v_proj"], h, &[q_out, cfg.n_kv_heads * d, cfg.n_kv_heads * d], cfg.bias)?,
            o: Linear::load_parallel(&vb.pp(cfg.o_name), cfg.n_heads * d, h, cfg.o_bias, Shard::Input)?,
            q_norm: norm(qn)?,
            k_norm: norm(kn)?,
            rope,
            cfg: local,
        })
    }

    /// `[B, L, n * D]` as `[B, L, n, D]`; a single position (`L` = 1) as `[B, n, 1, D]`, the
    /// heads-first layout attention reads, in one reshape (see [`heads_first`]).
    fn heads(&self, x: &Array, n: usize) -> Result<Array> {
        let s = x.dims();
        let d = self.cfg.head_dim as i32;
        Ok(if s[1] == 1 { x.reshape(&[s[0], n as i32, 1, d])? } else { x.reshape(&[s[0], s[1], n as i32, d])? })
    }

    /// `x`: `[B, L, hidden]`, over a flat cache.
    pub fn forward(&self, x: &Array, cache: &mut KvCache, mask: AttentionMask) -> Result<Array> {
        self.forward_kv(x, &mut LayerKv::Flat(cache), mask)
    }

    /// `x`: `[B, L, hidden]`, over either K/V store.
    pub fn forward_kv(&self, x: &Array, cache: &mut LayerKv, mask: AttentionMask) -> Result<Array> {
        self.attend(x, cache, mask, false, &RopeAt::Cache)
    }

    /// [`Attention::forward_kv`] (or, with `last_only`, [`Attention::forward_kv_last`]) with the
    /// tokens at rotary positions `at`.
    pub fn forward_kv_at(&self, x: &Array, cache: &mut LayerKv, mask: AttentionMask, last_only: bool, at: &RopeAt) -> Result<Array> {
        if last_only {
            self.last_at(x, cache, mask, at)
        } else {
            self.attend(x, cache, mask, false, at)
        }
    }

    /// The last row of [`Attention::forward_kv`] (`[B, 1, hidden]`): the K/V of every row go to
    /// the cache, but only the last position is queried, so its projections and attention run for
    /// one row. For a model's last layer when only the last position is read (a prefill's
    /// logits); mlx-lm gets the same saving by prefilling all but the last token without logits.
    pub fn forward_kv_last(&self, x: &Array, cache: &mut LayerKv, mask: AttentionMask) -> Result<Array> {
        self.last_at(x, cache, mask, &RopeAt::Cache)
    }

    fn last_at(&self, x: &Array, cache: &mut LayerKv, mask: AttentionMask, at: &RopeAt) -> Result<Array> {
        let l = x.dims()[1] as usize;
        if l == 1 {
            return self.attend(x, cache, mask, false, at);
        }
        match last_query_mask(mask) {
            Some(m) => self.attend(x, cache, m, true, at),
            None => Ok(self.attend(x, cache, mask, false, at)?.slice_axis(1, l - 1, l)?),
        }
    }

    /// On the CPU, the q, k and v heads (`[B, H, L, D]`, q and k rotated) of a plain step in one
    /// primitive ([`mlx_array::ops::heads`]): every position queried, no output gate or q/k
    /// norms, one rotary offset for the batch, no YaRN factor. `None` when the step is not one.
    fn cpu_heads(&self, x: &Array, cache: &LayerKv, last: bool, at: &RopeAt) -> Result<Option<(Array, Array, Array)>> {
        let c = &self.cfg;
        let plain = !last && !c.output_gate && self.q_norm.is_none() && self.k_norm.is_none() && super::runs_on_cpu() && x.ndim() == 3;
        if !plain || cache.batch().is_some_and(|r| !r.uniform()) {
            return Ok(None);
        }
        let off = cache.offset();
        let pos = match at {
            RopeAt::Cache => off,
            RopeAt::Shift(d) => match usize::try_from(off as i64 + d) {
                Ok(p) => p,
                Err(_) => return Ok(None), // attend reports it
            },
            RopeAt::Angles { .. } => return Ok(None),
        };
        let Some(rope) = self.rope.plain_config(pos + x.dims()[1] as usize) else { return Ok(None) };
        let (ys, cols) = self.qkv.forward_for_heads(x)?;
        let d = c.head_dim;
        // one joined product: the parts at their columns; else part i is product i
        let group = |i: usize, heads: usize, rotate: bool| match ys.len() {
            1 => mlx_array::ops::HeadGroup { input: 0, col: cols[i], heads, rotate },
            _ => mlx_array::ops::HeadGroup { input: i, col: 0, heads, rotate },
        };
        let groups = [group(0, c.n_heads, true), group(1, c.n_kv_heads, true), group(2, c.n_kv_heads, false)];
        let refs: Vec<&Array> = ys.iter().collect();
        let mut hs = mlx_array::ops::heads(&refs, &groups, d, &rope, pos)?.into_iter();
        match (hs.next(), hs.next(), hs.next()) {
            (Some(q), Some(k), Some(v)) => Ok(Some((q, k, v))),
            _ => Err(crate::ModelError::InvalidInput("attention heads: three outputs expected".into())),
        }
    }

    /// `last`: query only the last row (`mask` is then that of a query at the end:
    /// [`last_query_mask`]).
    fn attend(&self, x: &Array, cache: &mut LayerKv, mask: AttentionMask, last: bool, at: &RopeAt) -> Result<Array> {
        let c = &self.cfg;
        let (b, l) = (x.dims()[0], x.dims()[1]);
        if let Some((q, k, v)) = self.cpu_heads(x, cache, last, at)? {
            let (k, v) = cache.update_and_fetch(&k, &v)?;
            let scale = c.scale.unwrap_or((c.head_dim as f32).powf(-0.5));
            let o = if l as usize <= CPU_QUERY_CHUNK {
                q.sdpa_merged(&k, &v, scale, mask)?
            } else {
                sdpa(&q, &k, &v, scale, mask)?.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?
            };
            return self.o.forward(&o);
        }
        // the joined product's heads, heads-first, by one reshape (and a transpose for several
        // positions) and one split
        let heads3 = match !last && !c.output_gate {
            true => self.qkv.forward_heads(x, &[c.n_heads, c.n_kv_heads, c.n_kv_heads], c.head_dim)?,
            false => None,
        };
        if let Some([q, k, v]) = heads3 {
            return self.attend_heads(x, cache, mask, false, at, [q, k, v], None, true);
        }
        let (mut q, k, v) = if last {
            let xq = x.slice_axis(1, l as usize - 1, l as usize)?;
            (self.qkv.part(0, &xq)?, self.qkv.part(1, x)?, self.qkv.part(2, x)?)
        } else {
            let mut qkv = self.qkv.forward(x)?.into_iter();
            (qkv.next().unwrap(), qkv.next().unwrap(), qkv.next().unwrap())
        };
        let lq = if last { 1 } else { l };
        let mut gate = None;
        if c.output_gate {
            // [B, L, H, 2D]: per head, the first D are the query, the last D the gate.
            let qg = q.reshape(&[b, lq, c.n_heads as i32, 2, c.head_dim as i32])?;
            let parts = qg.split(2, 3)?;
            q = parts[0].reshape(&[b, lq, -1])?;
            gate = Some(parts[1].reshape(&[b, lq, -1])?);
        }
        let (q, k) = (self.heads(&q, c.n_heads)?, self.heads(&k, c.n_kv_heads)?);
        let v = heads_first(self.heads(&v, c.n_kv_heads)?, l)?;
        self.attend_heads(x, cache, mask, last, at, [q, k, v], gate, false)
    }

    /// [`Attention::attend`] from the heads `[q, k, v]` (q and k before their norms and
    /// rotation): v heads-first, q and k too when `qk_first`, else as [`Attention::heads`] lays
    /// them out.
    #[allow(clippy::too_many_arguments)]
    fn attend_heads(&self, x: &Array, cache: &mut LayerKv, mask: AttentionMask, last: bool, at: &RopeAt, [mut q, mut k, v]: [Array; 3], gate: Option<Array>, qk_first: bool) -> Result<Array> {
        let c = &self.cfg;
        let first = |a: Array, l: i32| if qk_first { Ok(a) } else { heads_first(a, l) };
        let (b, l) = (x.dims()[0], x.dims()[1]);
        let lq = if last { 1 } else { l };
        if let Some(n) = &self.q_norm {
            q = n.forward(&q)?;
        }
        if let Some(n) = &self.k_norm {
            k = n.forward(&k)?;
        }
        // A step of a few rows (tokens, or batch rows) on a GPU takes q and k as views of one
        // joined product (rows as wide as q + k + v). libmlx's CUDA rope has computed wrong
        // values for such strided inputs (mlx-lm makes them contiguous first), and on an H100
        // the verify steps of a model without q/k norms (whose outputs are fresh arrays) left
        // plain decoding's tokens: rope gets them contiguous.
        let rows = (b * l) as usize;
        if !last && rows > 1 && self.qkv.returns_views(rows) && !super::runs_on_cpu() {
            if self.q_norm.is_none() {
                q = q.contiguous()?;
            }
            if self.k_norm.is_none() {
                k = k.contiguous()?;
            }
        }
        if let Some(g) = cache.batch().and_then(|r| r.ragged()) {
            // a packed step: each row's tokens at its own positions, against its own keys
            if last || !matches!(at, RopeAt::Cache | RopeAt::Shift(0)) {
                return Err(crate::ModelError::UnsupportedOption("packed steps take every token at its cache position".into()));
            }
            let rope = |x: &Array, p: usize| self.rope.forward(x, p);
            let q = g.rope(&first(q, lq)?, rope)?;
            let k = g.rope(&first(k, l)?, rope)?;
            let (k, v) = cache.update_and_fetch(&g.to_rows(&k, 2)?, &g.to_rows(&v, 2)?)?;
            let scale = c.scale.unwrap_or((c.head_dim as f32).powf(-0.5));
            let o = g.attend(&q, &k, &v, scale, mask_window(mask))?.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
            let o = match gate {
                Some(g) => o.mul(&g.sigmoid()?)?,
                None => o,
            };
            return self.o.forward(&o);
        }
        let off = cache.offset();
        let q_off = if last { off + l as usize - 1 } else { off };
        let batch = cache.batch().filter(|r| !r.uniform());
        let (q, k) = (first(q, lq)?, first(k, l)?);
        let (q, k) = match (batch, at) {
            (Some(r), RopeAt::Cache | RopeAt::Shift(0)) => {
                (self.rope.forward_rows(&q, &r.positions(q_off)?, r.longest())?, self.rope.forward_rows(&k, &r.positions(off)?, r.longest())?)
            }
            (Some(_), _) => return Err(crate::ModelError::UnsupportedOption("batch caches take tokens at their cache positions only".into())),
            (None, RopeAt::Cache) => (self.rope.forward(&q, q_off)?, self.rope.forward(&k, off)?),
            (None, RopeAt::Shift(d)) => {
                let at = |o: usize| usize::try_from(o as i64 + d).map_err(|_| crate::ModelError::InvalidInput(format!("rotary position {o} + {d} is negative")));
                (self.rope.forward(&q, at(q_off)?)?, self.rope.forward(&k, at(off)?)?)
            }
            (None, RopeAt::Angles { cos, sin }) => {
                let n = cos.dim(0)?;
                let (qc, qs) = if last { (cos.slice_axis(0, n - 1, n)?, sin.slice_axis(0, n - 1, n)?) } else { (cos.clone(), sin.clone()) };
                (super::rope::rotate_half_by(&q, &qc, &qs)?, super::rope::rotate_half_by(&k, cos, sin)?)
            }
        };
        let (k, v) = cache.update_and_fetch(&k, &v)?;
        let scale = c.scale.unwrap_or((c.head_dim as f32).powf(-0.5));
        let batch_mask = batch.map(|r| r.mask(lq as usize, k.dims()[2] as usize, mask_window(mask))).transpose()?;
        let mask = batch_mask.as_ref().map_or(mask, AttentionMask::Array);
        let o = merge_heads(sdpa(&q, &k, &v, scale, mask)?, b, lq)?;
        let o = match gate {
            Some(g) => o.mul(&g.sigmoid()?)?,
            None => o,
        };
        self.o.forward(&o)
    }
}

/// [`Attention::heads`]' output over `l` positions in the heads-first layout `[B, n, L, D]`: a
/// transpose, except for a single position, which `heads` already laid out so (each node of a
/// decode step's graph is host work for the backend).
fn heads_first(x: Array, l: i32) -> Result<Array> {
    Ok(if l == 1 { x } else { x.transpose(&[0, 2, 1, 3])? })
}

/// Attention's output `[B, H, L, D]` as `[B, L, H * D]` (one reshape for a single position).
fn merge_heads(o: Array, b: i32, l: i32) -> Result<Array> {
    Ok(if l == 1 { o.reshape(&[b, 1, -1])? } else { o.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])? })
}

/// Queries per attention call in a long causal or sliding-window step on the CPU (the shared
/// attention splits such steps into calls of this many queries; BENCHMARKS.md, "CPU: long prompts").
pub(crate) const CPU_QUERY_CHUNK: usize = 64;

/// Attention of queries `[B, Hq, L, D]` over keys and values `[B, Hkv, K, D]`, the queries being
/// the last `L` of the `K` positions ([`Array::sdpa`]), for every attention layer of every
/// family.
///
/// On the CPU a causal or sliding-window step of more than [`CPU_QUERY_CHUNK`] queries runs as
/// one call per chunk of queries, each over only the keys its queries can see. MLX's CPU
/// attention scores every query against every key and masks afterwards; this skips the masked
/// half and keeps each call's scores small. With `Hq = 16`, `D = 128`, `L = K = 2048` (f32, the
/// CPU VM of BENCHMARKS.md) one layer takes 0.68 s instead of 1.32 (`benches/sdpa_chunk.py`);
/// results agree to 2e-6.
/// Chunk boundaries fall at multiples of the chunk in key positions, so a prompt fed in pieces
/// of that size computes what one call over it computes. GPU backends have fused causal
/// kernels and get the single call (on the H200 it is 10 times faster than 64-query chunks).
pub(crate) fn sdpa(q: &Array, k: &Array, v: &Array, scale: f32, mask: AttentionMask) -> Result<Array> {
    let (l, kn) = (q.dims()[2] as usize, k.dims()[2] as usize);
    let chunked = (matches!(mask, AttentionMask::Causal) || matches!(mask, AttentionMask::SlidingWindow(w) if w > 0)) && l > CPU_QUERY_CHUNK && l <= kn;
    if !chunked || !super::runs_on_cpu() {
        return Ok(q.sdpa(k, v, scale, mask)?);
    }
    let c = CPU_QUERY_CHUNK;
    let first = kn - l; // the key position of query 0
    let mut outs = Vec::with_capacity(l.div_ceil(c) + 1);
    let mut s = first;
    while s < kn {
        let e = ((s / c + 1) * c).min(kn);
        // the first key any query in s..e sees
        let k0 = match mask {
            AttentionMask::SlidingWindow(w) => (s + 1).saturating_sub(w),
            _ => 0,
        };
        let qc = q.slice_axis(2, s - first, e - first)?;
        let (kc, vc) = (k.slice_axis(2, k0, e)?, v.slice_axis(2, k0, e)?);
        outs.push(qc.sdpa(&kc, &vc, scale, mask)?);
        s = e;
    }
    let refs: Vec<&Array> = outs.iter().collect();
    Ok(ops::concatenate(&refs, 2)?)
}

/// The mask of a step's last query alone (attention that queries only the last position), or
/// `None` when `mask` cannot be narrowed to it (a mask array: attend with every row, keep the
/// last). One query at the end sees every key under a causal mask, the last `w` under a sliding
/// window.
pub(crate) fn last_query_mask(mask: AttentionMask<'_>) -> Option<AttentionMask<'_>> {
    match mask {
        AttentionMask::Array(_) => None,
        AttentionMask::Causal => Some(AttentionMask::None),
        m => Some(m),
    }
}

/// The sliding window a mask applies (`None`: full causal attention), for the batch mask that
/// replaces it ([`crate::batch::BatchRows::mask`]).
pub(crate) fn mask_window(mask: AttentionMask<'_>) -> Option<usize> {
    match mask {
        AttentionMask::SlidingWindow(w) if w > 0 => Some(w),
        _ => None,
    }
}

/// The mask for `l` new queries: causal during prefill, none for a single decode token.
pub fn causal_mask(l: usize, window: Option<usize>) -> AttentionMask<'static> {
    match (l, window) {
        (1, None) => AttentionMask::None,
        (_, Some(w)) => AttentionMask::SlidingWindow(w),
        _ => AttentionMask::Causal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_array::{random, DType};

    fn qkv(hq: usize, hkv: usize, l: usize, k: usize, d: usize, seed: u64) -> (Array, Array, Array) {
        let key = random::Key::new(seed).unwrap();
        let ks = key.split_n(3).unwrap();
        let n = |shape: &[usize], i: usize| random::normal(shape, DType::F32, &ks[i]).unwrap();
        (n(&[1, hq, l, d], 0), n(&[1, hkv, k, d], 1), n(&[1, hkv, k, d], 2))
    }

    fn max_diff(a: &Array, b: &Array) -> f32 {
        assert_eq!(a.shape(), b.shape());
        a.to_vec::<f32>().unwrap().iter().zip(b.to_vec::<f32>().unwrap()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    /// The chunked CPU path against MLX's single call: queries from position 0 and from an
    /// offset (a chunk after cached keys), causal and sliding windows shorter and longer than
    /// a chunk. A wrong first key or chunk end moves the result by far more than 1e-5.
    #[test]
    fn chunked_attention_matches_one_call() {
        for (l, kn, mask) in [
            (150, 150, AttentionMask::Causal),
            (150, 213, AttentionMask::Causal),
            (65, 65, AttentionMask::Causal),
            (150, 150, AttentionMask::SlidingWindow(40)),
            (150, 213, AttentionMask::SlidingWindow(100)),
            (200, 200, AttentionMask::SlidingWindow(64)),
        ] {
            let (q, k, v) = qkv(4, 2, l, kn, 16, l as u64 * 1000 + kn as u64);
            let got = sdpa(&q, &k, &v, 0.25, mask).unwrap();
            let want = q.sdpa(&k, &v, 0.25, mask).unwrap();
            let d = max_diff(&got, &want);
            assert!(d < 1e-5, "L={l} K={kn} {mask:?}: max diff {d}");
        }
    }

    /// A prompt fed in pieces of whole chunks computes what one call computes, bit for bit.
    #[test]
    fn chunk_aligned_pieces_equal_one_call() {
        let (l, c) = (3 * CPU_QUERY_CHUNK, CPU_QUERY_CHUNK);
        let (q, k, v) = qkv(4, 2, l, l, 16, 7);
        let whole = sdpa(&q, &k, &v, 0.25, AttentionMask::Causal).unwrap().to_vec::<f32>().unwrap();
        let first = sdpa(&q.slice_axis(2, 0, c).unwrap(), &k.slice_axis(2, 0, c).unwrap(), &v.slice_axis(2, 0, c).unwrap(), 0.25, AttentionMask::Causal).unwrap();
        let rest = sdpa(&q.slice_axis(2, c, l).unwrap(), &k, &v, 0.25, AttentionMask::Causal).unwrap();
        let pieces = ops::concatenate(&[&first, &rest], 2).unwrap().to_vec::<f32>().unwrap();
        assert!(whole == pieces, "pieces differ from one call");
    }
}

super::layer_arrays!(Attention { qkv, o, q_norm, k_norm });
