//! Tokenizer loading, special tokens, and the incremental decoder.
use std::path::{Path, PathBuf};

use mlx_models::chat::{ChatError, Tokenizer};

fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny").join(name)
}

const MULTIBYTE: &str = "naïve café — 東京 🚀 ok\n日本語のテキスト ĀĒĪ 👍🏽!";

#[test]
fn special_tokens_from_side_files() {
    let q = Tokenizer::from_dir(tiny("qwen3")).unwrap();
    let s = q.special_tokens();
    assert_eq!(s.bos_token, None);
    assert_eq!(s.eos_token.as_deref(), Some("<|im_end|>"));
    assert_eq!(q.eos_token_ids(), &[488]);
    assert_eq!(q.token_to_id("<|im_start|>"), Some(487));
    assert_eq!(s.pad_token_id, Some(486));
    assert!(q.is_special(488));
    assert!(!q.is_special(q.token_to_id("<think>").unwrap()));

    let g = Tokenizer::from_dir(tiny("gemma4")).unwrap();
    let s = g.special_tokens();
    assert_eq!(s.bos_token.as_deref(), Some("<bos>"));
    assert_eq!(s.bos_token_id, Some(2));
    assert!(s.add_bos_token);
    // generation_config eos (1 = <eos>) first, then tokenizer_config eos_token <end_of_turn> (106).
    assert_eq!(g.eos_token_ids(), &[1, 106]);
    assert_eq!(s.extra.get("boi_token").map(String::as_str), Some("<start_of_image>"));
}

#[test]
fn eos_may_be_a_list_or_nested_in_text_config() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny("qwen3").join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": [488, 486]}"#).unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"text_config": {"eos_token_id": 3}, "eos_token_id": null}"#).unwrap();
    let t = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(t.eos_token_ids(), &[488, 486, 3]);

    std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": "x"}"#).unwrap();
    let e = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(e, ChatError::MalformedFile { .. }), "{e:?}");
    assert!(e.to_string().contains("\"eos_token_id\" must be a token id or a list of token ids"), "{e}");

    std::fs::write(dir.path().join("generation_config.json"), "{not json").unwrap();
    assert!(matches!(Tokenizer::from_dir(dir.path()), Err(ChatError::MalformedFile { .. })));
}

#[test]
fn load_errors() {
    let empty = tempfile::tempdir().unwrap();
    let e = Tokenizer::from_dir(empty.path()).unwrap_err();
    assert!(matches!(e, ChatError::TokenizerNotFound(_)));
    assert!(e.to_string().starts_with("tokenizer.json not found in "));
    std::fs::write(empty.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    assert!(matches!(Tokenizer::from_dir(empty.path()), Err(ChatError::TokenizerLoad { .. })));
}

#[test]
fn encode_decode_round_trip() {
    for fx in ["qwen3", "gemma4"] {
        let t = Tokenizer::from_dir(tiny(fx)).unwrap();
        let ids = t.encode(MULTIBYTE, false).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), MULTIBYTE, "{fx}");
    }
    // Gemma's post-processor adds <bos> only when asked.
    let g = Tokenizer::from_dir(tiny("gemma4")).unwrap();
    assert_eq!(g.encode("hi", true).unwrap()[0], 2);
    assert_ne!(g.encode("hi", false).unwrap()[0], 2);
}

/// Deltas of the stream decoder, fed any way, concatenate to the full decode, and no delta
/// ever carries a broken character.
#[test]
fn stream_decoder_multibyte_split_everywhere() {
    for fx in ["qwen3", "gemma4"] {
        let t = Tokenizer::from_dir(tiny(fx)).unwrap();
        let mut text = String::from(MULTIBYTE);
        text.push_str("<|im_end|>");
        let ids = t.encode(&text, false).unwrap();
        // The tiny vocabularies split most of these characters into byte tokens.
        assert!(ids.len() > MULTIBYTE.chars().count() / 2, "{fx}: {}", ids.len());
        for skip in [false, true] {
            let full = t.decode(&ids, skip).unwrap();
            // One id at a time.
            let mut d = t.stream_decoder(skip);
            let mut out = String::new();
            for &id in &ids {
                if let Some(delta) = d.step(id).unwrap() {
                    assert!(!delta.contains('\u{FFFD}'), "{fx}: broken char in {delta:?}");
                    out.push_str(&delta);
                }
            }
            out.push_str(&d.finish().unwrap());
            assert_eq!(out, full, "{fx} skip={skip}");
            // Two chunks split at every position.
            for k in 0..=ids.len() {
                let mut d = t.stream_decoder(skip);
                let mut out = d.step_many(&ids[..k]).unwrap();
                out.push_str(&d.step_many(&ids[k..]).unwrap());
                out.push_str(&d.finish().unwrap());
                assert_eq!(out, full, "{fx} skip={skip} split at {k}");
            }
        }
    }
}

#[test]
fn stream_decoder_holds_back_a_partial_character_until_complete() {
    let t = Tokenizer::from_dir(tiny("qwen3")).unwrap();
    let ids = t.encode("🚀", false).unwrap();
    assert!(ids.len() >= 2, "the emoji is several byte tokens here");
    let mut d = t.stream_decoder(false);
    for &id in &ids[..ids.len() - 1] {
        assert_eq!(d.step(id).unwrap(), None);
    }
    assert_eq!(d.step(*ids.last().unwrap()).unwrap().as_deref(), Some("🚀"));
    assert_eq!(d.finish().unwrap(), "");
    // A cut-off character is flushed by finish() as the full decode shows it.
    let mut d = t.stream_decoder(false);
    assert_eq!(d.step(ids[0]).unwrap(), None);
    assert_eq!(d.finish().unwrap(), t.decode(&ids[..1], false).unwrap());
}
