//! GRPO's NaN guard: a step whose loss is not finite (here: NaN recorded old log-probs) is
//! skipped with the parameters and optimizer untouched and counted; past `max_nan_gradients`
//! skipped steps the run stops with `TrainError::NanGradients`, the trainer still holding the
//! last finite parameters, which save as a loadable (emergency) checkpoint.
mod common;

use common::*;
use mlx_training::{GrpoBatch, GrpoConfig, GrpoTrainer, TrainError};

fn batch(nan: bool) -> GrpoBatch {
    let rows = vec![
        (vec![3, 17, 99], vec![250, 8, 61]),
        (vec![3, 17, 99], vec![300, 301]),
        (vec![3, 17, 99], vec![5, 6, 7, 8]),
        (vec![3, 17, 99], vec![11]),
    ];
    nan_old_logprobs(GrpoBatch::single_reward(rows, &[0.5, 1.0, 0.0, 0.25]).unwrap(), nan)
}

#[test]
fn nan_steps_are_skipped_then_the_run_stops() {
    let cfg = GrpoConfig {
        max_nan_gradients: 2,
        schedule: mlx_training::Schedule {
            lr: 1e-3,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut t = GrpoTrainer::new(qwen3_tree(), None, &f32_options(), cfg).unwrap();
    let m = t.step(&batch(false)).unwrap();
    assert!(!m.skipped && m.step == 1 && m.loss.is_finite());
    let snapshot: Vec<Vec<f32>> = t.tree().trainable_arrays().iter().map(f32s).collect();
    for k in 1..=2 {
        let m = t.step(&batch(true)).unwrap();
        assert!(m.skipped && m.step == 1, "skipped step {k}: {m:?}");
        assert_eq!(t.nan_skipped(), k);
        assert_eq!(t.optimizer().step(), 1, "the optimizer did not move");
    }
    let after: Vec<Vec<f32>> = t.tree().trainable_arrays().iter().map(f32s).collect();
    assert_eq!(
        after, snapshot,
        "skipped steps leave the parameters as they were"
    );
    match t.step(&batch(true)) {
        Err(TrainError::NanGradients { skipped: 3, max: 2 }) => {}
        other => panic!("expected NanGradients, got {:?}", other.map(|m| m.step)),
    }
    // the emergency checkpoint holds the last finite parameters
    let dir = tempfile::tempdir().unwrap();
    t.save(&dir.path().join("emergency"), None).unwrap();
    let saved =
        mlx_models::ParameterTree::load(dir.path().join("emergency"), &f32_options()).unwrap();
    for (n, p) in t.tree().iter() {
        assert_eq!(f32s(&saved.get(n).unwrap().array), f32s(&p.array), "{n}");
    }
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("emergency/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (state["step"].as_u64(), state["nan_skipped"].as_u64()),
        (Some(1), Some(3))
    );
    // past the limit, every further non-finite step fails too
    assert!(matches!(
        t.step(&batch(true)),
        Err(TrainError::NanGradients { .. })
    ));
}
