//! Process-wide behaviour, in one test so nothing else runs concurrently in this binary:
//! an mlx-c call that fails before any other MLX call, eval / async_eval, memory counters.
use mlx_array::{async_eval, eval, memory, ops, Array, DType, Error, QuantMode, Quantized};

#[test]
fn runtime_in_order() {
    // 1. The very first fallible MLX call of the process goes straight to mlx-c and fails there.
    //    mlx-c's default error handler would print and exit(-1); we must get an error value.
    let q = Quantized {
        weight: Array::from_slice(&[0u32; 8], &[1, 8]).unwrap(),
        scales: Array::from_slice(&[1.0f32], &[1, 1]).unwrap(),
        biases: Some(Array::from_slice(&[0.0f32], &[1, 1]).unwrap()),
        mode: QuantMode::Affine { bits: 4, group_size: 64 },
    };
    let x = Array::from_slice(&[1.0f32; 32], &[1, 32]).unwrap();
    match ops::gather_qmm(&x, &q, None, None, true, false) {
        Err(Error::Mlx { op, msg }) => {
            assert_eq!(op, "gather_qmm");
            assert!(!msg.is_empty() && !msg.contains("status") && !msg.contains(".cpp:"), "{msg}");
        }
        other => panic!("expected an MLX error, got {other:?}"),
    }
    // mlx-rs calls still report their own messages afterwards.
    match x.matmul(&x) {
        Err(Error::Mlx { msg, .. }) => assert!(msg.contains("must match"), "{msg}"),
        other => panic!("{other:?}"),
    }

    // 2. eval / async_eval compute lazily built graphs.
    let a = Array::arange(0, 1000, DType::F32).unwrap();
    let b = a.mul_scalar(2.0).unwrap();
    let c = b.sum(&[], false).unwrap();
    let d = a.square().unwrap().sum(&[], false).unwrap();
    async_eval(&[&c, &d]).unwrap();
    assert_eq!(c.item::<f32>().unwrap(), 999_000.0);
    eval(&[&b, &d]).unwrap();
    assert_eq!(d.item::<f32>().unwrap(), (0..1000u64).map(|i| (i * i) as f32).sum::<f32>());

    // 3. Memory counters move with a 16 MiB array.
    memory::clear_cache().unwrap();
    memory::reset_peak().unwrap();
    let before = memory::active().unwrap();
    let big = Array::ones(&[4 << 20], DType::F32).unwrap().mul_scalar(3.0).unwrap();
    big.eval().unwrap();
    let during = memory::active().unwrap();
    assert!(during >= before + (16 << 20), "active {before} -> {during}");
    assert!(memory::peak().unwrap() >= during);
    drop(big);
    let after = memory::active().unwrap();
    assert!(after + (16 << 20) <= during, "dropping frees: {during} -> {after}");
    assert!(memory::cache().unwrap() >= 16 << 20, "freed buffers go to the cache");
    memory::clear_cache().unwrap();
    assert_eq!(memory::cache().unwrap(), 0);
    memory::reset_peak().unwrap();
    assert!(memory::peak().unwrap() < during, "reset_peak forgets the old peak");
    let old = memory::set_cache_limit(1 << 20).unwrap();
    assert_eq!(memory::set_cache_limit(old).unwrap(), 1 << 20);
}
