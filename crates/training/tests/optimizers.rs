//! The optimizers on fixed gradients against torch (values from
//! scripts/make_training_reference.py, within 1e-6 absolute), clipping, schedules and
//! configuration errors.
mod common;

use common::*;
use mlx_array::Array;
use mlx_training::{clip_gradients, AdamWConfig, ClipConfig, Optimizer, OptimizerConfig, Schedule, ScheduleKind, SgdConfig, TrainError};

fn vecf(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

#[test]
fn optimizers_match_torch_on_fixed_gradients() {
    let (meta, _) = reference();
    let u = &meta["unit"];
    let p0 = vecf(&u["p0"]);
    let grads: Vec<Vec<f32>> = u["grads"].as_array().unwrap().iter().map(vecf).collect();
    let cases = [
        ("adamw", OptimizerConfig::AdamW(AdamWConfig::default()), 0.05),
        ("adamw_wd0.1", OptimizerConfig::AdamW(AdamWConfig { beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.1 }), 0.05),
        ("sgd", OptimizerConfig::Sgd(SgdConfig::default()), 0.1),
        ("sgd_momentum", OptimizerConfig::Sgd(SgdConfig { momentum: 0.9, dampening: 0.1, weight_decay: 0.01 }), 0.1),
    ];
    for (tag, cfg, lr) in cases {
        let mut opt = Optimizer::new(cfg).unwrap();
        let mut p = Array::from_slice(&p0, &[2, 3]).unwrap();
        for g in &grads {
            p = opt.update(&["w"], &[p], &[Array::from_slice(g, &[2, 3]).unwrap()], lr).unwrap().remove(0);
        }
        assert_eq!(opt.step(), 3);
        let e = max_abs(&f32s(&p), &vecf(&u[tag]));
        assert!(e < 1e-6, "{tag}: max abs difference {e:e} from torch");
    }
}

#[test]
fn update_rejects_mismatched_inputs() {
    let mut opt = Optimizer::new(OptimizerConfig::default()).unwrap();
    let p = Array::zeros(&[2, 2], mlx_array::DType::F32).unwrap();
    let g = Array::zeros(&[4], mlx_array::DType::F32).unwrap();
    assert!(matches!(opt.update(&["w"], std::slice::from_ref(&p), &[g], 0.1), Err(TrainError::InvalidInput(_))));
    assert!(matches!(opt.update(&["w", "x"], std::slice::from_ref(&p), std::slice::from_ref(&p), 0.1), Err(TrainError::InvalidInput(_))));
    assert!(matches!(opt.update(&["w"], std::slice::from_ref(&p), std::slice::from_ref(&p), f64::NAN), Err(TrainError::Config(_))));
    assert_eq!(opt.step(), 0, "nothing applied");
    assert!(matches!(Optimizer::new(OptimizerConfig::AdamW(AdamWConfig { beta1: 1.0, ..Default::default() })), Err(TrainError::Config(_))));
    assert!(matches!(Optimizer::new(OptimizerConfig::Sgd(SgdConfig { momentum: -0.1, ..Default::default() })), Err(TrainError::Config(_))));
}

#[test]
fn clipping_by_norm_and_by_value() {
    let g = vec![Array::from_slice(&[3f32, 0.], &[2]).unwrap(), Array::from_slice(&[0f32, 4.], &[2]).unwrap()];
    let (c, norm) = clip_gradients(g.clone(), &ClipConfig { max_norm: Some(1.0), max_value: None }).unwrap();
    assert_eq!(norm, 5.0);
    let scale = 1.0 / (5.0 + 1e-6);
    assert!(max_abs(&f32s(&c[0]), &[3.0 * scale, 0.]) < 1e-7 && max_abs(&f32s(&c[1]), &[0., 4.0 * scale]) < 1e-7);
    let (c, norm) = clip_gradients(g.clone(), &ClipConfig { max_norm: Some(10.0), max_value: None }).unwrap();
    assert_eq!((f32s(&c[0]), norm), (vec![3., 0.], 5.0), "below the threshold: unchanged");
    let (c, norm) = clip_gradients(g.clone(), &ClipConfig { max_norm: None, max_value: Some(2.0) }).unwrap();
    assert_eq!((f32s(&c[0]), f32s(&c[1])), (vec![2., 0.], vec![0., 2.]));
    assert!((norm - 8f32.sqrt()).abs() < 1e-6, "norm measured after value clipping");
    assert!(matches!(clip_gradients(g.clone(), &ClipConfig { max_norm: Some(0.0), max_value: None }), Err(TrainError::Config(_))));
    assert!(matches!(clip_gradients(g, &ClipConfig { max_norm: None, max_value: Some(-1.0) }), Err(TrainError::Config(_))));
}

#[test]
fn schedules() {
    let c = Schedule::default();
    assert_eq!((c.lr_at(0), c.lr_at(1000)), (1e-5, 1e-5), "constant by default, no warm-up");
    let w = Schedule { lr: 1.0, warmup_steps: 4, ..Default::default() };
    assert_eq!((0..6).map(|s| w.lr_at(s)).collect::<Vec<_>>(), vec![0.0, 0.25, 0.5, 0.75, 1.0, 1.0]);
    let cos = Schedule { lr: 1.0, warmup_steps: 2, kind: ScheduleKind::Cosine { min_lr: 0.1 }, total_steps: 6 };
    cos.validate().unwrap();
    assert_eq!(cos.lr_at(1), 0.5);
    assert_eq!(cos.lr_at(2), 1.0);
    assert!((cos.lr_at(4) - 0.55).abs() < 1e-12, "half way: {}", cos.lr_at(4));
    assert!((cos.lr_at(6) - 0.1).abs() < 1e-12 && (cos.lr_at(60) - 0.1).abs() < 1e-12);
    assert!(Schedule { total_steps: 2, ..cos }.validate().is_err());
    assert!(Schedule { kind: ScheduleKind::Cosine { min_lr: 2.0 }, ..cos }.validate().is_err());
    assert!(Schedule { lr: -1.0, ..Default::default() }.validate().is_err());
}

/// The rate of every update against transformers' schedules (`get_constant_schedule_with_warmup`,
/// `get_cosine_schedule_with_warmup`, `get_cosine_with_min_lr_schedule_with_warmup`, as its
/// Trainer applies them: update 0 at the scheduler's first value, 0 during a warm-up), from
/// scripts/make_schedule_reference.py, within 1e-12 relative.
#[test]
fn schedules_match_transformers() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/schedule_reference.json");
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for c in cases {
        let (lr, total) = (c["lr"].as_f64().unwrap(), c["total_steps"].as_u64().unwrap());
        let kind = match c["min_lr"].as_f64() {
            Some(min_lr) => ScheduleKind::Cosine { min_lr },
            None => ScheduleKind::Constant,
        };
        let s = Schedule { lr, warmup_steps: c["warmup_steps"].as_u64().unwrap(), kind, total_steps: total };
        s.validate().unwrap();
        let want = vecf64(&c["rates"]);
        assert_eq!(want.len() as u64, total);
        for (step, w) in want.iter().enumerate() {
            let got = s.lr_at(step as u64);
            assert!((got - w).abs() <= 1e-12 * lr, "{}: update {step}: {got} vs transformers {w}", c["name"]);
        }
    }
}

fn vecf64(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}
