//! The GRPO output store: steps and completions recorded in SQLite, read back, exported to JSONL
//! (which `load_rollouts` replays) and to XLSX.
use mlx_training::output_store::{GenerationRecord, OutputStore};
use mlx_training::{load_rollouts, rollout_batch};
use std::path::Path;

fn record(group_id: i64, completion: &str, ids: Vec<u32>, reward: f64) -> GenerationRecord {
    GenerationRecord {
        group_id,
        prompt: "Say something".into(),
        completion: completion.into(),
        prompt_ids: vec![1, 2, 3],
        completion_ids: ids,
        reward,
        rewards: vec![("length".into(), reward), ("xml_format".into(), f64::NAN)],
        advantage: reward - 0.5,
        finish_reason: "stop".into(),
    }
}

fn fill(store: &mut OutputStore) -> i64 {
    let run = store
        .start_run("test", "tiny", &serde_json::json!({"group_size": 2}))
        .unwrap();
    assert_eq!(store.next_group_id(run).unwrap(), 0);
    let step1 = vec![
        record(0, "a", vec![4, 5], 0.25),
        record(0, "bb", vec![6], 0.75),
    ];
    store
        .record_step(
            run,
            1,
            &serde_json::json!({"loss": 0.5, "reward_mean": 0.5, "reward_std": 0.25}),
            &step1,
        )
        .unwrap();
    assert_eq!(store.next_group_id(run).unwrap(), 1);
    let step2 = vec![
        record(1, "ccc\n\"quoted\"", vec![7, 8, 9], 1.0),
        record(1, "", vec![], f64::NAN),
    ];
    store
        .record_step(
            run,
            2,
            &serde_json::json!({"loss": -0.1, "reward_mean": 1.0, "reward_std": 0.0}),
            &step2,
        )
        .unwrap();
    run
}

#[test]
fn records_read_back_and_export() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("out.sqlite");
    let mut store = OutputStore::open(&db).unwrap();
    let run = fill(&mut store);
    // a second run in the same file stays apart
    let other = store
        .start_run("other", "tiny", &serde_json::json!({}))
        .unwrap();
    store
        .record_step(
            other,
            1,
            &serde_json::json!({"loss": 1.0}),
            &[record(0, "zzz", vec![1], 0.0)],
        )
        .unwrap();
    assert_eq!(store.latest_run().unwrap(), Some(other));
    drop(store);

    let store = OutputStore::open(&db).unwrap();
    let rows = store.generations(Some(run)).unwrap();
    assert_eq!(rows.len(), 4);
    assert_eq!(store.generations(None).unwrap().len(), 5);
    assert_eq!(
        (
            rows[2].step,
            rows[2].record.completion.as_str(),
            rows[2].record.completion_ids.clone()
        ),
        (2, "ccc\n\"quoted\"", vec![7, 8, 9])
    );
    assert!(
        rows[3].record.reward.is_nan(),
        "an unscorable reward reads back as NaN"
    );
    assert!(rows[0]
        .record
        .rewards
        .iter()
        .any(|(n, v)| n == "xml_format" && v.is_nan()));
    assert_eq!(
        format!("{:?}", rows[1].record),
        format!("{:?}", record(0, "bb", vec![6], 0.75)),
        "NaN != NaN: compared as text"
    );

    // JSONL: the --rollouts format
    let jsonl = dir.path().join("out.jsonl");
    assert_eq!(store.export_jsonl(Some(run), &jsonl).unwrap(), 4);
    let text = std::fs::read_to_string(&jsonl).unwrap();
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(first["group"], 0);
    assert_eq!(first["completion"], "a");
    assert_eq!(first["rewards"]["xml_format"], serde_json::Value::Null);
    let groups = load_rollouts(&jsonl, 2).unwrap();
    assert_eq!(groups.len(), 2);
    let batch = rollout_batch(&groups).unwrap();
    assert_eq!(batch.completions.len(), 4);
    assert_eq!(batch.completions[2].completion_ids, vec![7, 8, 9]);
    assert!(batch.total_rewards()[3].is_nan());
    assert!(
        load_rollouts(&jsonl, 3).is_err(),
        "groups of 2 are not groups of 3"
    );

    // XLSX: a zip archive (the openpyxl check is the ignored test below)
    let xlsx = dir.path().join("out.xlsx");
    assert_eq!(store.export_xlsx(Some(run), &xlsx).unwrap(), 4);
    let bytes = std::fs::read(&xlsx).unwrap();
    assert!(
        bytes.starts_with(b"PK\x03\x04") && bytes.len() > 2000,
        "{} bytes",
        bytes.len()
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "atomic writes leave no temporary file: {leftovers:?}"
    );
}

#[test]
fn bad_rollout_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let ok = "{\"group\": 0, \"prompt_ids\": [1], \"completion_ids\": [2], \"reward\": 1}\n{\"group\": 0, \"prompt_ids\": [1], \"completion_ids\": [3], \"reward\": 0}\n";
    assert_eq!(load_rollouts(&write("ok.jsonl", ok), 2).unwrap().len(), 1);
    let cases = [
        ("mixed.jsonl", "{\"group\": 0, \"prompt_ids\": [1], \"completion_ids\": [2], \"reward\": 1}\n{\"group\": 0, \"prompt_ids\": [9], \"completion_ids\": [3], \"reward\": 0}\n"),
        ("garbage.jsonl", "not json\n"),
        ("empty.jsonl", "\n"),
        ("noprompt.jsonl", "{\"group\": 0, \"prompt_ids\": [], \"completion_ids\": [2], \"reward\": 1}\n{\"group\": 0, \"prompt_ids\": [], \"completion_ids\": [3], \"reward\": 0}\n"),
        ("badgroup.jsonl", "{\"group\": [1], \"prompt_ids\": [1], \"completion_ids\": [2], \"reward\": 1}\n"),
    ];
    for (name, text) in cases {
        assert!(load_rollouts(&write(name, text), 2).is_err(), "{name}");
    }
    assert!(load_rollouts(Path::new("/nonexistent/rollouts.jsonl"), 2).is_err());
}

/// The XLSX export opens with Python's openpyxl (`python3` with openpyxl installed, or the
/// interpreter in `GRPO_PYTHON`): `cargo test -p mlx-training --test grpo_output_store -- --ignored`.
#[test]
#[ignore]
fn xlsx_opens_with_openpyxl() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = OutputStore::open(&dir.path().join("out.sqlite")).unwrap();
    let run = fill(&mut store);
    let xlsx = dir.path().join("out.xlsx");
    store.export_xlsx(Some(run), &xlsx).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/check_grpo_xlsx.py");
    let python = std::env::var("GRPO_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(python)
        .arg(script)
        .arg(&xlsx)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
}
