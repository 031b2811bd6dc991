//! Exact resume: N updates in one run give bit-identical parameters and optimizer state to k
//! updates, a checkpoint saved to disk, a new trainer loaded from it, and N - k updates (f32,
//! CPU; shuffled data over two epochs, the save falling inside the second). Plus the state
//! file's layout and metadata, and gradient accumulation with an epoch's leftover micro-batch.
mod common;

use common::*;
use mlx_array::io::SafetensorsFile;
use mlx_training::state::{resolve_checkpoint, OPTIMIZER_FILE, TRAINER_STATE_FILE};
use mlx_training::{ClipConfig, Example, OptimizerConfig, Schedule, ScheduleKind, SftConfig, SftTrainer, SgdConfig};

fn examples() -> Vec<Example> {
    (0..5u32).map(|i| Example::prompt_completion(&[3 + i, 17, 99 + i], &(0..(2 + i % 3)).map(|j| 40 + 13 * i + j).collect::<Vec<_>>())).collect()
}

fn config(optimizer: OptimizerConfig) -> SftConfig {
    SftConfig {
        batch_size: 2,
        epochs: 2,
        seed: 7,
        optimizer,
        schedule: Schedule { lr: 1e-2, warmup_steps: 2, kind: ScheduleKind::Cosine { min_lr: 1e-3 }, total_steps: 6 },
        clip: ClipConfig { max_norm: Some(1.0), max_value: None },
        ..Default::default()
    }
}

fn snapshot(t: &SftTrainer) -> Vec<(String, Vec<u32>)> {
    t.tree().iter().map(|(n, p)| (n.to_string(), f32s(&p.array).iter().map(|x| x.to_bits()).collect())).collect()
}

fn resume_case(optimizer: OptimizerConfig) {
    let cfg = config(optimizer);
    let mut tree = qwen3_tree();
    tree.freeze(|n| n.contains("embed_tokens"));
    let mut whole = SftTrainer::new(tree.clone(), &f32_options(), examples(), cfg.clone()).unwrap();
    assert_eq!(whole.total_steps(), 6);
    let mut losses = Vec::new();
    while let Some(m) = whole.step().unwrap() {
        losses.push(m.loss.to_bits());
    }
    assert_eq!(whole.steps_done(), 6);

    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("run");
    let mut first = SftTrainer::new(tree, &f32_options(), examples(), cfg.clone()).unwrap();
    for _ in 0..4 {
        first.step().unwrap().unwrap();
    }
    first.save(&ckpt, None).unwrap();
    drop(first);
    let mut second = SftTrainer::resume(&ckpt, &f32_options(), examples(), cfg.clone()).unwrap();
    assert_eq!(second.steps_done(), 4);
    let mut resumed_losses = Vec::new();
    while let Some(m) = second.step().unwrap() {
        resumed_losses.push(m.loss.to_bits());
    }
    assert_eq!(resumed_losses, losses[4..], "{optimizer:?}: losses after resume");
    assert_eq!(snapshot(&second), snapshot(&whole), "{optimizer:?}: parameters bit-identical");
    assert!(second.tree().get("model.embed_tokens.weight").is_some_and(|p| !p.trainable), "frozen marks restored");
    // a second save over the first replaces it completely
    second.save(&ckpt, None).unwrap();
    assert_eq!(mlx_training::state::read_trainer_state(&ckpt).unwrap().step, 6);
    assert!(!dir.path().join("run.previous").exists());
}

#[test]
fn resume_is_bit_exact_adamw() {
    resume_case(OptimizerConfig::default());
}

#[test]
fn resume_is_bit_exact_sgd_momentum() {
    resume_case(OptimizerConfig::Sgd(SgdConfig { momentum: 0.9, ..Default::default() }));
}

/// mlx-node's layout: `{param}.m` / `{param}.v` for every trained parameter, metadata `step` and
/// `format=adamw_optimizer_state`; SGD with momentum: `{param}.momentum`; nothing before the
/// first update, nothing for plain SGD.
#[test]
fn optimizer_state_file_layout() {
    let dir = tempfile::tempdir().unwrap();
    let mut tree = qwen3_tree();
    tree.freeze(|n| !n.contains("layers.1."));
    let trained: Vec<String> = tree.trainable_names().iter().map(|s| s.to_string()).collect();
    for (optimizer, format, suffixes) in [
        (OptimizerConfig::default(), Some("adamw_optimizer_state"), vec!["m", "v"]),
        (OptimizerConfig::Sgd(SgdConfig { momentum: 0.5, ..Default::default() }), Some("sgd_momentum_optimizer_state"), vec!["momentum"]),
        (OptimizerConfig::Sgd(SgdConfig::default()), None, vec![]),
    ] {
        let mut t = SftTrainer::new(tree.clone(), &f32_options(), examples(), SftConfig { batch_size: 2, optimizer, ..Default::default() }).unwrap();
        let out = dir.path().join("ckpt");
        t.save(&out, None).unwrap();
        assert!(!out.join(OPTIMIZER_FILE).exists(), "no optimizer state before the first update");
        t.step().unwrap().unwrap();
        t.step().unwrap().unwrap();
        t.save(&out, None).unwrap();
        for f in ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", TRAINER_STATE_FILE] {
            assert!(out.join(f).is_file(), "{f} written");
        }
        let Some(format) = format else {
            assert!(!out.join(OPTIMIZER_FILE).exists(), "plain SGD has no state");
            continue;
        };
        let file = SafetensorsFile::open(out.join(OPTIMIZER_FILE)).unwrap();
        assert_eq!(file.metadata().get("format").map(String::as_str), Some(format));
        assert_eq!(file.metadata().get("step").map(String::as_str), Some("2"));
        let mut names: Vec<String> = file.tensors().into_iter().map(|t| t.name).collect();
        names.sort();
        let mut want: Vec<String> = trained.iter().flat_map(|p| suffixes.iter().map(move |s| format!("{p}.{s}"))).collect();
        want.sort();
        assert_eq!(names, want);
        for p in &trained {
            let m = file.load(&format!("{p}.{}", suffixes[0]), None).unwrap();
            assert_eq!(m.shape(), tree.get(p).unwrap().array.shape());
            assert_eq!(m.dtype(), mlx_array::DType::F32);
        }
        let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["torch_dtype"], "float32", "config names the dtype written");
    }
}

/// A save interrupted between its two renames leaves `<dir>.previous`, which resume finds;
/// resuming with other data or another optimizer is refused.
#[test]
fn interrupted_save_and_mismatched_resume() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("run");
    let mut t = SftTrainer::new(qwen3_tree(), &f32_options(), examples(), SftConfig { batch_size: 2, ..Default::default() }).unwrap();
    t.step().unwrap().unwrap();
    t.save(&ckpt, None).unwrap();
    std::fs::rename(&ckpt, dir.path().join("run.previous")).unwrap();
    assert_eq!(resolve_checkpoint(&ckpt).unwrap(), dir.path().join("run.previous"));
    let r = SftTrainer::resume(&ckpt, &f32_options(), examples(), SftConfig { batch_size: 2, ..Default::default() }).unwrap();
    assert_eq!(r.steps_done(), 1);
    r.save(&ckpt, None).unwrap();
    assert!(ckpt.join(TRAINER_STATE_FILE).is_file() && !dir.path().join("run.previous").exists());
    assert!(SftTrainer::resume(&ckpt, &f32_options(), examples()[..4].to_vec(), SftConfig { batch_size: 2, ..Default::default() }).is_err());
    let sgd = SftConfig { batch_size: 2, optimizer: OptimizerConfig::Sgd(SgdConfig::default()), ..Default::default() };
    assert!(SftTrainer::resume(&ckpt, &f32_options(), examples(), sgd).is_err());
    assert!(SftTrainer::resume(&ckpt, &f32_options(), examples(), SftConfig { batch_size: 3, ..Default::default() }).is_err(), "other batch size");
    assert!(SftTrainer::resume(&dir.path().join("nothing"), &f32_options(), examples(), SftConfig::default()).is_err());
}

/// Accumulation over two micro-batches of one example; the epoch's third example is applied
/// alone. With plain SGD at lr 1 and no clipping the updates are minus the averaged gradients.
#[test]
fn gradient_accumulation_applies_the_leftover() {
    let ex: Vec<Example> = examples()[..3].to_vec();
    let cfg = SftConfig { batch_size: 1, grad_accumulation: 2, shuffle: false, optimizer: OptimizerConfig::Sgd(SgdConfig::default()), schedule: Schedule { lr: 1.0, ..Default::default() }, clip: ClipConfig::default(), ..Default::default() };
    let mut tree = qwen3_tree();
    tree.freeze(|n| !n.contains("norm"));
    let mut t = SftTrainer::new(tree.clone(), &f32_options(), ex.clone(), cfg.clone()).unwrap();
    assert_eq!(t.total_steps(), 2);
    let (l0, g0) = t.loss_and_gradients(&[&ex[0]]).unwrap();
    let (l1, g1) = t.loss_and_gradients(&[&ex[1]]).unwrap();
    let m = t.step().unwrap().unwrap();
    assert_eq!(m.micro_batches, 2);
    assert!((m.loss - (l0 + l1) / 2.0).abs() < 1e-6);
    let p0 = tree.trainable_arrays();
    for ((p, (a, b)), new) in p0.iter().zip(g0.iter().zip(&g1)).zip(t.tree().trainable_arrays()) {
        let want: Vec<f32> = f32s(p).iter().zip(f32s(a).iter().zip(f32s(b))).map(|(p, (a, b))| p - (a + b) / 2.0).collect();
        assert!(max_abs(&f32s(&new), &want) < 1e-6);
    }
    let (_, g2) = t.loss_and_gradients(&[&ex[2]]).unwrap();
    let before = t.tree().trainable_arrays();
    let m = t.step().unwrap().unwrap();
    assert_eq!((m.micro_batches, m.step), (1, 2), "the leftover micro-batch, alone");
    for ((p, g), new) in before.iter().zip(&g2).zip(t.tree().trainable_arrays()) {
        let want: Vec<f32> = f32s(p).iter().zip(f32s(g)).map(|(p, g)| p - g).collect();
        assert!(max_abs(&f32s(&new), &want) < 1e-6);
    }
    assert!(t.step().unwrap().is_none() && t.is_done());
}
