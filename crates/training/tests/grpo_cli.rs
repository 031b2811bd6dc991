//! The `grpo` example end to end in separate processes: `--rollouts` and `--prompts` with
//! `--json` print one object per step (`step`, `loss`, `reward_mean`) and nothing else; recorded
//! rollouts give the same steps twice (deterministic); the output store's JSONL export replays
//! through `--rollouts`; bad flag combinations fail cleanly.
mod common;

use common::model_fixture;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The example binary (built by `cargo test`; built here when this test runs alone).
fn grpo_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("grpo");
    if !bin.is_file() {
        let st = Command::new(env!("CARGO"))
            .args(["build", "-p", "mlx-training", "--example", "grpo"])
            .status()
            .unwrap();
        assert!(st.success(), "building the grpo example");
    }
    bin
}

fn run(args: &[&str], dir: &Path) -> (bool, String, String) {
    let out = Command::new(grpo_binary())
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
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
    let mut lines = Vec::new();
    for g in 0..3u32 {
        for k in 0..4u32 {
            lines.push(format!("{{\"group\": {g}, \"prompt_ids\": [{}, 17, 99], \"completion_ids\": [{}, {}, 7], \"reward\": {}}}", 3 + g, 40 + k, 200 + g * 4 + k, (k as f64) * 0.5 - g as f64));
        }
    }
    std::fs::write(tmp.path().join("r.jsonl"), lines.join("\n")).unwrap();
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
    let (ok, stdout, stderr) = run(
        &[
            "--model",
            m,
            "--rollouts",
            "b.jsonl",
            "--steps",
            "3",
            "--lr",
            "1e-3",
            "--beta",
            "0.04",
            "--loss",
            "grpo",
            "--json",
            "--out",
            "c",
        ],
        tmp.path(),
    );
    assert!(ok, "{stderr}");
    assert_eq!(
        without_time(&steps_of(&stdout)),
        without_time(&a),
        "exported rows replay as recorded"
    );

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
    let cases: [&[&str]; 7] = [
        &["--model", m, "--prompts", "p.jsonl", "--out", "o"],
        &[
            "--model",
            m,
            "--prompts",
            "p.jsonl",
            "--rollouts",
            "r.jsonl",
            "--reward",
            "length",
            "--out",
            "o",
        ],
        &["--model", m, "--out", "o"],
        &["--model", m, "--rollouts", "r.jsonl", "--out", "o"],
        &[
            "--model",
            m,
            "--rollouts",
            "r.jsonl",
            "--group-size",
            "1",
            "--temperature",
            "0.5",
            "--out",
            "o",
        ],
        &[
            "--model",
            m,
            "--prompts",
            "p.jsonl",
            "--reward",
            "length",
            "--xml-tags",
            "a",
            "--out",
            "o",
        ],
        &[
            "--model",
            m,
            "--prompts",
            "p.jsonl",
            "--reward",
            "length",
            "--loss",
            "ppo",
            "--out",
            "o",
        ],
    ];
    for args in cases {
        let (ok, stdout, stderr) = run(args, tmp.path());
        assert!(!ok, "{args:?} should fail");
        assert!(
            stdout.is_empty() && !stderr.is_empty() && !stderr.contains("panicked"),
            "{args:?}: {stderr}"
        );
    }
}
