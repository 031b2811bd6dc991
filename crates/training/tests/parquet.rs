//! Parquet datasets (fixtures and expected JSON lines by scripts/make_parquet_fixtures.py,
//! pyarrow): the conversion gives pyarrow's rows; the SFT loader reads the three dataset forms
//! from Parquet as from JSONL; damaged files (truncations, byte flips at every position,
//! garbage) give typed errors or rows, never a panic (the parquet crate's own panics, which
//! byte flips in its metadata trigger, are caught by the reader).
use mlx_training::parquet_data::{convert_parquet_to_jsonl, load_dataset, read_parquet_rows};
use mlx_training::{load_jsonl, TextEncoder, TrainError};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parquet").join(name)
}

fn jsonl(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn conversion_matches_pyarrow() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["prompt_completion", "ids", "messages"] {
        let out = tmp.path().join(format!("{name}.jsonl"));
        let r = convert_parquet_to_jsonl(&fixture(&format!("{name}.parquet")), &out).unwrap();
        let want = jsonl(&fixture(&format!("{name}.jsonl")));
        assert_eq!(r.rows, want.len(), "{name}");
        assert_eq!(jsonl(&out), want, "{name}: rows as pyarrow reads them");
        let keys: Vec<String> = want[0].as_object().unwrap().keys().cloned().collect();
        let mut cols = r.columns.clone();
        cols.sort();
        let mut keys = keys;
        keys.sort();
        assert_eq!(cols, keys);
    }
    // key order follows the file's columns
    let line = std::fs::read_to_string(tmp.path().join("prompt_completion.jsonl")).unwrap();
    assert!(line.starts_with("{\"prompt\":\"What is 2+2?\",\"completion\":\" 4\",\"meta\""), "{line}");
}

#[test]
fn sft_datasets_from_parquet() {
    let enc = TextEncoder::none();
    let ours = load_dataset(&fixture("ids.parquet"), &enc, None).unwrap();
    assert_eq!(ours, load_jsonl(&fixture("ids.jsonl"), &enc, None).unwrap());
    assert_eq!(ours.len(), 3);
    let truncated = load_dataset(&fixture("ids.parquet"), &enc, Some(5)).unwrap();
    assert!(truncated.iter().all(|e| e.ids.len() <= 5));
    // text forms need a tokenizer: the error names the file and row
    let err = load_dataset(&fixture("prompt_completion.parquet"), &enc, None).unwrap_err();
    assert!(matches!(&err, TrainError::Data { line: 1, .. }), "{err}");
    let tok = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny/qwen3");
    let enc = TextEncoder::from_dir(&tok);
    let pc = load_dataset(&fixture("prompt_completion.parquet"), &enc, None).unwrap();
    assert_eq!(pc, load_jsonl(&fixture("prompt_completion.jsonl"), &enc, None).unwrap());
}

#[test]
fn unsupported_codec_and_non_parquet_are_typed_errors() {
    let err = read_parquet_rows(&fixture("gzip.parquet")).unwrap_err();
    assert!(matches!(err, TrainError::Data { .. }), "{err}");
    assert!(err.to_string().contains("gzip.parquet"), "{err}");
    assert!(matches!(read_parquet_rows(&fixture("ids.jsonl")), Err(TrainError::Data { line: 0, .. })));
    assert!(matches!(read_parquet_rows(&fixture("missing.parquet")), Err(TrainError::Io { .. })));
}

/// Truncations (every length over the footer) and a byte flip at every position of each fixture, plus garbage: the reader
/// returns rows or a typed error (it must not panic). Reading a damaged file may succeed (a flip
/// inside a string value keeps the file valid); what it returns is not checked.
#[test]
fn damaged_files_never_panic() {
    // the parquet crate's own panics are caught and returned as errors; keep its hook quiet
    std::panic::set_hook(Box::new(|_| {}));
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.parquet");
    let mut cases = 0;
    let mut errors = 0;
    let mut check = |bytes: &[u8]| {
        std::fs::write(&path, bytes).unwrap();
        cases += 1;
        match read_parquet_rows(&path) {
            Ok(_) => {}
            Err(TrainError::Data { .. }) => errors += 1,
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    };
    for name in ["prompt_completion", "ids", "messages"] {
        let good = std::fs::read(fixture(&format!("{name}.parquet"))).unwrap();
        // every length over the footer (metadata) region, every 16th before it
        let footer = good.len().saturating_sub(600);
        for len in (0..footer).step_by(16).chain(footer..good.len()) {
            check(&good[..len]);
        }
        for i in 0..good.len() {
            let mut b = good.clone();
            b[i] ^= 0xFF;
            check(&b);
        }
    }
    let mut state = 0x1234_5678_9abc_def0u64;
    for n in [8usize, 12, 64, 300, 4096] {
        let mut g: Vec<u8> = (0..n).map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        }).collect();
        check(&g);
        g.extend_from_slice(b"PAR1");
        check(&g);
    }
    eprintln!("{cases} damaged files: {errors} typed errors, the rest read");
    assert!(errors > cases / 2);
}
