//! The NaN-gradient guard in SFT: non-finite updates are skipped (parameters and optimizer
//! untouched), counted across a checkpoint, and the run stops with a typed error after
//! `max_nan_gradients`.
mod common;

use common::*;
use mlx_array::Array;
use mlx_training::guard::{NanGuard, Verdict};
use mlx_training::{ClipConfig, SftConfig, SftTrainer, TrainError};

#[test]
fn guard_counts_and_stops() {
    let mut g = NanGuard::new(2);
    assert_eq!(g.check(1.0, 1.0), Verdict::Apply);
    assert_eq!(g.check(f32::NAN, 1.0), Verdict::Skip { skipped: 1 });
    assert_eq!(g.check(1.0, f32::NEG_INFINITY), Verdict::Skip { skipped: 2 });
    assert!(g.stop_error().is_ok());
    assert_eq!(g.check(1.0, 2.0), Verdict::Apply, "finite updates do not reset or add");
    assert_eq!(g.check(1.0, f32::NAN), Verdict::Stop { skipped: 3 });
    assert!(matches!(g.stop_error(), Err(TrainError::NanGradients { skipped: 3, max: 2 })));
    assert_eq!(NanGuard::new(0).check(f32::INFINITY, 0.0), Verdict::Stop { skipped: 1 });
    assert_eq!(NanGuard::new(5).with_skipped(5).check(f32::NAN, 0.0), Verdict::Stop { skipped: 6 });
}

/// A NaN in a trained norm weight makes every gradient non-finite: each update is skipped with
/// the parameters unchanged, and the third stops the run (max 2); a checkpoint written after
/// the skips carries the count and a resumed run stops at the next one. Clipping by value
/// (which would turn infinities finite) does not hide them.
#[test]
fn sft_skips_non_finite_updates_and_stops() {
    let (meta, _) = reference();
    let examples = reference_batches(&meta).concat();
    for clip in [ClipConfig { max_norm: Some(1.0), max_value: None }, ClipConfig { max_norm: None, max_value: Some(0.1) }] {
        let mut tree = qwen3_tree();
        tree.freeze(|n| !n.contains("norm"));
        let name = "model.layers.1.input_layernorm.weight";
        let w = f32s(&tree.get(name).unwrap().array);
        let mut bad = w.clone();
        bad[3] = f32::NAN;
        tree.set(name, Array::from_slice(&bad, &[bad.len()]).unwrap()).unwrap();
        let before: Vec<Vec<f32>> = tree.trainable_arrays().iter().map(f32s).collect();
        let cfg = SftConfig { batch_size: 2, max_steps: Some(10), max_nan_gradients: 2, clip, ..Default::default() };
        let mut t = SftTrainer::new(tree, &f32_options(), examples.clone(), cfg.clone()).unwrap();
        for k in 1..=2 {
            let m = t.step().unwrap().unwrap();
            assert!(m.skipped && !(m.grad_norm.is_finite() && m.loss.is_finite()), "{m:?}");
            assert_eq!((m.step, t.steps_done(), t.nan_skipped()), (0, 0, k));
        }
        let after: Vec<Vec<f32>> = t.tree().trainable_arrays().iter().map(f32s).collect();
        assert_eq!(format!("{before:?}"), format!("{after:?}"), "skipped updates change nothing");
        let dir = tempfile::tempdir().unwrap();
        t.save(dir.path(), None).unwrap();
        let err = t.step().unwrap_err();
        assert!(matches!(err, TrainError::NanGradients { skipped: 3, max: 2 }), "{err}");
        let mut r = SftTrainer::resume(dir.path(), &f32_options(), examples.clone(), cfg).unwrap();
        assert_eq!(r.nan_skipped(), 2);
        assert!(matches!(r.step(), Err(TrainError::NanGradients { skipped: 3, .. })));
    }
}
