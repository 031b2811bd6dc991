//! Data-parallel SFT over MLX's ring backend: this binary starts copies of itself as the ranks
//! of a group on 127.0.0.1; each trains the tiny Qwen3 fixture on its share of every batch with
//! the gradients averaged over the ranks (`SftTrainer::with_data_parallel`), and rank 0 alone
//! saves. Against a single process on the whole batches (f32; summation order is the only
//! difference):
//! - one batch's averaged gradients: every tensor within 1e-5 relative (L2) of the whole batch's;
//! - 4 SGD (momentum 0.9) updates: losses within 1e-5 relative, parameters and momentum buffers
//!   within 1e-5 absolute;
//! - 4 AdamW updates (lr 2.5e-4): every rank ends bit-identical, and rank 0's checkpoint
//!   (parameters and moments) is within 1e-4 absolute of the single process's (1.4e-5
//!   measured). AdamW divides each gradient by its running RMS, so a component whose batch terms
//!   cancel (|g| near the rounding noise) can move by up to lr per update either way: an f32
//!   tolerance does not apply, and the gradients' correctness is what the first two checks test.
//!
//!
//! The `grpo` example under 2 and 3 ranks (`--distributed ring`, as the `launch` example runs
//! it) against one process with the same micro-batches (the batch of 8 completions cut into one
//! micro-batch per rank): 3 SGD updates on recorded rollouts with the KL term give every step's
//! loss, KL, clip fraction and gradient norm within 1e-5 relative, and rank 0's saved parameters
//! within 1e-5 absolute; the other ranks print nothing.
//!
//! `harness = false`: `main` is the test. With `DP_TEST_SPEC` set it is a rank.
mod common;

use common::*;
use mlx_array::distributed::{run_local_ring, Backend, Group};
use mlx_training::distributed::{rank_share, reduce_gradients};
use mlx_training::state::OPTIMIZER_FILE;
use mlx_training::{Example, OptimizerConfig, SftConfig, SftTrainer, SgdConfig};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn examples() -> Vec<Example> {
    (0..8u32).map(|i| Example::prompt_completion(&[3 + i, 17, 99 + i], &(0..(2 + i % 3)).map(|j| 40 + 13 * i + j).collect::<Vec<_>>())).collect()
}

fn config(opt: &str) -> SftConfig {
    let mut c = SftConfig { batch_size: 4, epochs: 2, seed: 3, ..Default::default() };
    match opt {
        "sgd" => {
            c.optimizer = OptimizerConfig::Sgd(SgdConfig { momentum: 0.9, ..Default::default() });
            c.schedule.lr = 1e-2;
        }
        _ => c.schedule.lr = 2.5e-4,
    }
    c
}

fn trainer(opt: &str) -> SftTrainer {
    let mut tree = qwen3_tree();
    tree.freeze(|n| n.contains("embed_tokens"));
    SftTrainer::new(tree, &f32_options(), examples(), config(opt)).unwrap()
}

/// Train to the end; per-step losses and the trainer.
fn train(mut t: SftTrainer) -> (Vec<f32>, SftTrainer) {
    let mut losses = Vec::new();
    while let Some(m) = t.step().unwrap() {
        losses.push(m.loss);
    }
    (losses, t)
}

fn main() {
    if let Ok(spec) = std::env::var("DP_TEST_SPEC") {
        rank_main(serde_json::from_str(&spec).unwrap());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // 3 ranks share a batch of 4 as 2 + 1 + 1 examples: the average weighs them by loss positions.
    for (opt, n, tol) in [("sgd", 2, 1e-5f32), ("sgd", 3, 1e-5), ("adamw", 2, 1e-4)] {
        let t = Instant::now();
        let single_dir = tmp.path().join(format!("single-{opt}"));
        let (single_losses, single) = train(trainer(opt));
        single.save(&single_dir, None).unwrap();
        assert_eq!(single_losses.len(), 4);
        let out = tmp.path().join(format!("dp-{opt}-{n}"));
        let outs = run_ranks(n, &json!({"out": out, "opt": opt}));
        let mut hashes = Vec::new();
        let mut grad_err = 0f64;
        for (r, (ok, text)) in outs.iter().enumerate() {
            assert!(ok, "rank {r} of {n} failed:\n{text}");
            let line: Value = serde_json::from_str(text.lines().find(|l| l.starts_with('{')).unwrap()).unwrap();
            let losses: Vec<f32> = serde_json::from_value(line["losses"].clone()).unwrap();
            assert_eq!(losses.len(), single_losses.len());
            if opt == "sgd" {
                for (a, b) in losses.iter().zip(&single_losses) {
                    assert!(((a - b) / b).abs() < 1e-5, "{opt}, {n} ranks, rank {r}: losses {losses:?} against {single_losses:?}");
                }
            }
            grad_err = grad_err.max(line["grad_rel_err"].as_f64().unwrap());
            hashes.push(line["param_bits"].as_str().unwrap().to_string());
        }
        assert!(grad_err < 1e-5, "{n} ranks: averaged gradients {grad_err:e} from the whole batch's (relative L2)");
        assert!(hashes.windows(2).all(|w| w[0] == w[1]), "{n} ranks end with different parameters: {hashes:?}");
        let (dp, sp) = (tensors(&out.join("model.safetensors")), tensors(&single_dir.join("model.safetensors")));
        let dparam = max_diff(&dp, &sp);
        let (dopt, sopt) = (tensors(&out.join(OPTIMIZER_FILE)), tensors(&single_dir.join(OPTIMIZER_FILE)));
        let dstate = max_diff(&dopt, &sopt);
        assert!(dparam < tol && dstate < tol, "{opt}, {n} ranks against one process: parameters {dparam:e}, optimizer state {dstate:e}");
        println!(
            "test data_parallel::{opt}_over_{n}_ranks ... ok ({:.1} s; gradients {grad_err:.1e} relative; max |diff| parameters {dparam:.1e}, optimizer state {dstate:.1e})",
            t.elapsed().as_secs_f64()
        );
    }
    grpo_example_over_ranks(tmp.path());
}

/// See the module docs: the `grpo` example over 2 and 3 ranks against one process.
fn grpo_example_over_ranks(dir: &Path) {
    let mut lines = Vec::new();
    for g in 0..4u32 {
        for k in 0..4u32 {
            let reward = (k as f64) * 0.5 - g as f64 + if k == g { 1.5 } else { 0.0 };
            lines.push(json!({"group": g, "prompt_ids": [3 + g, 17, 99], "completion_ids": (0..2 + (g + k) % 3).map(|j| 40 + 7 * k + g + j).collect::<Vec<u32>>(), "reward": reward}).to_string());
        }
    }
    std::fs::write(dir.join("r.jsonl"), lines.join("\n")).unwrap();
    let model = model_fixture("qwen3");
    let bin = example_binary("grpo");
    let flags = |out: &str| -> Vec<String> {
        let m = model.to_str().unwrap();
        ["--model", m, "--rollouts", "r.jsonl", "--prompts-per-step", "2", "--steps", "3", "--optimizer", "sgd", "--lr", "1e-2", "--beta", "0.04", "--loss", "grpo", "--json", "--out", out].map(String::from).to_vec()
    };
    let steps = |stdout: &[u8]| -> Vec<Value> { String::from_utf8_lossy(stdout).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect() };
    for n in [2usize, 3] {
        let t = Instant::now();
        let micro = 8usize.div_ceil(n).to_string();
        let (single_out, dp_out) = (format!("grpo-single-{n}"), format!("grpo-dp-{n}"));
        let one = Command::new(&bin).args(flags(&single_out)).args(["--micro-batch-size", &micro]).current_dir(dir).output().unwrap();
        assert!(one.status.success(), "one process: {}", String::from_utf8_lossy(&one.stderr));
        let ranks = run_local_ring(n, &bin, Duration::from_secs(120), |c| {
            c.args(flags(&dp_out)).args(["--distributed", "ring"]).current_dir(dir);
        })
        .unwrap();
        for (r, o) in ranks.iter().enumerate() {
            assert!(o.status.success(), "grpo rank {r} of {n}: {}", String::from_utf8_lossy(&o.stderr));
            if r > 0 {
                assert!(o.stdout.is_empty(), "rank {r} printed: {}", String::from_utf8_lossy(&o.stdout));
            }
        }
        let (want, got) = (steps(&one.stdout), steps(&ranks[0].stdout));
        assert_eq!(want.len(), 3);
        assert_eq!(got.len(), 3);
        let mut worst = 0f64;
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(w["step"], g["step"]);
            for k in ["loss", "kl", "clip_fraction", "grad_norm"] {
                let (a, b) = (w[k].as_f64().unwrap(), g[k].as_f64().unwrap());
                let rel = (a - b).abs() / a.abs().max(1e-12);
                assert!(rel < 1e-5 || (a - b).abs() < 1e-9, "{n} ranks, step {}: {k} {b} against {a}", w["step"]);
                worst = worst.max(if (a - b).abs() < 1e-9 { 0.0 } else { rel });
            }
        }
        let dparam = max_diff(&tensors(&dir.join(&dp_out).join("model.safetensors")), &tensors(&dir.join(&single_out).join("model.safetensors")));
        assert!(dparam < 1e-5, "grpo over {n} ranks: parameters {dparam:e} from one process's");
        println!(
            "test data_parallel::grpo_example_over_{n}_ranks ... ok ({:.1} s; step metrics {worst:.1e} relative; max |diff| parameters {dparam:.1e})",
            t.elapsed().as_secs_f64()
        );
    }
}

fn tensors(path: &Path) -> BTreeMap<String, Vec<f32>> {
    mlx_array::io::load_safetensors(path, Some(mlx_array::DType::F32)).unwrap().into_iter().filter(|(_, a)| a.dtype().is_float()).map(|(n, a)| (n, f32s(&a))).collect()
}

fn max_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter().map(|(n, x)| max_abs(x, &b[n])).fold(0f32, f32::max)
}

fn run_ranks(n: usize, spec: &Value) -> Vec<(bool, String)> {
    let exe = std::env::current_exe().unwrap();
    run_local_ring(n, &exe, Duration::from_secs(120), |c| {
        c.env("DP_TEST_SPEC", spec.to_string());
    })
    .unwrap_or_else(|e| panic!("{n} ranks on {spec}: {e}"))
    .into_iter()
    .map(|o| (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))))
    .collect()
}

fn rank_main(spec: Value) {
    let g = Group::init(Backend::Ring).unwrap();
    let (rank, size) = (g.rank(), g.size());
    let opt = spec["opt"].as_str().unwrap();
    // One batch's gradients: this rank's share, averaged, against the whole batch computed here.
    let t = trainer(opt);
    let all = examples();
    let batch: Vec<&Example> = all[..4].iter().collect();
    let (whole_loss, whole) = t.loss_and_gradients(&batch).unwrap();
    let share = &batch[rank_share(batch.len(), rank, size).unwrap()];
    let (loss, grads) = t.loss_and_gradients(share).unwrap();
    let positions: usize = share.iter().map(|e| e.loss_tokens()).sum();
    let red = reduce_gradients(&g, loss, positions, 0, &grads).unwrap();
    assert!(((red.loss - whole_loss) / whole_loss).abs() < 1e-5, "batch loss {} against {whole_loss}", red.loss);
    let grad_rel_err = red.grads.iter().zip(&whole).map(|(a, b)| norm_rel(&f32s(a), &f32s(b))).fold(0f64, f64::max);
    drop(t);
    // Training.
    let (losses, t) = train(trainer(opt).with_data_parallel(g));
    if rank == 0 {
        t.save(Path::new(spec["out"].as_str().unwrap()), None).unwrap();
    }
    // FNV-1a over every parameter's bits: equal on every rank.
    let mut h: u64 = 0xcbf29ce484222325;
    for (_, p) in t.tree().iter() {
        for x in f32s(&p.array) {
            for b in x.to_bits().to_le_bytes() {
                h = (h ^ b as u64).wrapping_mul(0x100000001b3);
            }
        }
    }
    println!("{}", json!({"rank": rank, "losses": losses, "grad_rel_err": grad_rel_err, "param_bits": format!("{h:016x}")}));
}
