//! GRPO resume, in one process (the `grpo` example's resume in a new process is in
//! grpo_cli.rs): N steps in one run give bit-identical parameters, optimizer state and losses to
//! k steps, a checkpoint, a trainer resumed from it and N - k steps (f32, CPU), with the KL term
//! on (the resumed reference model is the original one, not the weights at the save) and a
//! skipped non-finite step before the save (the NaN-guard count and the data position carry
//! over); resuming with another data layout, another optimizer, or a KL term the checkpoint
//! has no reference for is refused.
mod common;

use common::*;
use mlx_training::{
    ClipConfig, GrpoBatch, GrpoConfig, GrpoData, GrpoTrainer, OptimizerConfig, OutputRun, Schedule,
    ScheduleKind, SgdConfig,
};

/// One group of two completions of prompt `k`; `nan` gives NaN old log-probs (a non-finite loss).
fn batch(k: u64, nan: bool) -> GrpoBatch {
    let p = vec![3 + k as u32, 17, 99];
    let rows = vec![
        (p.clone(), vec![250 + k as u32, 8, 61]),
        (p.clone(), vec![300, 301 + 2 * k as u32]),
    ];
    nan_old_logprobs(GrpoBatch::single_reward(rows, &[0.3 * k as f64, 1.0]).unwrap(), nan)
}

fn config(optimizer: OptimizerConfig, beta: f64) -> GrpoConfig {
    GrpoConfig {
        group_size: 2,
        beta,
        optimizer,
        schedule: Schedule {
            lr: 1e-2,
            warmup_steps: 1,
            kind: ScheduleKind::Cosine { min_lr: 1e-3 },
            total_steps: 6,
        },
        clip: ClipConfig {
            max_norm: Some(1.0),
            max_value: None,
        },
        ..Default::default()
    }
}

const DATA: GrpoData = GrpoData {
    items: 3,
    per_step: 2,
    seed: 11,
};

/// The batch of step `s` (0-based; step 1 is non-finite).
fn batch_of(t: &GrpoTrainer) -> GrpoBatch {
    let s = t.batches_done();
    assert_eq!(
        t.next_items().unwrap(),
        vec![(2 * s as usize) % 3, (2 * s as usize + 1) % 3]
    );
    assert_eq!(t.sampling_seed(), Some(11 + s));
    batch(s, s == 1)
}

fn bits(t: &mlx_models::ParameterTree) -> Vec<(String, Vec<u32>)> {
    t.iter()
        .map(|(n, p)| {
            (
                n.to_string(),
                f32s(&p.array).iter().map(|x| x.to_bits()).collect(),
            )
        })
        .collect()
}

fn resume_case(optimizer: OptimizerConfig) {
    let cfg = config(optimizer, 0.05);
    let mut tree = qwen3_tree();
    tree.freeze(|n| n.contains("embed_tokens"));
    let initial = bits(&tree);
    let n = 5;
    let mut whole = GrpoTrainer::new(tree.clone(), None, &f32_options(), cfg.clone())
        .unwrap()
        .with_data(DATA)
        .unwrap();
    let mut losses = Vec::new();
    for _ in 0..n {
        let b = batch_of(&whole);
        let m = whole.step(&b).unwrap();
        losses.push((m.loss.to_bits(), m.kl.map(f64::to_bits), m.skipped));
    }
    assert_eq!(
        (
            whole.steps_done(),
            whole.batches_done(),
            whole.nan_skipped()
        ),
        (4, 5, 1)
    );

    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("run");
    let mut first = GrpoTrainer::new(tree, None, &f32_options(), cfg.clone())
        .unwrap()
        .with_data(DATA)
        .unwrap();
    for _ in 0..3 {
        let b = batch_of(&first);
        first.step(&b).unwrap();
    }
    let output = OutputRun {
        store: dir.path().join("store.sqlite"),
        run_id: 7,
    };
    first.set_output_run(Some(output.clone()));
    first.save(&ckpt, None).unwrap();
    assert_ne!(
        bits(first.tree()),
        initial,
        "the policy moved before the save"
    );
    drop(first);

    let mut second = GrpoTrainer::resume(&ckpt, &f32_options(), cfg.clone(), Some(DATA)).unwrap();
    assert_eq!(
        (
            second.steps_done(),
            second.batches_done(),
            second.nan_skipped()
        ),
        (2, 3, 1)
    );
    assert_eq!(second.output_run(), Some(&output));
    assert_eq!(
        bits(second.reference().unwrap()),
        initial,
        "the reference is the initial model"
    );
    assert!(
        second
            .tree()
            .get("model.embed_tokens.weight")
            .is_some_and(|p| !p.trainable),
        "frozen marks restored"
    );
    let mut resumed = Vec::new();
    for _ in 3..n {
        let b = batch_of(&second);
        let m = second.step(&b).unwrap();
        resumed.push((m.loss.to_bits(), m.kl.map(f64::to_bits), m.skipped));
    }
    assert_eq!(
        resumed,
        losses[3..],
        "{optimizer:?}: losses and KL after resume"
    );
    assert_eq!(
        bits(second.tree()),
        bits(whole.tree()),
        "{optimizer:?}: parameters bit-identical"
    );
    assert_eq!(second.optimizer().step(), whole.optimizer().step());
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    second.save(&a, None).unwrap();
    whole.save(&b, None).unwrap();
    for f in [
        "model.safetensors",
        "optimizer.safetensors",
        "reference.safetensors",
        "trainer_state.json",
    ] {
        assert!(
            std::fs::read(a.join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(),
            "{optimizer:?}: {f} differs"
        );
    }
}

#[test]
fn grpo_resume_is_bit_exact_adamw() {
    resume_case(OptimizerConfig::default());
}

#[test]
fn grpo_resume_is_bit_exact_sgd_momentum() {
    resume_case(OptimizerConfig::Sgd(SgdConfig {
        momentum: 0.9,
        ..Default::default()
    }));
}

#[test]
fn grpo_resume_refuses_another_run() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("run");
    let cfg = config(OptimizerConfig::default(), 0.0);
    let mut t = GrpoTrainer::new(qwen3_tree(), None, &f32_options(), cfg.clone())
        .unwrap()
        .with_data(DATA)
        .unwrap();
    t.step(&batch(0, false)).unwrap();
    t.save(&ckpt, None).unwrap();
    assert!(
        !ckpt.join("reference.safetensors").exists(),
        "no reference without the KL term"
    );
    let r = GrpoTrainer::resume(&ckpt, &f32_options(), cfg.clone(), Some(DATA)).unwrap();
    assert_eq!((r.steps_done(), r.batches_done()), (1, 1));
    let other_data = GrpoData {
        per_step: 1,
        ..DATA
    };
    assert!(
        GrpoTrainer::resume(&ckpt, &f32_options(), cfg.clone(), Some(other_data)).is_err(),
        "other data layout"
    );
    assert!(
        GrpoTrainer::resume(&ckpt, &f32_options(), cfg.clone(), None).is_err(),
        "no data layout"
    );
    let sgd = GrpoConfig {
        optimizer: OptimizerConfig::Sgd(SgdConfig::default()),
        ..cfg.clone()
    };
    assert!(
        GrpoTrainer::resume(&ckpt, &f32_options(), sgd, Some(DATA)).is_err(),
        "other optimizer"
    );
    let err = GrpoTrainer::resume(
        &ckpt,
        &f32_options(),
        GrpoConfig {
            beta: 0.1,
            ..cfg.clone()
        },
        Some(DATA),
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("reference"), "{err}");
    assert!(GrpoTrainer::resume(
        &dir.path().join("nothing"),
        &f32_options(),
        cfg.clone(),
        Some(DATA)
    )
    .is_err());
    // a save interrupted between its two renames leaves `<dir>.previous`, which resume finds
    std::fs::rename(&ckpt, dir.path().join("run.previous")).unwrap();
    let r = GrpoTrainer::resume(&ckpt, &f32_options(), cfg, Some(DATA)).unwrap();
    assert_eq!(r.steps_done(), 1);
}

/// LoRA: the checkpoint holds the adapters (not the model) and, with the KL term, a reference
/// file of only (changed) initial adapters; resuming over the base model continues bit-exactly.
#[test]
fn grpo_lora_resume_is_bit_exact() {
    let lora = mlx_training::LoraConfig {
        rank: 2,
        num_layers: 0,
        seed: 3,
        ..Default::default()
    };
    let cfg = config(OptimizerConfig::default(), 0.05);
    let mut tree = qwen3_tree();
    mlx_training::apply_lora(&mut tree, &lora).unwrap();
    let initial_adapters: Vec<(String, Vec<u32>)> = bits(&tree)
        .into_iter()
        .filter(|(n, _)| n.contains(".lora_"))
        .collect();
    let make = |t: &mlx_models::ParameterTree| {
        GrpoTrainer::new(t.clone(), None, &f32_options(), cfg.clone())
            .unwrap()
            .with_data(DATA)
            .unwrap()
            .with_lora(lora.clone())
            .unwrap()
    };
    let mut whole = make(&tree);
    for _ in 0..5 {
        let b = batch_of(&whole);
        whole.step(&b).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("run");
    let mut first = make(&tree);
    for _ in 0..3 {
        let b = batch_of(&first);
        first.step(&b).unwrap();
    }
    first.save(&ckpt, None).unwrap();
    assert!(
        ckpt.join("adapters.safetensors").is_file() && !ckpt.join("model.safetensors").exists()
    );
    let reference =
        mlx_array::io::load_safetensors(ckpt.join("reference.safetensors"), None).unwrap();
    assert!(
        !reference.is_empty() && reference.keys().all(|n| n.contains(".lora_")),
        "the reference file holds initial adapters only"
    );
    assert!(
        GrpoTrainer::resume(&ckpt, &f32_options(), cfg.clone(), Some(DATA)).is_err(),
        "a LoRA checkpoint needs its base model"
    );
    let mut second = GrpoTrainer::resume_with_base(
        &ckpt,
        Some(qwen3_tree()),
        &f32_options(),
        cfg.clone(),
        Some(DATA),
    )
    .unwrap();
    let ref_adapters: Vec<(String, Vec<u32>)> = bits(second.reference().unwrap())
        .into_iter()
        .filter(|(n, _)| n.contains(".lora_"))
        .collect();
    assert_eq!(
        ref_adapters, initial_adapters,
        "the reference keeps the initial adapters"
    );
    for _ in 3..5 {
        let b = batch_of(&second);
        second.step(&b).unwrap();
    }
    assert_eq!(
        bits(second.tree()),
        bits(whole.tree()),
        "parameters bit-identical"
    );
    // the resumed run saves as a LoRA run, the same files as the uninterrupted one
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    second.save(&a, None).unwrap();
    whole.save(&b, None).unwrap();
    for f in [
        "adapters.safetensors",
        "optimizer.safetensors",
        "reference.safetensors",
        "trainer_state.json",
    ] {
        assert!(
            std::fs::read(a.join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(),
            "{f} differs"
        );
    }
    // adapters with dropout are refused (GRPO does not draw dropout masks)
    let mut dropped = qwen3_tree();
    let with_dropout = mlx_training::LoraConfig {
        dropout: 0.1,
        ..lora.clone()
    };
    mlx_training::apply_lora(&mut dropped, &with_dropout).unwrap();
    assert!(GrpoTrainer::new(dropped, None, &f32_options(), cfg.clone())
        .unwrap()
        .with_lora(with_dropout)
        .is_err());
    // a LoRA tree saves only with its config
    assert!(GrpoTrainer::new(tree, None, &f32_options(), cfg)
        .unwrap()
        .save(&dir.path().join("x"), None)
        .is_err());
}

/// A checkpoint with the weights cast to bf16 still resumes with the original (f32) reference
/// model, frozen parameters included.
#[test]
fn grpo_reference_survives_a_cast_save() {
    let cfg = config(OptimizerConfig::default(), 0.05);
    let mut tree = qwen3_tree();
    // weights that bf16 does not represent exactly
    let e = tree
        .get("model.embed_tokens.weight")
        .unwrap()
        .array
        .mul_scalar(1.0 + 1.0 / 3000.0)
        .unwrap();
    tree.set("model.embed_tokens.weight", e).unwrap();
    tree.freeze(|n| n.contains("embed_tokens"));
    let initial = bits(&tree);
    let mut t = GrpoTrainer::new(tree, None, &f32_options(), cfg.clone())
        .unwrap()
        .with_data(DATA)
        .unwrap();
    for _ in 0..3 {
        let b = batch_of(&t);
        t.step(&b).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    t.save(&dir.path().join("c"), Some(mlx_array::DType::BF16))
        .unwrap();
    let r = GrpoTrainer::resume(&dir.path().join("c"), &f32_options(), cfg, Some(DATA)).unwrap();
    assert_eq!(bits(r.reference().unwrap()), initial);
    assert_ne!(
        bits(r.tree()),
        bits(t.tree()),
        "the policy continues from the cast weights"
    );
}
