//! The three JSONL forms, loss masks, truncation, batches and line errors.
mod common;

use common::*;
use mlx_models::chat::{ChatFormat, ChatMessage, RenderOptions};
use mlx_training::data::{parse_line, TextEncoder};
use mlx_training::{load_jsonl, make_batch, Example, TrainError};

#[test]
fn pre_tokenised_lines() {
    let ex = parse_line(r#"{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5]}"#, &TextEncoder::none(), None).unwrap();
    assert_eq!(ex, Example { ids: vec![1, 2, 3, 4, 5], loss_mask: vec![false, false, false, true, true] });
    assert_eq!(ex.loss_tokens(), 2);
    let cut = parse_line(r#"{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5]}"#, &TextEncoder::none(), Some(4)).unwrap();
    assert_eq!(cut.ids, vec![1, 2, 3, 4]);
    for bad in [r#"{"prompt_ids": [1, -2], "completion_ids": [4]}"#, r#"{"prompt_ids": [1], "completion_ids": []}"#, r#"{"text": "x"}"#, "[1, 2]", "{", r#"{"prompt": "a", "completion": "b"}"#] {
        assert!(parse_line(bad, &TextEncoder::none(), None).is_err(), "{bad}");
    }
    assert!(parse_line(r#"{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5]}"#, &TextEncoder::none(), Some(3)).is_err(), "truncated away");
}

#[test]
fn prompt_completion_lines() {
    let dir = model_fixture("qwen3");
    let enc = TextEncoder::from_dir(&dir);
    let tok = enc.tokenizer().unwrap();
    let ex = parse_line(r#"{"prompt": "Hello there", "completion": " general Kenobi"}"#, &enc, None).unwrap();
    let p = tok.encode("Hello there", true).unwrap();
    let mut c = tok.encode(" general Kenobi", false).unwrap();
    c.push(tok.eos_token_ids()[0]);
    assert_eq!(ex, Example::prompt_completion(&p, &c), "completion and the end id are trained");
}

/// The loss covers exactly the assistant turns: the trained ids decode to the assistant
/// contents (with the template's turn end), and the whole sequence is the rendered conversation.
#[test]
fn messages_lines_train_on_assistant_turns_only() {
    let dir = model_fixture("qwen3");
    let enc = TextEncoder::from_dir(&dir);
    let line = r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "See you."}]}"#;
    let ex = parse_line(line, &enc, None).unwrap();
    let format = ChatFormat::from_dir(&dir).unwrap();
    let msgs: Vec<ChatMessage> = serde_json::from_str::<serde_json::Value>(line).unwrap()["messages"].as_array().unwrap().iter().map(|m| serde_json::from_value(m.clone()).unwrap()).collect();
    let full = format.render(&msgs, &RenderOptions { add_generation_prompt: false, ..Default::default() }).unwrap().text;
    let tok = format.tokenizer();
    assert_eq!(tok.decode(&ex.ids, false).unwrap(), full);
    // the trained spans, each decoded
    let mut spans = Vec::new();
    let mut cur: Vec<u32> = Vec::new();
    for (id, m) in ex.ids.iter().zip(&ex.loss_mask) {
        if *m {
            cur.push(*id);
        } else if !cur.is_empty() {
            spans.push(tok.decode(&std::mem::take(&mut cur), false).unwrap());
        }
    }
    if !cur.is_empty() {
        spans.push(tok.decode(&cur, false).unwrap());
    }
    assert_eq!(spans.len(), 2, "two assistant turns: {spans:?}");
    // Qwen3's template: an earlier answer as written, the last one (after the last user query)
    // with an empty think block
    assert_eq!(spans[0], "Hello!<|im_end|>");
    assert_eq!(spans[1], "<think>\n\n</think>\n\nSee you.<|im_end|>");
    assert!(parse_line(r#"{"messages": [{"role": "user", "content": "Hi"}]}"#, &enc, None).is_err(), "no assistant turn");
    // the llama fixture has no tokenizer: the error says why
    let e = parse_line(line, &TextEncoder::from_dir(&model_fixture("llama")), None).unwrap_err();
    assert!(e.contains("chat template") && e.contains("llama"), "{e}");
}

#[test]
fn jsonl_files_and_batches() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("d.jsonl");
    std::fs::write(&f, "{\"prompt_ids\": [1, 2], \"completion_ids\": [3]}\n\n{\"prompt_ids\": [4], \"completion_ids\": [5, 6, 7]}\n").unwrap();
    let ex = load_jsonl(&f, &TextEncoder::none(), None).unwrap();
    assert_eq!(ex.len(), 2);
    let b = make_batch(&[&ex[0], &ex[1]], 0).unwrap();
    assert_eq!((b.rows, b.width), (2, 3));
    assert_eq!(ids_of(&b.inputs), vec![1, 2, 3, 4, 5, 6], "inputs: every sequence but its last token");
    assert_eq!(b.positions, vec![1, 3, 4, 5], "flat positions whose next token is trained");
    assert_eq!(b.targets, vec![3, 5, 6, 7]);
    assert_eq!(b.tokens, 5);
    let c = make_batch(&[&ex[0], &Example { ids: vec![9, 8, 7, 6, 5], loss_mask: vec![false, false, true, true, true] }], 0).unwrap();
    assert_eq!(ids_of(&c.inputs), vec![1, 2, 3, 0, 9, 8, 7, 6], "right padding");
    std::fs::write(&f, "{\"prompt_ids\": [1, 2], \"completion_ids\": [3]}\n{\"prompt\": 3}\n").unwrap();
    match load_jsonl(&f, &TextEncoder::none(), None) {
        Err(TrainError::Data { line, .. }) => assert_eq!(line, 2),
        other => panic!("expected a line error, got {:?}", other.map(|v| v.len())),
    }
    std::fs::write(&f, "\n").unwrap();
    assert!(load_jsonl(&f, &TextEncoder::none(), None).is_err(), "empty dataset");
}

fn ids_of(a: &mlx_array::Array) -> Vec<u32> {
    a.reshape(&[-1]).unwrap().to_vec::<u32>().unwrap()
}
