//! GGML tensor types and their dequantization to f32.
//!
//! Each block decoder follows the `gguf` Python package's `gguf.quants` (itself ggml's
//! `dequantize_row_*`) operation for operation, in f32 and without fused multiply-adds, so the
//! results are bit-identical to it (checked against references that package produced).
use half::f16;

/// A GGML tensor type (the `ggml_type` numbering GGUF files store).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

const QK_K: usize = 256;

impl GgmlType {
    pub fn from_u32(v: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match v {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            40 => NVFP4,
            41 => Q1_0,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block), as `GGML_QUANT_SIZES`.
    pub fn block(self) -> (u64, u64) {
        use GgmlType::*;
        let k = QK_K as u64;
        match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 | IQ4_NL => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 40),
            Q2_K => (k, 4 + k / 16 + k / 4),
            Q3_K => (k, 2 + k / 4 + k / 8 + 12),
            Q4_K => (k, 4 + k / 2 + 12),
            Q5_K => (k, 4 + k / 2 + k / 8 + 12),
            Q6_K => (k, 2 + k / 2 + k / 4 + k / 16),
            Q8_K => (k, 4 + k + k / 8),
            IQ2_XXS => (k, 2 + k / 4),
            IQ2_XS => (k, 2 + k / 4 + k / 32),
            IQ3_XXS => (k, 2 + k / 4 + k / 8),
            IQ1_S => (k, 2 + k / 8 + k / 16),
            IQ3_S => (k, 2 + k / 4 + k / 8 + k / 32 + 4),
            IQ2_S => (k, 2 + k / 4 + k / 16),
            IQ4_XS => (k, 4 + k / 2 + k / 64),
            IQ1_M => (k, k / 8 + k / 16 + k / 32),
            TQ1_0 => (k, 2 + 4 * 13),
            TQ2_0 => (k, 2 + 64),
            MXFP4 => (32, 17),
            NVFP4 => (64, 36),
            Q1_0 => (128, 18),
        }
    }

    /// Whether [`dequantize`] decodes this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | F64 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | TQ1_0 | TQ2_0 | IQ4_NL | IQ4_XS | MXFP4 | NVFP4
        )
    }
}

fn h(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantize `n` elements of type `ty` from `data` (exactly their bytes) into a new vector.
/// `Err(ty)` for the types [`GgmlType::can_dequantize`] rejects.
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>, GgmlType> {
    let mut out = vec![0f32; n];
    dequantize_into(ty, data, &mut out)?;
    Ok(out)
}

/// [`dequantize`] into `out` (`out.len()` elements). Panics if `data` is not exactly the bytes of
/// `out.len()` elements (the GGUF reader checks extents before it hands out slices).
pub fn dequantize_into(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), GgmlType> {
    use GgmlType::*;
    if !ty.can_dequantize() {
        return Err(ty);
    }
    let (bs, ts) = ty.block();
    let (bs, ts) = (bs as usize, ts as usize);
    assert!(out.len() % bs == 0 && data.len() == out.len() / bs * ts, "{ty:?}: {} bytes for {} elements", data.len(), out.len());
    let blocks = data.chunks_exact(ts).zip(out.chunks_exact_mut(bs));
    match ty {
        F32 => blocks.for_each(|(b, o)| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        F16 => blocks.for_each(|(b, o)| o[0] = h(b, 0)),
        BF16 => blocks.for_each(|(b, o)| o[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)),
        F64 => blocks.for_each(|(b, o)| o[0] = f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32),
        Q4_0 => blocks.for_each(|(b, o)| {
            let d = h(b, 0);
            for i in 0..16 {
                o[i] = d * ((b[2 + i] & 0xF) as i8 - 8) as f32;
                o[i + 16] = d * ((b[2 + i] >> 4) as i8 - 8) as f32;
            }
        }),
        Q4_1 => blocks.for_each(|(b, o)| {
            let (d, m) = (h(b, 0), h(b, 2));
            for i in 0..16 {
                o[i] = d * (b[4 + i] & 0xF) as f32 + m;
                o[i + 16] = d * (b[4 + i] >> 4) as f32 + m;
            }
        }),
        Q5_0 => blocks.for_each(|(b, o)| {
            let d = h(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for i in 0..16 {
                let lo = (b[6 + i] & 0xF) | ((((qh >> i) & 1) as u8) << 4);
                let hi = (b[6 + i] >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4);
                o[i] = d * (lo as i8 - 16) as f32;
                o[i + 16] = d * (hi as i8 - 16) as f32;
            }
        }),
        Q5_1 => blocks.for_each(|(b, o)| {
            let (d, m) = (h(b, 0), h(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            for i in 0..16 {
                let lo = (b[8 + i] & 0xF) | ((((qh >> i) & 1) as u8) << 4);
                let hi = (b[8 + i] >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4);
                o[i] = d * lo as f32 + m;
                o[i + 16] = d * hi as f32 + m;
            }
        }),
        Q8_0 => blocks.for_each(|(b, o)| {
            let d = h(b, 0);
            for i in 0..32 {
                o[i] = b[2 + i] as i8 as f32 * d;
            }
        }),
        Q2_K => blocks.for_each(|(b, o)| {
            let (scales, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (h(b, 80), h(b, 82));
            for c in 0..2 {
                for s in 0..4 {
                    for i in 0..32 {
                        let f = c * 128 + s * 32 + i;
                        let sc = scales[f / 16];
                        let q = ((qs[c * 32 + i] >> (2 * s)) & 3) as f32;
                        let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
                        o[f] = dl * q - ml;
                    }
                }
            }
        }),
        Q3_K => blocks.for_each(|(b, o)| {
            let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = h(b, 108);
            let mut scales = [0f32; 16];
            for (k, s) in scales.iter_mut().enumerate() {
                let l = (sc[k % 8] >> (4 * (k / 8))) & 0xF;
                let hb = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
                *s = d * (((l | (hb << 4)) as i8) - 32) as f32;
            }
            for c in 0..2 {
                for s in 0..4 {
                    for i in 0..32 {
                        let f = c * 128 + s * 32 + i;
                        let ql = ((qs[c * 32 + i] >> (2 * s)) & 3) as i8;
                        let qh = ((hmask[i] >> (f / 32)) & 1) ^ 1;
                        o[f] = scales[f / 16] * (ql - ((qh << 2) as i8)) as f32;
                    }
                }
            }
        }),
        Q4_K | Q5_K => blocks.for_each(|(b, o)| {
            let (d, dmin) = (h(b, 0), h(b, 2));
            let (sc, m) = scale_min_k4(&b[4..16]);
            let (qh, qs) = if ty == Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for c in 0..4 {
                for s in 0..2 {
                    let j = c * 2 + s;
                    let (dj, mj) = (d * sc[j] as f32, dmin * m[j] as f32);
                    for i in 0..32 {
                        let mut q = (qs[c * 32 + i] >> (4 * s)) & 0xF;
                        if let Some(qh) = qh {
                            q |= ((qh[i] >> j) & 1) << 4;
                        }
                        o[j * 32 + i] = dj * q as f32 - mj;
                    }
                }
            }
        }),
        Q6_K => blocks.for_each(|(b, o)| {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = h(b, 208);
            for c in 0..2 {
                for s in 0..4 {
                    for i in 0..32 {
                        let f = c * 128 + s * 32 + i;
                        // ql's flat index f is (c, s/2, (s%2)*32 + i) of its (2, 2, 64) view.
                        let lo = (ql[c * 64 + (s % 2) * 32 + i] >> (4 * (s / 2))) & 0xF;
                        let hi = (qh[c * 32 + i] >> (2 * s)) & 3;
                        let q = ((lo | (hi << 4)) as i8 - 32) as f32;
                        o[f] = d * sc[f / 16] as i8 as f32 * q;
                    }
                }
            }
        }),
        TQ1_0 => blocks.for_each(|(b, o)| {
            let (qs, qh) = (&b[0..48], &b[48..52]);
            let d = h(b, 52);
            const POW: [u8; 5] = [1, 3, 9, 27, 81];
            let tern = |v: u8| ((((v as u16) * 3) >> 8) as i8 - 1) as f32;
            let mut f = 0;
            for p in POW {
                for &q in &qs[0..32] {
                    o[f] = d * tern(q.wrapping_mul(p));
                    f += 1;
                }
            }
            for p in POW {
                for &q in &qs[32..48] {
                    o[f] = d * tern(q.wrapping_mul(p));
                    f += 1;
                }
            }
            for p in &POW[..4] {
                for &q in qh {
                    o[f] = d * tern(q.wrapping_mul(*p));
                    f += 1;
                }
            }
        }),
        TQ2_0 => blocks.for_each(|(b, o)| {
            let d = h(b, 64);
            for c in 0..2 {
                for s in 0..4 {
                    for i in 0..32 {
                        o[c * 128 + s * 32 + i] = d * (((b[c * 32 + i] >> (2 * s)) & 3) as i8 - 1) as f32;
                    }
                }
            }
        }),
        IQ4_NL => blocks.for_each(|(b, o)| {
            let d = h(b, 0);
            for i in 0..16 {
                o[i] = d * IQ4_NL_VALUES[(b[2 + i] & 0xF) as usize] as f32;
                o[i + 16] = d * IQ4_NL_VALUES[(b[2 + i] >> 4) as usize] as f32;
            }
        }),
        IQ4_XS => blocks.for_each(|(b, o)| {
            let d = h(b, 0);
            let sh = u16::from_le_bytes([b[2], b[3]]);
            let (sl, qs) = (&b[4..8], &b[8..136]);
            for ib in 0..8 {
                let l = (sl[ib / 2] >> (4 * (ib % 2))) & 0xF;
                let hb = ((sh >> (2 * ib)) as u8) & 3;
                let dl = d * ((l | (hb << 4)) as i8 - 32) as f32;
                for i in 0..16 {
                    let q = qs[ib * 16 + i];
                    o[ib * 32 + i] = dl * IQ4_NL_VALUES[(q & 0xF) as usize] as f32;
                    o[ib * 32 + 16 + i] = dl * IQ4_NL_VALUES[(q >> 4) as usize] as f32;
                }
            }
        }),
        MXFP4 => blocks.for_each(|(b, o)| {
            let d = e8m0_to_fp32_half(b[0]);
            for i in 0..16 {
                o[i] = d * FP4_VALUES[(b[1 + i] & 0xF) as usize] as f32;
                o[i + 16] = d * FP4_VALUES[(b[1 + i] >> 4) as usize] as f32;
            }
        }),
        NVFP4 => blocks.for_each(|(b, o)| {
            for sub in 0..4 {
                let d = ue4m3_to_fp32_half(b[sub]);
                for i in 0..8 {
                    let q = b[4 + sub * 8 + i];
                    o[sub * 16 + i] = d * FP4_VALUES[(q & 0xF) as usize] as f32;
                    o[sub * 16 + 8 + i] = d * FP4_VALUES[(q >> 4) as usize] as f32;
                }
            }
        }),
        _ => unreachable!("can_dequantize covers the arms"),
    }
    Ok(())
}

/// The 6-bit scales and mins of Q4_K/Q5_K (ggml's `get_scale_min_k4`).
fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        m[j] = s[4 + j] & 0x3F;
        sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
    (sc, m)
}

const IQ4_NL_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];
/// E2M1 values, doubled (the scale decoders below halve).
const FP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// E8M0 scale, halved (ggml's `ggml_e8m0_to_fp32_half`).
fn e8m0_to_fp32_half(x: u8) -> f32 {
    let bits = if x < 2 { 0x0020_0000u32 << x } else { ((x - 1) as u32) << 23 };
    f32::from_bits(bits)
}

/// Unsigned E4M3 scale (bias 7), halved; 0 and 0x7F decode to 0.
fn ue4m3_to_fp32_half(x: u8) -> f32 {
    if x == 0 || x == 0x7F {
        return 0.0;
    }
    let (exp, man) = (((x >> 3) & 0xF) as i32, (x & 7) as f32);
    let raw = if exp == 0 { man * (2f32).powi(-9) } else { (1.0 + man / 8.0) * (2f32).powi(exp - 7) };
    raw * 0.5
}
