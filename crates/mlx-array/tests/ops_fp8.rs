//! `to_fp8` / `from_fp8` against an independent E4M3 decoding (round to the nearest finite E4M3
//! value, saturating at +-448), and nvfp4 quantization with a global scale: MLX's `global_scale`
//! is the tensor's max |x|, and the scaled dequantization is the unscaled one times
//! `global_scale / (6 * 448)`.
use mlx_array::{Array, DType, QuantMode};

fn e4m3(c: u8) -> f64 {
    let (s, e, m) = ((c >> 7) & 1, (c >> 3) & 15, c & 7);
    let mag = if e == 0 { m as f64 / 8.0 * 2f64.powi(-6) } else { (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7) };
    if s == 1 { -mag } else { mag }
}

#[test]
fn to_fp8_rounds_to_the_nearest_e4m3_and_saturates() {
    // every finite E4M3 magnitude (codes 0..=126; 127 is NaN)
    let grid: Vec<f64> = (0u8..=126).map(e4m3).collect();
    let mut xs: Vec<f32> = (0..2000).map(|i| ((i as f32) * 0.7331).sin() * 10f32.powf(((i % 9) as f32) - 4.0)).collect();
    xs.extend([0.0, 448.0, 460.0, 1000.0, -1e6, 1e-9, 0.0019]);
    let a = Array::from_slice(&xs, &[xs.len()]).unwrap();
    let codes = a.to_fp8().unwrap();
    assert_eq!(codes.dtype(), DType::U8);
    let back = codes.from_fp8(DType::F32).unwrap().to_vec::<f32>().unwrap();
    let codes = codes.to_vec::<u8>().unwrap();
    for ((&x, &c), &y) in xs.iter().zip(&codes).zip(&back) {
        assert_eq!(e4m3(c) as f32, y, "from_fp8 of code {c}");
        let want = (x as f64).abs().min(448.0);
        let nearest = grid.iter().map(|g| (g - want).abs()).fold(f64::INFINITY, f64::min);
        assert!(((y as f64).abs() - want).abs() <= nearest + 1e-12, "{x} -> {y}, nearest distance {nearest}");
        assert!(y == 0.0 || (y < 0.0) == (x < 0.0), "{x} -> {y}: sign");
    }
    assert!(Array::from_slice(&[1u32], &[1]).unwrap().to_fp8().is_err());
    assert!(a.from_fp8(DType::F32).is_err(), "from_fp8 takes u8 codes");
    assert!(a.to_fp8().unwrap().from_fp8(DType::I32).is_err());
}

#[test]
fn nvfp4_global_scale_is_the_tensor_maximum() {
    let xs: Vec<f32> = (0..4 * 64).map(|i| ((i as f32) * 1.37).sin() * 50.0 + ((i % 7) as f32 - 3.0)).collect();
    let x = Array::from_slice(&xs, &[4, 64]).unwrap();
    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
    let g = Array::scalar(amax);
    let q = x.quantize_scaled(QuantMode::Nvfp4, Some(&g)).unwrap();
    let scaled = q.dequantize_scaled(Some(DType::F32), Some(&g)).unwrap().to_vec::<f32>().unwrap();
    let unscaled = q.dequantize(Some(DType::F32)).unwrap().to_vec::<f32>().unwrap();
    let k = amax / (6.0 * 448.0);
    for (s, u) in scaled.iter().zip(&unscaled) {
        assert!((s - u * k).abs() <= 1e-6 * amax, "{s} vs {u} * {k}");
    }
    // a faithful NVFP4 code of x: within half an E2M1 step of the group's scale at most
    let err = scaled.iter().zip(&xs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err <= amax / 6.0, "max error {err} for amax {amax}");
    // only nvfp4 takes a global scale, and only one f32
    assert!(x.quantize_scaled(QuantMode::Mxfp4, Some(&g)).is_err());
    assert!(x.quantize_scaled(QuantMode::Affine { bits: 4, group_size: 32 }, Some(&g)).is_err());
    assert!(x.quantize_scaled(QuantMode::Nvfp4, Some(&Array::from_slice(&[1f32, 2.0], &[2]).unwrap())).is_err());
    assert!(x.quantize_scaled(QuantMode::Nvfp4, Some(&Array::scalar(2i32))).is_err());
    let mx = x.quantize(QuantMode::Mxfp4).unwrap();
    assert!(mx.dequantize_scaled(None, Some(&g)).is_err());
}
