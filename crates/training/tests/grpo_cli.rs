//! The `grpo` example end to end in separate processes: `--rollouts` and `--prompts` with
//! `--json` print one object per step (`step`, `loss`, `reward_mean`) and nothing else; recorded
//! rollouts give the same steps twice (deterministic); the output store's JSONL export replays
//! through `--rollouts`; `--grad-checkpoint` gives the same losses up to rounding; bad flag
//! combinations fail cleanly; `--resume` in a new process
//! continues exactly (rollouts and seeded sampling) and a run killed while saving leaves a
//! loadable checkpoint.
mod common;

use common::{killed_run, model_fixture, run_example};
use std::path::Path;

fn run(args: &[&str], dir: &Path) -> (bool, String, String) {
    run_example("grpo", args, dir)
}

fn steps_of(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn without_time(v: &[serde_json::Value]) -> Vec<serde_json::Value> {
    v.iter()
        .map(|s| {
            let mut s = s.clone();
            for k in ["seconds", "tokens_per_second"] {
                s.as_object_mut().unwrap().remove(k);
            }
            s
        })
        .collect()
}

#[test]
fn rollouts_prompts_store_and_replay() {
    let tmp = tempfile::tempdir().unwrap();
    write_rollouts(tmp.path());
    let model = model_fixture("qwen3");
    let m = model.to_str().unwrap();
    let replay = [
        "--model",
        m,
        "--rollouts",
        "r.jsonl",
        "--steps",
        "3",
        "--lr",
        "1e-3",
        "--beta",
        "0.04",
        "--loss",
        "grpo",
        "--json",
    ];

    let (ok, stdout, stderr) = run(&[&replay[..], &["--out", "a"]].concat(), tmp.path());
    assert!(ok, "{stderr}");
    let a = steps_of(&stdout);
    assert_eq!(
        a.len(),
        3,
        "one JSON object per step and nothing else: {stdout}"
    );
    for (i, s) in a.iter().enumerate() {
        assert_eq!(s["step"], i as u64 + 1);
        assert!(
            s["loss"].as_f64().unwrap().is_finite()
                && s["reward_mean"].is_number()
                && s["kl"].is_number()
        );
    }
    assert!(
        (a[0]["reward_mean"].as_f64().unwrap() - 0.75).abs() < 1e-12,
        "group 0's rewards 0, 0.5, 1, 1.5"
    );
    assert!(
        tmp.path().join("a/model.safetensors").is_file()
            && tmp.path().join("a/optimizer.safetensors").is_file()
    );
    assert!(
        tmp.path().join("a.outputs.sqlite").is_file(),
        "the default store sits next to OUT_DIR"
    );

    // recorded rollouts: the same steps again
    let (ok, stdout, stderr) = run(
        &[
            &replay[..],
            &[
                "--out",
                "b",
                "--export-jsonl",
                "b.jsonl",
                "--export-xlsx",
                "b.xlsx",
            ],
        ]
        .concat(),
        tmp.path(),
    );
    assert!(ok, "{stderr}");
    assert_eq!(
        without_time(&steps_of(&stdout)),
        without_time(&a),
        "replaying recorded groups is deterministic"
    );
    assert_eq!(
        std::fs::read(tmp.path().join("a/model.safetensors")).unwrap(),
        std::fs::read(tmp.path().join("b/model.safetensors")).unwrap()
    );
    assert!(std::fs::read(tmp.path().join("b.xlsx"))
        .unwrap()
        .starts_with(b"PK"));

    // the store's export replays through --rollouts with the same result
    let from_export: Vec<&str> = replay.iter().map(|a| if *a == "r.jsonl" { "b.jsonl" } else { a }).chain(["--out", "c"]).collect();
    let (ok, stdout, stderr) = run(&from_export, tmp.path());
    assert!(ok, "{stderr}");
    assert_eq!(
        without_time(&steps_of(&stdout)),
        without_time(&a),
        "exported rows replay as recorded"
    );

    // per-layer gradient checkpointing: the same steps, up to rounding
    let (ok, stdout, stderr) = run(
        &[&replay[..], &["--out", "d", "--grad-checkpoint"]].concat(),
        tmp.path(),
    );
    assert!(ok, "{stderr}");
    let d = steps_of(&stdout);
    assert_eq!(d.len(), a.len(), "{stdout}");
    for (x, y) in d.iter().zip(&a) {
        let (lx, ly) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
        assert!(
            (lx - ly).abs() <= 1e-6 + 1e-5 * ly.abs(),
            "--grad-checkpoint: loss {lx} vs {ly}"
        );
        assert_eq!(x["reward_mean"], y["reward_mean"]);
    }

    // sampling mode: prompts, length reward
    std::fs::write(
        tmp.path().join("p.jsonl"),
        "{\"prompt_ids\": [3, 17, 99, 4], \"prompt\": \"p0\"}\n{\"prompt\": \"hello world\"}\n",
    )
    .unwrap();
    let sample = [
        "--model",
        m,
        "--prompts",
        "p.jsonl",
        "--reward",
        "length",
        "--min-length",
        "20",
        "--group-size",
        "3",
        "--prompts-per-step",
        "2",
        "--max-completion-length",
        "6",
        "--steps",
        "2",
        "--lr",
        "1e-3",
        "--json",
    ];
    let (ok, stdout, stderr) = run(
        &[&sample[..], &["--out", "s1", "--export-jsonl", "s1.jsonl"]].concat(),
        tmp.path(),
    );
    assert!(ok, "{stderr}");
    let s1 = steps_of(&stdout);
    assert_eq!(s1.len(), 2, "{stdout}");
    for s in &s1 {
        assert!(
            s["reward_mean"].as_f64().unwrap() >= 0.0
                && s["completion_length_max"].as_u64().unwrap() <= 7
        );
        assert_eq!(s["rewards"][0]["name"], "length");
    }
    let exported = std::fs::read_to_string(tmp.path().join("s1.jsonl")).unwrap();
    assert_eq!(
        exported.lines().count(),
        12,
        "2 steps x 2 prompts x 3 completions recorded"
    );
    // a seed fixes the sampled completions
    let (ok, stdout, stderr) = run(&[&sample[..], &["--out", "s2"]].concat(), tmp.path());
    assert!(ok, "{stderr}");
    assert_eq!(without_time(&steps_of(&stdout)), without_time(&s1));
}

#[test]
fn bad_flags_fail_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("p.jsonl"), "{\"prompt_ids\": [3, 4]}\n").unwrap();
    std::fs::write(
        tmp.path().join("r.jsonl"),
        "{\"group\": 0, \"prompt_ids\": [3], \"completion_ids\": [4], \"reward\": 1}\n",
    )
    .unwrap();
    let model = model_fixture("qwen3");
    let m = model.to_str().unwrap();
    // each case: the flags after `--model M` and before `--out o`
    let cases: [&[&str]; 7] = [
        &["--prompts", "p.jsonl"],
        &["--prompts", "p.jsonl", "--rollouts", "r.jsonl", "--reward", "length"],
        &[],
        &["--rollouts", "r.jsonl"],
        &["--rollouts", "r.jsonl", "--group-size", "1", "--temperature", "0.5"],
        &["--prompts", "p.jsonl", "--reward", "length", "--xml-tags", "a"],
        &["--prompts", "p.jsonl", "--reward", "length", "--loss", "ppo"],
    ];
    for flags in cases {
        let args = [&["--model", m][..], flags, &["--out", "o"]].concat();
        let (ok, stdout, stderr) = run(&args, tmp.path());
        assert!(!ok, "{args:?} should fail");
        assert!(
            stdout.is_empty() && !stderr.is_empty() && !stderr.contains("panicked"),
            "{args:?}: {stderr}"
        );
    }
}

fn bytes_equal(tmp: &Path, a: &str, b: &str, files: &[&str]) {
    for f in files {
        let (x, y) = (
            std::fs::read(tmp.join(a).join(f)).unwrap(),
            std::fs::read(tmp.join(b).join(f)).unwrap(),
        );
        assert!(x == y, "{f}: {a} and {b} differ");
    }
}

/// Recorded groups, 3 groups of 4 completions.
fn write_rollouts(dir: &Path) {
    let mut lines = Vec::new();
    for g in 0..3u32 {
        for k in 0..4u32 {
            lines.push(format!("{{\"group\": {g}, \"prompt_ids\": [{}, 17, 99], \"completion_ids\": [{}, {}, 7], \"reward\": {}}}", 3 + g, 40 + k, 200 + g * 4 + k, (k as f64) * 0.5 - g as f64));
        }
    }
    std::fs::write(dir.join("r.jsonl"), lines.join("\n")).unwrap();
}

/// `--resume` in a new process: 4 steps in one run write the same model, optimizer, reference
/// and trainer-state files, byte for byte, as 2 steps then `--resume` for 2 more, and report the
/// same steps; with recorded rollouts (KL term on, 2 groups a step cycling over 3) and with
/// seeded sampling (`--prompts`). The resumed run records into the saved run of its store,
/// replacing steps recorded after the checkpoint, so that the store's export equals the
/// uninterrupted run's.
#[test]
fn resume_in_a_new_process_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    write_rollouts(t);
    std::fs::write(
        t.join("p.jsonl"),
        "{\"prompt_ids\": [3, 17, 99, 4], \"prompt\": \"p0\"}\n{\"prompt\": \"hello world\"}\n",
    )
    .unwrap();
    let model = model_fixture("qwen3");
    let m = model.to_str().unwrap();
    let rollouts: &[&str] = &[
        "--rollouts",
        "r.jsonl",
        "--prompts-per-step",
        "2",
        "--lr",
        "1e-2",
        "--beta",
        "0.04",
        "--loss",
        "grpo",
        "--json",
    ];
    let sampled: &[&str] = &[
        "--prompts",
        "p.jsonl",
        "--reward",
        "length",
        "--min-length",
        "20",
        "--group-size",
        "3",
        "--max-completion-length",
        "6",
        "--lr",
        "1e-2",
        "--seed",
        "5",
        "--json",
    ];
    for (tag, flags, files) in [
        (
            "r",
            rollouts,
            &[
                "model.safetensors",
                "optimizer.safetensors",
                "reference.safetensors",
                "trainer_state.json",
            ][..],
        ),
        (
            "s",
            sampled,
            &[
                "model.safetensors",
                "optimizer.safetensors",
                "trainer_state.json",
            ][..],
        ),
    ] {
        let name = |s: &str| format!("{tag}-{s}");
        let (whole, half, half_copy, ahead, resumed) = (
            name("whole"),
            name("half"),
            name("half-copy"),
            name("ahead"),
            name("resumed"),
        );
        let go = |extra: &[&str]| {
            let (ok, stdout, stderr) = run(&[flags, extra].concat(), t);
            assert!(ok, "{tag} {extra:?}: {stderr}");
            steps_of(&stdout)
        };
        let all = go(&[
            "--model",
            m,
            "--out",
            &whole,
            "--steps",
            "4",
            "--export-jsonl",
            &format!("{whole}.jsonl"),
        ]);
        assert_eq!(all.len(), 4);
        go(&["--model", m, "--out", &half, "--steps", "2"]);
        // a run resumed from the 2-step checkpoint records step 3 in the store, then is lost
        copy_dir(&t.join(&half), &t.join(&half_copy));
        let third = go(&["--resume", &half, "--out", &ahead, "--steps", "3"]);
        assert_eq!(without_time(&third), without_time(&all[2..3]));
        let rest = go(&[
            "--resume",
            &half_copy,
            "--out",
            &resumed,
            "--steps",
            "4",
            "--export-jsonl",
            &format!("{resumed}.jsonl"),
        ]);
        assert_eq!(
            without_time(&rest),
            without_time(&all[2..]),
            "{tag}: the resumed steps report what the uninterrupted run's did"
        );
        bytes_equal(t, &whole, &resumed, files);
        let (a, b) = (
            std::fs::read_to_string(t.join(format!("{whole}.jsonl"))).unwrap(),
            std::fs::read_to_string(t.join(format!("{resumed}.jsonl"))).unwrap(),
        );
        assert!(
            !a.is_empty() && a == b,
            "{tag}: the resumed run's store holds the uninterrupted run's records"
        );
    }
    // resuming with another data layout fails cleanly
    let (ok, stdout, stderr) = run(
        &[
            "--rollouts",
            "r.jsonl",
            "--prompts-per-step",
            "1",
            "--lr",
            "1e-2",
            "--beta",
            "0.04",
            "--json",
            "--resume",
            "r-half",
            "--out",
            "x",
        ],
        t,
    );
    assert!(
        !ok && stdout.is_empty() && stderr.contains("data layout"),
        "{stderr}"
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// The example killed (SIGKILL) at various moments of a run that saves after every step:
/// whatever it leaves is a checkpoint that resumes (with its reference model), never a
/// half-written one.
#[test]
fn killed_during_saves_leaves_a_loadable_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    write_rollouts(tmp.path());
    let model = model_fixture("qwen3");
    let mut resumed = 0;
    for (i, delay_ms) in [200u64, 400, 600, 900, 1300].into_iter().enumerate() {
        let out = format!("run{i}");
        killed_run(
            "grpo",
            &[
                "--model",
                model.to_str().unwrap(),
                "--rollouts",
                "r.jsonl",
                "--out",
                &out,
                "--steps",
                "100000",
                "--beta",
                "0.04",
                "--save-every",
                "1",
                "--json",
            ],
            tmp.path(),
            delay_ms,
        );
        let dir = tmp.path().join(&out);
        match mlx_training::state::resolve_checkpoint(&dir) {
            Ok(found) => {
                let cfg = mlx_training::GrpoConfig {
                    beta: 0.04,
                    ..Default::default()
                };
                let data = mlx_training::GrpoData {
                    items: 3,
                    per_step: 1,
                    seed: 0,
                };
                let t = mlx_training::GrpoTrainer::resume(
                    &found,
                    &common::f32_options(),
                    cfg,
                    Some(data),
                )
                .unwrap();
                assert!(t.steps_done() >= 1 && t.reference().is_some());
                resumed += 1;
            }
            Err(_) => assert!(
                !dir.exists() && !tmp.path().join(format!("{out}.previous")).exists(),
                "killed before its first save: nothing in place"
            ),
        }
    }
    assert!(resumed > 0, "at least one run got to a save");
}

/// LoRA from the command line (`--lora-rank`, as the `sft` example takes it): 3 steps on
/// recorded rollouts write adapters.safetensors and adapter_config.json and no model; 1 step
/// then `--resume` (base model from adapter_config.json) for 2 more writes the same adapter
/// and optimizer files, byte for byte, and reports the same steps; LoRA dropout (which GRPO
/// does not apply) and LoRA flags without `--lora-rank` fail cleanly.
#[test]
fn lora_run_and_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    write_rollouts(t);
    let model = model_fixture("qwen3");
    let m = model.to_str().unwrap();
    let flags: &[&str] = &["--rollouts", "r.jsonl", "--lr", "1e-2", "--loss", "grpo", "--json", "--lora-rank", "4", "--lora-layers", "-1", "--lora-targets", "self_attn.q_proj,mlp.down_proj"];
    let go = |extra: &[&str]| {
        let (ok, stdout, stderr) = run(&[flags, extra].concat(), t);
        assert!(ok, "{extra:?}: {stderr}");
        steps_of(&stdout)
    };
    let all = go(&["--model", m, "--out", "whole", "--steps", "3"]);
    assert_eq!(all.len(), 3);
    let whole = t.join("whole");
    assert!(whole.join("adapters.safetensors").is_file() && whole.join("adapter_config.json").is_file());
    assert!(!whole.join("model.safetensors").exists(), "adapters only");
    let adapters = mlx_array::io::load_safetensors(whole.join("adapters.safetensors"), None).unwrap();
    assert_eq!(adapters.len(), 12, "lora_a and lora_b of q_proj and down_proj in 3 layers");
    go(&["--model", m, "--out", "half", "--steps", "1"]);
    let resume: Vec<&str> = ["--rollouts", "r.jsonl", "--lr", "1e-2", "--loss", "grpo", "--json", "--resume", "half", "--out", "resumed", "--steps", "3"].to_vec();
    let (ok, stdout, stderr) = run(&resume, t);
    assert!(ok, "{stderr}");
    assert_eq!(without_time(&steps_of(&stdout)), without_time(&all[1..]));
    bytes_equal(t, "whole", "resumed", &["adapters.safetensors", "optimizer.safetensors"]);
    for bad in [
        vec!["--model", m, "--rollouts", "r.jsonl", "--out", "x", "--lora-rank", "4", "--lora-dropout", "0.1"],
        vec!["--model", m, "--rollouts", "r.jsonl", "--out", "x", "--lora-layers", "2"],
        vec!["--resume", "half", "--rollouts", "r.jsonl", "--out", "x", "--lora-rank", "4"],
    ] {
        let (ok, stdout, stderr) = run(&bad, t);
        assert!(!ok && stdout.is_empty() && !stderr.is_empty(), "{bad:?} must fail with a message");
    }
}
