//! AdamW's update as one compiled kernel (`CpuFusion::On`, which needs g++) gives bit for bit
//! the parameters of the same ops run one by one (`CpuFusion::Off`, what the torch reference
//! test checks), in f32 and bf16; a prepared update that is not committed changes nothing; a
//! column-major parameter updates to the values its row-major copy does and keeps its layout.
//! Its own test binary: the fusion setting is process-wide.
use mlx_array::ops::{set_cpu_fusion, CpuFusion};
use mlx_array::{Array, DType};
use mlx_training::{AdamWConfig, Optimizer, OptimizerConfig, SgdConfig};
use std::sync::Mutex;

/// Held while a test relies on the fusion setting.
static FUSION: Mutex<()> = Mutex::new(());

/// `n` values in [-scale, scale) from a fixed xorshift generator.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Parameters (as f32 bits) after three AdamW updates of two tensors in `dtype`.
fn three_updates(fusion: CpuFusion, dtype: DType) -> Vec<Vec<u32>> {
    set_cpu_fusion(fusion);
    let cfg = OptimizerConfig::AdamW(AdamWConfig {
        beta1: 0.8,
        beta2: 0.99,
        eps: 1e-6,
        weight_decay: 0.1,
    });
    let mut opt = Optimizer::new(cfg).unwrap();
    let shapes: [&[usize]; 2] = [&[48, 80], &[80]];
    let mut params: Vec<Array> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            Array::from_slice(&values(s.iter().product(), i as u64, 1.0), s)
                .unwrap()
                .astype(dtype)
                .unwrap()
        })
        .collect();
    for step in 0..3u64 {
        let grads: Vec<Array> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                Array::from_slice(
                    &values(s.iter().product(), 100 + 10 * step + i as u64, 0.3),
                    s,
                )
                .unwrap()
                .astype(dtype)
                .unwrap()
            })
            .collect();
        params = opt.update(&["a", "b"], &params, &grads, 1e-2).unwrap();
    }
    set_cpu_fusion(CpuFusion::Off);
    params
        .iter()
        .map(|p| {
            p.astype(DType::F32)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

#[test]
fn fused_adamw_is_bit_identical_to_plain_ops() {
    let _held = FUSION.lock().unwrap_or_else(|e| e.into_inner());
    for dtype in [DType::F32, DType::BF16] {
        let plain = three_updates(CpuFusion::Off, dtype);
        let fused = three_updates(CpuFusion::On, dtype);
        for (i, (p, f)) in plain.iter().zip(&fused).enumerate() {
            let differ = p.iter().zip(f).filter(|(a, b)| a != b).count();
            assert_eq!(
                differ,
                0,
                "{dtype:?} tensor {i}: {differ} of {} values differ",
                p.len()
            );
        }
    }
}

#[test]
fn prepared_update_changes_nothing_until_committed() {
    let _held = FUSION.lock().unwrap_or_else(|e| e.into_inner());
    let p = [Array::from_slice(&values(12, 1, 1.0), &[3, 4]).unwrap()];
    let g = [Array::from_slice(&values(12, 2, 0.3), &[3, 4]).unwrap()];
    let mut opt = Optimizer::new(OptimizerConfig::default()).unwrap();
    drop(opt.prepare(&["w"], &p, &g, 1e-2).unwrap());
    assert_eq!(opt.step(), 0);
    let after = opt.update(&["w"], &p, &g, 1e-2).unwrap();
    let mut fresh = Optimizer::new(OptimizerConfig::default()).unwrap();
    let want = fresh.update(&["w"], &p, &g, 1e-2).unwrap();
    assert_eq!(
        after[0].to_vec::<f32>().unwrap(),
        want[0].to_vec::<f32>().unwrap()
    );
    assert_eq!(opt.step(), 1);
}

/// A `[rows, cols]` matrix of `v` stored column-major (evaluated), and the same values row-major.
fn both_layouts(v: &[f32], rows: usize, cols: usize) -> (Array, Array) {
    let col = Array::from_slice(v, &[cols, rows])
        .unwrap()
        .transpose(&[1, 0])
        .unwrap();
    let row = col
        .reshape(&[-1])
        .unwrap()
        .reshape(&[rows as i32, cols as i32])
        .unwrap();
    mlx_array::eval(&[&col, &row]).unwrap();
    (col, row)
}

#[test]
fn column_major_parameters_update_to_the_same_values_and_keep_their_layout() {
    let _held = FUSION.lock().unwrap_or_else(|e| e.into_inner());
    let (rows, cols) = (24, 40);
    for cfg in [
        OptimizerConfig::default(),
        OptimizerConfig::Sgd(SgdConfig {
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
        }),
    ] {
        let (mut pc, mut pr) = both_layouts(&values(rows * cols, 7, 1.0), rows, cols);
        assert_eq!(pc.as_mlx().strides(), [1, rows]);
        let (mut oc, mut or) = (Optimizer::new(cfg).unwrap(), Optimizer::new(cfg).unwrap());
        for step in 0..3 {
            // gradients column-major, as a linear weight's come
            let (gc, _) = both_layouts(&values(rows * cols, 20 + step, 0.3), rows, cols);
            pc = oc
                .update(&["w"], &[pc], std::slice::from_ref(&gc), 1e-2)
                .unwrap()
                .remove(0);
            pr = or.update(&["w"], &[pr], &[gc], 1e-2).unwrap().remove(0);
            assert_eq!(
                pc.as_mlx().strides(),
                [1, rows],
                "{cfg:?}: the parameter keeps its layout"
            );
            assert_eq!(
                pr.as_mlx().strides(),
                [cols, 1],
                "{cfg:?}: the parameter keeps its layout"
            );
        }
        let bits = |a: &Array| {
            a.to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            bits(&pc),
            bits(&pr),
            "{cfg:?}: same values in either layout"
        );
    }
}
