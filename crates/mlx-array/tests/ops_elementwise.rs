//! Elementwise math (incl. erf and the activations), broadcasting binaries and `where`, against
//! f64 references, in f32 and bf16.
mod common;
use common::*;
use mlx_array::{ops, Array, DType, Result};
use proptest::prelude::*;

/// erf by its Maclaurin series (converges well in f64 for |x| <= 3).
fn erf(x: f64) -> f64 {
    let (mut term, mut sum, mut n) = (x, x, 0.0);
    while term.abs() > 1e-17 * sum.abs().max(1e-300) {
        n += 1.0;
        term *= -x * x / n;
        sum += term / (2.0 * n + 1.0);
    }
    2.0 / std::f64::consts::PI.sqrt() * sum
}

type Unary = (&'static str, fn(&Array) -> Result<Array>, fn(f64) -> f64, f32, f32);

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

const UNARY: &[Unary] = &[
    ("neg", |a| a.neg(), |x| -x, -4.0, 4.0),
    ("abs", |a| a.abs(), f64::abs, -4.0, 4.0),
    ("exp", |a| a.exp(), f64::exp, -4.0, 4.0),
    ("log", |a| a.log(), f64::ln, 0.05, 8.0),
    ("sqrt", |a| a.sqrt(), f64::sqrt, 0.0, 8.0),
    ("rsqrt", |a| a.rsqrt(), |x| 1.0 / x.sqrt(), 0.05, 8.0),
    ("square", |a| a.square(), |x| x * x, -4.0, 4.0),
    ("sin", |a| a.sin(), f64::sin, -4.0, 4.0),
    ("cos", |a| a.cos(), f64::cos, -4.0, 4.0),
    ("tanh", |a| a.tanh(), f64::tanh, -4.0, 4.0),
    ("sigmoid", |a| a.sigmoid(), sigmoid, -6.0, 6.0),
    ("floor", |a| a.floor(), f64::floor, -4.0, 4.0),
    ("ceil", |a| a.ceil(), f64::ceil, -4.0, 4.0),
    ("reciprocal", |a| a.reciprocal(), |x| 1.0 / x, 0.1, 4.0),
    ("erf", |a| a.erf(), erf, -3.0, 3.0),
    ("silu", |a| a.silu(), |x| x * sigmoid(x), -6.0, 6.0),
    ("gelu", |a| a.gelu(), |x| 0.5 * x * (1.0 + erf(x / 2f64.sqrt())), -3.0, 3.0),
    ("gelu_tanh", |a| a.gelu_tanh(), |x| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()), -3.0, 3.0),
    ("softcap", |a| a.softcap(3.0), |x| (x / 3.0).tanh() * 3.0, -8.0, 8.0),
    ("clip", |a| a.clip(-0.5, 1.5), |x| x.clamp(-0.5, 1.5), -3.0, 3.0),
    ("add_scalar", |a| a.add_scalar(1.25), |x| x + 1.25, -3.0, 3.0),
    ("mul_scalar", |a| a.mul_scalar(-0.75), |x| -0.75 * x, -3.0, 3.0),
];

/// Unit-interval samples mapped onto each op's domain.
fn check_unary(u: &[f32], dtype: DType, tol: Tol) -> std::result::Result<(), proptest::test_runner::TestCaseError> {
    for &(name, f, r, lo, hi) in UNARY {
        let mut x: Vec<f32> = u.iter().map(|&t| lo + t * (hi - lo)).collect();
        if dtype == DType::BF16 {
            x = bfv(&x);
        }
        // floor/ceil are discontinuous at integers: keep inputs off them so rounding cannot flip.
        if name == "floor" || name == "ceil" {
            x.iter_mut().for_each(|v| if (*v - v.round()).abs() < 0.02 { *v += 0.05 });
        }
        let a = arr_as(&x, &[x.len()], dtype);
        let y = f(&a).unwrap();
        assert_eq!(y.dtype(), dtype, "{name} keeps the dtype");
        let want: Vec<f64> = x.iter().map(|&v| r(v as f64)).collect();
        close(name, &out(&y), &want, tol)?;
    }
    Ok(())
}

type Binary = (&'static str, fn(&Array, &Array) -> Result<Array>, fn(f64, f64) -> f64);
const BINARY: &[Binary] = &[
    ("add", |a, b| a.add(b), |x, y| x + y),
    ("sub", |a, b| a.sub(b), |x, y| x - y),
    ("mul", |a, b| a.mul(b), |x, y| x * y),
    ("div", |a, b| a.div(b), |x, y| x / y),
    ("maximum", |a, b| a.maximum(b), f64::max),
    ("minimum", |a, b| a.minimum(b), f64::min),
    ("pow", |a, b| a.pow(b), f64::powf),
    ("logaddexp", |a, b| a.logaddexp(b), |x, y| (x.exp() + y.exp()).ln()),
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn unary_f32(u in vals(40, 0.0, 1.0)) {
        // MLX's vectorised exp/log/tanh are accurate to a few f32 ulps.
        check_unary(&u, DType::F32, Tol { atol: 2e-6, rtol: 2e-5 })?;
    }

    #[test]
    fn unary_bf16(u in vals(40, 0.0, 1.0)) {
        check_unary(&u, DType::BF16, BF16)?;
    }

    /// `a [r, c] op b [c]`: broadcasting over rows. `b` in [0.5, 2] keeps div and pow tame.
    #[test]
    fn binary_broadcast((r, c, a, b) in (1usize..5, 1usize..7).prop_flat_map(|(r, c)| (Just(r), Just(c), vals(r * c, 0.1, 3.0), vals(c, 0.5, 2.0))), bfl in any::<bool>()) {
        let (dtype, tol, a, b) = if bfl { (DType::BF16, BF16, bfv(&a), bfv(&b)) } else { (DType::F32, Tol { atol: 1e-6, rtol: 1e-5 }, a, b) };
        let (x, y) = (arr_as(&a, &[r, c], dtype), arr_as(&b, &[c], dtype));
        for &(name, f, rf) in BINARY {
            let z = f(&x, &y).unwrap();
            prop_assert_eq!(z.shape(), vec![r, c]);
            let want: Vec<f64> = (0..r * c).map(|i| rf(a[i] as f64, b[i % c] as f64)).collect();
            close(name, &out(&z), &want, tol)?;
        }
        // Comparisons give booleans.
        let gt = x.gt(&y).unwrap();
        prop_assert_eq!(gt.dtype(), DType::Bool);
        let want: Vec<bool> = (0..r * c).map(|i| a[i] > b[i % c]).collect();
        prop_assert_eq!(gt.to_vec::<bool>().unwrap(), want);
    }

    #[test]
    fn where_selects((n, c, a, b) in (1usize..30).prop_flat_map(|n| (Just(n), prop::collection::vec(any::<bool>(), n), vals(n, -5.0, 5.0), vals(n, -5.0, 5.0)))) {
        let cond = Array::from_slice(&c, &[n]).unwrap();
        let w = ops::where_(&cond, &arr(&a, &[n]), &arr(&b, &[n])).unwrap();
        let want: Vec<f32> = (0..n).map(|i| if c[i] { a[i] } else { b[i] }).collect();
        prop_assert_eq!(w.to_vec::<f32>().unwrap(), want);
        // A scalar branch broadcasts.
        let w = ops::where_(&cond, &arr(&a, &[n]), &Array::scalar(0.0f32)).unwrap();
        let want: Vec<f32> = (0..n).map(|i| if c[i] { a[i] } else { 0.0 }).collect();
        prop_assert_eq!(w.to_vec::<f32>().unwrap(), want);
    }
}

#[test]
fn erf_reference_is_right() {
    // Known values, so the reference itself is checked.
    assert!((erf(0.5) - 0.520_499_877_813_046_5).abs() < 1e-15);
    assert!((erf(-2.0) + 0.995_322_265_018_952_7).abs() < 1e-15);
}

/// `scalar_as` gives a 0-d array of the requested dtype holding `v` rounded to it (floats are
/// converted on the host, other dtypes through `astype`), and `mul_scalar` keeps the dtype.
#[test]
fn scalar_as_makes_each_dtype() {
    for (d, v, want) in [
        (DType::F32, 0.044715f32, 0.044715f32),
        (DType::BF16, 0.044715, half::bf16::from_f32(0.044715).to_f32()),
        (DType::F16, 0.044715, half::f16::from_f32(0.044715).to_f32()),
        (DType::I32, 3.0, 3.0),
        (DType::I32, -3.7, -3.0),
        (DType::U32, 32768.0, 32768.0),
        (DType::I64, 5.0, 5.0),
        (DType::U8, 255.0, 255.0),
        (DType::I8, -2.0, -2.0),
        (DType::Bool, 2.0, 1.0),
    ] {
        let s = Array::scalar_as(v, d).unwrap();
        assert_eq!((s.dtype(), s.ndim()), (d, 0), "{d:?}");
        assert!(s.is_available(), "{d:?}: made on the host, no cast kernel behind it");
        assert_eq!(s.astype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![want], "{d:?}");
    }
    let x = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap().astype(DType::BF16).unwrap();
    let y = x.mul_scalar(0.5).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    assert_eq!(y.astype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![0.5, 1.0]);
}
