//! The real SmolLM2-135M-Instruct GGUF, converted by mlx-convert, against an independent numpy
//! forward of the same converted weights (`scripts/llama_numpy_reference.py`, whose output is
//! `fixtures/smollm2-135m-instruct.numpy.json`): the chat prompt's ids, the top-5 next-token
//! logits, and the greedy answer "The capital of France is Paris.".
//! Ignored: needs the GGUF (`scripts/fetch_gguf.sh`).
mod common;
use common::*;
use mlx_models::chat::{ChatFormat, ChatMessage, RenderOptions};
use std::path::PathBuf;

#[test]
#[ignore]
fn smollm2_answers_like_the_numpy_reference() {
    let home = PathBuf::from(std::env::var_os("HOME").expect("HOME"));
    let gguf = home.join(".cache/mlx-models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(gguf.exists(), "{} missing: run scripts/fetch_gguf.sh", gguf.display());
    let dir = tempfile::tempdir().unwrap();
    let opts = mlx_convert::GgufToHfOptions { dtype: mlx_convert::OutDtype::F32, config_from: None };
    mlx_convert::gguf_to_hf(&gguf, dir.path(), &opts, |_| {}).unwrap();

    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2-135m-instruct.numpy.json")).unwrap()).unwrap();
    let want_ids: Vec<u32> = r["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let format = ChatFormat::from_dir(dir.path()).unwrap();
    let prompt = format.render(&[ChatMessage::user("What is the capital of France?")], &RenderOptions::default()).unwrap().ids;
    assert_eq!(prompt, want_ids, "chat template + tokenizer");

    let model = mlx_models::load_model(dir.path(), &mlx_models::LoadOptions { dtype: Some(mlx_array::DType::F32), ..Default::default() })
        .unwrap()
        .into_lm()
        .unwrap();
    let logits = full_logits(&model, &prompt);
    let last = logits.last().unwrap();
    for pair in r["top5"].as_array().unwrap() {
        let (id, v) = (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap() as f32);
        assert!((last[id] - v).abs() <= 1e-3 * v.abs(), "logit of {id}: {} vs numpy {v}", last[id]);
    }
    let mut cache = model.new_cache();
    let (toks, _) = greedy_cached(&model, &mut cache, &prompt, 8);
    let want: Vec<u32> = r["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(toks, want[..8]);
    let text = format.tokenizer().decode(&toks[..7], true).unwrap();
    assert_eq!(text, "The capital of France is Paris.");
}
