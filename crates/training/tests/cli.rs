//! The `sft` example end to end, in separate processes: `--json` prints one object per step and
//! nothing else; 6 updates in one run write the same model and optimizer files, byte for byte,
//! as 3 updates, then `--resume` in a new process for the remaining 3; bad flags fail cleanly.
mod common;

use common::{killed_run, model_fixture, run_example};
use std::path::Path;

fn run(args: &[&str], dir: &Path) -> (bool, String, String) {
    run_example("sft", args, dir)
}

#[test]
fn json_steps_and_resume_in_a_new_process() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d.jsonl");
    let lines: Vec<String> = (0..7u32).map(|i| format!("{{\"prompt_ids\": [{}, {}, 5], \"completion_ids\": [{}, {}, {}]}}", 3 + i, 90 + 2 * i, 40 + i, 200 + i, 7 * i)).collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let model = model_fixture("qwen3");
    let m = model.to_str().unwrap();
    let common = ["--data", "d.jsonl", "--batch-size", "2", "--lr", "1e-3", "--seed", "3", "--json"];
    let with = |extra: &[&'static str]| -> Vec<&str> { common.iter().copied().chain(extra.iter().copied()).collect() };

    let (ok, stdout, stderr) = run(&[&["--model", m][..], &with(&["--out", "whole", "--steps", "6"])].concat(), tmp.path());
    assert!(ok, "{stderr}");
    let steps: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(steps.len(), 6, "one JSON object per step and nothing else: {stdout}");
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"], i as u64 + 1);
        assert!(s["loss"].as_f64().unwrap() > 0.0 && s["lr"].as_f64().unwrap() == 1e-3);
    }

    let (ok, _, stderr) = run(&[&["--model", m][..], &with(&["--out", "half", "--steps", "3"])].concat(), tmp.path());
    assert!(ok, "{stderr}");
    let (ok, stdout, stderr) = run(&with(&["--resume", "half", "--out", "resumed", "--steps", "6"]), tmp.path());
    assert!(ok, "{stderr}");
    let resumed: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let without_time = |v: &[serde_json::Value]| -> Vec<serde_json::Value> {
        v.iter().map(|s| {
            let mut s = s.clone();
            s.as_object_mut().unwrap().remove("seconds");
            s
        }).collect()
    };
    assert_eq!(without_time(&resumed), without_time(&steps[3..]), "the resumed steps report what the uninterrupted run's did");
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let (a, b) = (std::fs::read(tmp.path().join("whole").join(f)).unwrap(), std::fs::read(tmp.path().join("resumed").join(f)).unwrap());
        assert!(a == b, "{f}: the resumed run's file differs from the uninterrupted run's");
    }

    for bad in [
        vec!["--model", m, "--data", "d.jsonl", "--out", "x", "--optimizer", "adam"],
        vec!["--model", m, "--data", "missing.jsonl", "--out", "x"],
        vec!["--data", "d.jsonl", "--out", "x"],
        vec!["--model", m, "--data", "d.jsonl", "--out", "x", "--momentum", "0.9"],
        vec!["--model", m, "--data", "d.jsonl", "--out", "x", "--freeze", "no_such_tensor"],
    ] {
        let (ok, stdout, stderr) = run(&bad, tmp.path());
        assert!(!ok && stdout.is_empty() && !stderr.is_empty(), "{bad:?} must fail with a message");
    }
}

/// The example killed (SIGKILL) at various moments of a run that saves after every update:
/// whatever it leaves is a checkpoint that resumes, never a half-written one.
#[test]
fn killed_during_saves_leaves_a_loadable_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d.jsonl");
    std::fs::write(&data, (0..4u32).map(|i| format!("{{\"prompt_ids\": [{}, 5], \"completion_ids\": [{}, {}]}}\n", 3 + i, 40 + i, 7 * i)).collect::<String>()).unwrap();
    let model = model_fixture("qwen3");
    let mut resumed = 0;
    for (i, delay_ms) in [150u64, 300, 450, 600, 900].into_iter().enumerate() {
        let out = format!("run{i}");
        killed_run("sft", &["--model", model.to_str().unwrap(), "--data", "d.jsonl", "--out", &out, "--steps", "100000", "--batch-size", "2", "--save-every", "1", "--json"], tmp.path(), delay_ms);
        let dir = tmp.path().join(&out);
        match mlx_training::state::resolve_checkpoint(&dir) {
            Ok(found) => {
                let cfg = mlx_training::SftConfig { batch_size: 2, max_steps: Some(100000), ..Default::default() };
                let examples = mlx_training::load_jsonl(&data, &mlx_training::TextEncoder::none(), None).unwrap();
                let t = mlx_training::SftTrainer::resume(&found, &common::f32_options(), examples, cfg).unwrap();
                assert!(t.steps_done() >= 1);
                resumed += 1;
            }
            Err(_) => assert!(!dir.exists() && !tmp.path().join(format!("{out}.previous")).exists(), "killed before its first save: nothing in place"),
        }
    }
    assert!(resumed > 0, "at least one run got to a save");
}

/// LoRA from the command line: 4 updates with dropout in one run write the same adapter and
/// optimizer files, byte for byte, as 2 updates then `--resume` (base model from
/// adapter_config.json) for 2 more; `--fuse` adds the fused model, which loads; LoRA flags
/// that do not fit fail cleanly.
#[test]
fn lora_run_resume_and_fuse() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d.jsonl");
    let lines: Vec<String> = (0..6u32).map(|i| format!("{{\"prompt_ids\": [{}, 5], \"completion_ids\": [{}, {}, {}]}}", 3 + i, 40 + i, 200 + i, 7 * i)).collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let model = model_fixture("qwen3");
    let m = model.to_str().unwrap();
    let lora = ["--data", "d.jsonl", "--batch-size", "2", "--lr", "1e-3", "--seed", "5", "--json", "--lora-rank", "4", "--lora-dropout", "0.1", "--lora-layers", "-1", "--lora-targets", "self_attn.q_proj,mlp.down_proj"];
    let with = |extra: &[&str]| -> Vec<String> { lora.iter().chain(extra.iter()).map(|s| s.to_string()).collect() };
    fn args(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    let whole = with(&["--model", m, "--out", "whole", "--steps", "4", "--fuse"]);
    let (ok, stdout, stderr) = run(&args(&whole), tmp.path());
    assert!(ok, "{stderr}");
    assert_eq!(stdout.lines().count(), 4);
    let half = with(&["--model", m, "--out", "half", "--steps", "2"]);
    let (ok, _, stderr) = run(&args(&half), tmp.path());
    assert!(ok, "{stderr}");
    let half_dir = tmp.path().join("half");
    assert!(half_dir.join("adapters.safetensors").is_file() && half_dir.join("adapter_config.json").is_file());
    assert!(!half_dir.join("model.safetensors").exists(), "adapters only without --fuse");
    let resume: Vec<&str> = ["--data", "d.jsonl", "--batch-size", "2", "--lr", "1e-3", "--seed", "5", "--json", "--resume", "half", "--out", "resumed", "--steps", "4"].to_vec();
    let (ok, _, stderr) = run(&resume, tmp.path());
    assert!(ok, "{stderr}");
    for f in ["adapters.safetensors", "optimizer.safetensors"] {
        let (a, b) = (std::fs::read(tmp.path().join("whole").join(f)).unwrap(), std::fs::read(tmp.path().join("resumed").join(f)).unwrap());
        assert!(a == b, "{f}: the resumed LoRA run's file differs from the uninterrupted run's");
    }
    let fused = mlx_models::ParameterTree::load(tmp.path().join("whole"), &common::f32_options()).unwrap();
    assert!(fused.iter().all(|(n, _)| !n.contains("lora")));
    let base = mlx_models::ParameterTree::load(&model, &common::f32_options()).unwrap();
    let changed = fused.iter().filter(|(n, p)| common::f32s(&p.array) != common::f32s(&base.get(n).unwrap().array)).count();
    assert_eq!(changed, 6, "q_proj and down_proj of 3 layers fused");
    for bad in [
        vec!["--model", m, "--data", "d.jsonl", "--out", "x", "--lora-scale", "2"],
        vec!["--model", m, "--data", "d.jsonl", "--out", "x", "--fuse"],
        vec!["--model", m, "--data", "d.jsonl", "--out", "x", "--lora-rank", "4", "--lora-targets", "self_attn.nope"],
        vec!["--model", m, "--data", "d.jsonl", "--out", "x", "--lora-rank", "0"],
        vec!["--model", m, "--data", "d.jsonl", "--out", "x", "--lora-rank", "4", "--lora-dropout", "1.5"],
    ] {
        let (ok, stdout, stderr) = run(&bad, tmp.path());
        assert!(!ok && stdout.is_empty() && !stderr.is_empty(), "{bad:?} must fail with a message");
    }
}
