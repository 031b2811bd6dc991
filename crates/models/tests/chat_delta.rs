//! Continuation deltas: what to append to a cache on a turn boundary.
use std::path::{Path, PathBuf};

use mlx_models::chat::{
    ChatFormat, ChatMessage, DeltaKind, PromptPlan, RenderOptions, ToolDefinition, TOOL_ERROR_MARKER,
};
use serde_json::json;

fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny").join(name)
}

/// What a session holds after a turn: the prompt ids plus the generated reply ids (stop token
/// included), and the history with the parsed reply appended.
fn after_reply(fmt: &ChatFormat, msgs: &[ChatMessage], reply: &str, opts: &RenderOptions) -> (Vec<ChatMessage>, Vec<u32>) {
    let p = fmt.render(msgs, opts).unwrap();
    let mut cached = p.ids.clone();
    let mut dec = fmt.stream_decoder();
    let mut parser = fmt.parser(opts, p.starts_in_thinking, None);
    let reply_ids = fmt.tokenizer().encode(reply, false).unwrap();
    assert_eq!(reply_ids.last(), Some(&fmt.turn_end().unwrap().1), "reply must end with the turn end");
    for &id in &reply_ids {
        if let Some(d) = dec.step(id).unwrap() {
            parser.push(&d);
        }
    }
    parser.push(&dec.finish().unwrap());
    parser.finish();
    cached.extend(&reply_ids);
    let mut history = msgs.to_vec();
    history.push(parser.output().to_assistant_message());
    (history, cached)
}

/// The format of fixture `name`, and the history and cache after `user` was answered with `reply`
/// (default render options).
fn first_turn(name: &str, user: &str, reply: &str) -> (ChatFormat, Vec<ChatMessage>, Vec<u32>) {
    let fmt = ChatFormat::from_dir(tiny(name)).unwrap();
    let (history, cached) = after_reply(&fmt, &[ChatMessage::user(user)], reply, &RenderOptions::default());
    (fmt, history, cached)
}

#[test]
fn exact_delta_when_history_re_renders_identically() {
    // Gemma's template renders an old assistant turn exactly as generated.
    let (fmt, history, cached) = first_turn("gemma4", "Hello", "Hi there.<end_of_turn>");
    let opts = RenderOptions::default();
    let new = [ChatMessage::user("How are you?")];
    let plan = fmt.plan_continuation(&history, &cached, &new, &opts).unwrap();
    let PromptPlan::Append { delta, delta_text, cached_tokens, kind, .. } = plan else { panic!("{plan:?}") };
    assert_eq!(kind, DeltaKind::Exact);
    assert_eq!(cached_tokens, cached.len());
    assert_eq!(delta_text, "\n<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n");
    // cache + delta == a fresh render of the whole conversation.
    let mut all = history.clone();
    all.extend(new);
    let mut joined = cached.clone();
    joined.extend(&delta);
    assert_eq!(joined, fmt.render(&all, &opts).unwrap().ids);
}

#[test]
fn turn_boundary_delta_when_template_drops_old_thinking() {
    let (fmt, history, cached) = first_turn("qwen3", "2+2?", "<think>\nadd them\n</think>\n\n4<|im_end|>");
    let opts = RenderOptions::default();
    assert_eq!(history[1].reasoning_content.as_deref(), Some("add them"));
    assert_eq!(history[1].content, "4");
    let plan = fmt.plan_continuation(&history, &cached, &[ChatMessage::user("3+3?")], &opts).unwrap();
    let PromptPlan::Append { delta, delta_text, cached_tokens, kind, starts_in_thinking } = plan else { panic!("{plan:?}") };
    assert_eq!(kind, DeltaKind::TurnBoundary);
    assert_eq!(cached_tokens, cached.len());
    assert!(!starts_in_thinking);
    assert_eq!(delta_text, "\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(delta, fmt.tokenizer().encode(&delta_text, false).unwrap());
    // The cache keeps the thinking the model generated: cache + delta decodes to the transcript.
    let mut joined = cached.clone();
    joined.extend(&delta);
    assert_eq!(
        fmt.tokenizer().decode(&joined, false).unwrap(),
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    );
    // Thinking off: the delta ends with the closed think block.
    let off = RenderOptions { enable_thinking: Some(false), ..Default::default() };
    let PromptPlan::Append { delta_text, .. } = fmt.plan_continuation(&history, &cached, &[ChatMessage::user("x")], &off).unwrap() else { panic!() };
    assert!(delta_text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{delta_text:?}");
}

#[test]
fn tool_result_delta_marks_errors() {
    let fmt = ChatFormat::from_dir(tiny("qwen3")).unwrap();
    let tools = vec![ToolDefinition::function("get_weather", "weather", json!({"type": "object", "properties": {}}))];
    let opts = RenderOptions { tools: Some(tools), ..Default::default() };
    let first = [ChatMessage::user("Weather in Paris?")];
    let reply = "<think>\nneed tool\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>";
    let (history, cached) = after_reply(&fmt, &first, reply, &opts);
    let calls = history[1].tool_calls.clone().unwrap();
    assert_eq!((calls[0].name.as_str(), &calls[0].arguments), ("get_weather", &json!({"city": "Paris"})));
    let id = calls[0].id.clone().unwrap();
    for (is_error, body) in [(false, "timeout"), (true, &*format!("{TOOL_ERROR_MARKER}timeout"))] {
        let new = [ChatMessage::tool(id.clone(), "timeout").with_error(is_error)];
        let PromptPlan::Append { delta_text, kind, .. } = fmt.plan_continuation(&history, &cached, &new, &opts).unwrap() else { panic!() };
        // A tool result is not a new query, so Qwen3 keeps this turn's <think> block: the
        // re-rendered conversation starts with the cache exactly.
        assert_eq!(kind, DeltaKind::Exact);
        assert_eq!(delta_text, format!("\n<|im_start|>user\n<tool_response>\n{body}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"));
    }
    // A tool result for a call that was never made is an error, not a delta.
    let bad = [ChatMessage::tool("call_zz", "x")];
    assert!(fmt.plan_continuation(&history, &cached, &bad, &opts).is_err());
}

#[test]
fn cut_reply_gets_its_turn_closed() {
    let fmt = ChatFormat::from_dir(tiny("qwen3")).unwrap();
    let opts = RenderOptions::default();
    let first = [ChatMessage::user("Tell me a story")];
    let p = fmt.render(&first, &opts).unwrap();
    let mut cached = p.ids.clone();
    cached.extend(fmt.tokenizer().encode("Once upon", false).unwrap()); // length limit hit
    let mut history = first.to_vec();
    history.push(ChatMessage::assistant("Once upon"));
    let PromptPlan::Append { delta_text, kind, .. } = fmt.plan_continuation(&history, &cached, &[ChatMessage::user("go on")], &opts).unwrap() else { panic!() };
    assert_eq!(kind, DeltaKind::Exact);
    assert_eq!(delta_text, "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n");
    // Same with a thinking reply cut short (the template drops it, so only the turn-boundary
    // path applies): the delta closes the cut turn first.
    let mut cached = p.ids.clone();
    cached.extend(fmt.tokenizer().encode("<think>\nhmm\n</think>\n\nOnce upon", false).unwrap());
    let mut history = first.to_vec();
    history.push(ChatMessage::assistant("Once upon").with_reasoning("hmm"));
    let PromptPlan::Append { delta_text, kind, .. } = fmt.plan_continuation(&history, &cached, &[ChatMessage::user("go on")], &opts).unwrap() else { panic!() };
    assert_eq!(kind, DeltaKind::TurnBoundary);
    assert_eq!(delta_text, "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n");
}

#[test]
fn mismatched_cache_asks_for_a_reprefill() {
    let (fmt, history, mut cached) = first_turn("qwen3", "a", "b<|im_end|>");
    let opts = RenderOptions::default();
    // The cache holds one more turn than the history says.
    let extra = fmt.tokenizer().encode("\n<|im_start|>user\nz<|im_end|>", false).unwrap();
    cached.extend(&extra);
    let plan = fmt.plan_continuation(&history, &cached, &[ChatMessage::user("c")], &opts).unwrap();
    let PromptPlan::Reprefill { prompt, common_prefix, reason } = plan else { panic!("{plan:?}") };
    assert!(reason.contains("turn ends"), "{reason}");
    assert_eq!(prompt.text, "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n");
    assert!(common_prefix > 0 && common_prefix < cached.len());
    // History that does not end with the assistant reply.
    let plan = fmt.plan_continuation(&history[..1], &cached, &[ChatMessage::user("c")], &opts).unwrap();
    assert!(matches!(plan, PromptPlan::Reprefill { .. }));
    // Prefix reuse on a fresh start.
    let (p, reused) = fmt.render_reusing(&[ChatMessage::user("a")], &cached, &opts).unwrap();
    // The whole prompt is in the cache (the caller still has to run its last token for logits).
    assert_eq!(reused, p.ids.len());
    let (p, reused) = fmt.render_reusing(&[ChatMessage::user("q")], &cached, &opts).unwrap();
    assert_eq!(reused, 4, "<|im_start|>user\\n then the content differs: {:?}", p.ids);
}
