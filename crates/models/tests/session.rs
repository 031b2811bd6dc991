//! Chat sessions: template → greedy reply equals the transformers reference, multi-turn cache
//! reuse equals recomputation, streaming, cancellation, threads, bad input.
mod common;
use common::*;
use mlx_models::chat::ChatMessage;
use mlx_models::{load_model, load_session, ChatConfig, ChatSession, FinishReason, StreamEvent};
use sampling::SamplingOverrides;

fn session() -> ChatSession {
    load_session(fixture("qwen3"), &test_load_options()).unwrap()
}

#[test]
fn first_turn_matches_reference() {
    let r = reference("qwen3");
    let mut s = session();
    let res = s.start(vec![ChatMessage::user("Hello! What is 2+2?")], &greedy_chat(16)).unwrap();
    let want = ids(&r["chat_greedy_ids"]);
    let prompt = ids(&r["chat_input_ids"]);
    assert_eq!(res.finish_reason, FinishReason::Length);
    assert_eq!(res.num_tokens, 16);
    assert_eq!(res.prompt_tokens, prompt.len());
    assert_eq!(res.cached_tokens, 0);
    assert_eq!(s.cached_ids(), &want[..], "cache holds prompt + reply");
    let text = s.format().tokenizer().decode(&want[prompt.len()..], true).unwrap();
    assert_eq!(res.raw_text, text);
    assert_eq!(s.history().len(), 2);
}

#[test]
fn continued_turn_reuses_cache_and_equals_recompute() {
    let mut s = session();
    s.start(vec![ChatMessage::system("Be brief."), ChatMessage::user("Hi")], &greedy_chat(6)).unwrap();
    let turn1 = s.cached_ids().len();
    let res = s.continue_with("And then?", &greedy_chat(8)).unwrap();
    assert_eq!(res.cached_tokens, turn1, "the whole first turn is reused");
    assert!(res.prompt_tokens > turn1);
    // Recompute: the same token prompt on a fresh cache gives the same reply tokens.
    check_reply_equals_fresh_generation("qwen3", &s, &res);

    // A tool result for a call the model never made is refused, and the session goes on.
    assert!(s.continue_tool("call_7", "{}", false, &greedy_chat(4)).is_err());
    // Restarting with the same conversation prefix reuses it too.
    let hist = s.history()[..2].to_vec();
    let res = s.start(hist, &greedy_chat(4)).unwrap();
    assert!(res.cached_tokens > 0);
}

#[test]
fn tool_results_render_and_continue() {
    use mlx_models::chat::ToolCall;
    let mut s = session();
    let call = ToolCall { id: Some("call_0".into()), name: "get_weather".into(), arguments: serde_json::json!({"city": "Paris"}) };
    let msgs = vec![
        ChatMessage::user("Weather in Paris?"),
        ChatMessage::assistant("").with_tool_calls(vec![call]),
        ChatMessage::tool("call_0", "sunny").with_error(true),
    ];
    let res = s.start(msgs, &greedy_chat(4)).unwrap();
    let prompt = s.format().tokenizer().decode(&s.cached_ids()[..res.prompt_tokens], false).unwrap();
    assert!(prompt.contains("<tool_response>") && prompt.contains("sunny"), "{prompt}");
    assert!(prompt.contains(mlx_models::chat::TOOL_ERROR_MARKER), "errored tool results are marked: {prompt}");
    let res2 = s.continue_with("thanks", &greedy_chat(4)).unwrap();
    assert_eq!(res2.cached_tokens, res.prompt_tokens + res.num_tokens + usize::from(res.finish_reason == FinishReason::Stop));
}

#[test]
fn reuse_off_prefills_everything() {
    let mut s = session();
    let cfg = ChatConfig { reuse_cache: false, ..greedy_chat(4) };
    s.start(vec![ChatMessage::user("Hi")], &cfg).unwrap();
    let res = s.continue_with("more", &cfg).unwrap();
    assert_eq!(res.cached_tokens, 0);
}

#[test]
fn streaming_and_cancel() {
    let mut s = session();
    let mut text = String::new();
    let mut done = None;
    for ev in s.start_stream(vec![ChatMessage::user("Tell me a story")], &greedy_chat(12)).unwrap() {
        match ev.unwrap() {
            StreamEvent::Text(t) => text.push_str(&t),
            StreamEvent::Thinking(_) | StreamEvent::ToolCall(_) => {}
            StreamEvent::Done(r) => done = Some(r),
        }
    }
    let r = done.expect("a Done event");
    assert_eq!(text, r.text);

    let stream = s.start_stream(vec![ChatMessage::user("Again")], &ChatConfig { report_performance: true, ..greedy_chat(40) }).unwrap();
    let cancel = stream.cancel_handle();
    let mut seen = 0;
    let mut result = None;
    for ev in stream {
        match ev.unwrap() {
            StreamEvent::Done(r) => result = Some(r),
            _ => {
                seen += 1;
                if seen == 2 {
                    let c = cancel.clone();
                    std::thread::spawn(move || c.cancel()).join().unwrap();
                }
            }
        }
    }
    let r = result.unwrap();
    assert_eq!(r.finish_reason, FinishReason::Cancelled);
    assert!(r.num_tokens < 40);
    assert!(r.performance.unwrap().decode_tokens_per_sec > 0.0);
}

#[test]
fn sessions_on_several_threads() {
    let model = load_model(fixture("qwen3"), &test_load_options()).unwrap().into_lm().unwrap();
    let run = |m: mlx_models::Model, q: &str| {
        let mut s = ChatSession::new(m).unwrap();
        s.start(vec![ChatMessage::user(q)], &greedy_chat(10)).unwrap().raw_text
    };
    let a = run(model.clone(), "one");
    let b = run(model.clone(), "two");
    let (m1, m2) = (model.clone(), model.clone());
    let t1 = std::thread::spawn(move || run(m1, "one"));
    let t2 = std::thread::spawn(move || run(m2, "two"));
    assert_eq!(t1.join().unwrap(), a);
    assert_eq!(t2.join().unwrap(), b);
}

#[test]
fn bad_input() {
    let mut s = session();
    assert!(s.start(vec![], &greedy_chat(4)).is_err());
    assert!(s.continue_with("x", &greedy_chat(4)).is_err(), "continue before start");
    let tool_first = vec![ChatMessage::tool("call_9", "result")];
    assert!(s.start(tool_first, &greedy_chat(4)).is_err());
    let bad = ChatConfig { sampling: SamplingOverrides { top_p: Some(1.5), ..Default::default() }, ..greedy_chat(4) };
    assert!(s.start(vec![ChatMessage::user("x")], &bad).is_err());
    let e = load_session(fixture("qwen3_embed"), &test_load_options()).err().unwrap().to_string();
    assert_eq!(e, "load_session: embedding models (Harrier) cannot be wrapped in a ChatSession");
    // The session still works after the errors.
    assert!(s.start(vec![ChatMessage::user("x")], &greedy_chat(2)).is_ok());
}
