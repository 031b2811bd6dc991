//! Output parser: thinking / text / tool calls, incremental at any split; thinking budget.
use mlx_models::chat::{
    ChatEvent, OutputParser, ParsedOutput, ParserOptions, Role, ThinkingBudget, ToolCallStatus,
};
use proptest::prelude::*;
use serde_json::json;

const SAMPLE: &str = "<think>\nThe user wants weather in 東京 🌧.\nCall the tool.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"東京\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"broken\", \"arguments\": {\"city\": \"Paris\"\n</tool_call>\nDone </think> <tool_ca";

fn whole(opts: &ParserOptions, text: &str) -> ParsedOutput {
    OutputParser::parse_all(opts.clone(), text)
}

/// The reason of a call reported malformed (any other status fails the test).
fn malformed_reason(status: &ToolCallStatus) -> &str {
    match status {
        ToolCallStatus::Malformed { reason } => reason,
        s => panic!("expected a malformed call, got {s:?}"),
    }
}

/// `out` holds `thinking` and `text` and three calls: `get_weather` with `args`, then a call
/// named `broken` and a nameless one, both malformed, their reasons containing `reasons`.
fn check_three_calls(out: &ParsedOutput, (thinking, text): (&str, &str), args: serde_json::Value, reasons: [&str; 2]) {
    assert_eq!(out.thinking.as_deref(), Some(thinking));
    assert_eq!(out.text, text);
    assert_eq!(out.tool_calls.len(), 3);
    let c = &out.tool_calls[0];
    assert_eq!((c.name.as_str(), &c.status), ("get_weather", &ToolCallStatus::Ok));
    assert_eq!(c.arguments, args);
    assert_eq!(out.tool_calls[1].name, "broken");
    for (call, want) in out.tool_calls[1..].iter().zip(reasons) {
        let reason = malformed_reason(&call.status);
        assert!(reason.contains(want), "{reason}");
    }
}

/// Feeding `text` split at any one byte gives `out` (tool calls, text and thinking).
fn check_every_split(opts: &ParserOptions, text: &str, out: &ParsedOutput) {
    for cut in 0..=text.len() {
        let (split, _) = split_feed(opts, text, &[cut]);
        assert_eq!(split.tool_calls, out.tool_calls, "split at {cut}");
        assert_eq!((split.text.as_str(), split.thinking.as_deref()), (out.text.as_str(), out.thinking.as_deref()), "split at {cut}");
    }
}

/// Feed `text` split at the given byte positions (snapped to char boundaries); returns the
/// output and the events.
fn split_feed(opts: &ParserOptions, text: &str, cuts: &[usize]) -> (ParsedOutput, Vec<ChatEvent>) {
    let mut cuts: Vec<usize> = cuts.iter().map(|&c| c % (text.len() + 1)).filter(|&c| text.is_char_boundary(c)).collect();
    cuts.sort();
    cuts.push(text.len());
    let mut p = OutputParser::new(opts.clone());
    let mut events = Vec::new();
    let mut last = 0;
    for c in cuts {
        events.extend(p.push(&text[last..c]));
        last = c;
    }
    events.extend(p.finish());
    (p.output(), events)
}

#[test]
fn splits_thinking_text_and_tool_calls() {
    let out = whole(&ParserOptions::default(), SAMPLE);
    assert_eq!(out.thinking.as_deref(), Some("The user wants weather in 東京 🌧.\nCall the tool."));
    // The trailing partial marker "<tool_ca" is plain text at the end; a stray </think> is dropped.
    // Whitespace around the calls is kept between answer pieces (one newline each side).
    assert_eq!(out.text, "Let me check.\n\n\nDone  <tool_ca");
    assert_eq!(out.tool_calls.len(), 2);
    let ok = &out.tool_calls[0];
    assert_eq!(ok.status, ToolCallStatus::Ok);
    assert_eq!(ok.name, "get_weather");
    assert_eq!(ok.arguments, json!({"city": "東京", "days": 2}));
    assert_eq!(ok.id, "call_0");
    assert_eq!(out.raw_text, SAMPLE);
}

#[test]
fn malformed_tool_call_is_reported_not_dropped() {
    let out = whole(&ParserOptions::default(), SAMPLE);
    let bad = &out.tool_calls[1];
    assert_eq!(bad.id, "call_1");
    assert_eq!(bad.name, "broken", "best-effort name");
    assert_eq!(bad.arguments, serde_json::Value::Null);
    assert_eq!(bad.raw, "\n{\"name\": \"broken\", \"arguments\": {\"city\": \"Paris\"\n");
    let reason = malformed_reason(&bad.status);
    assert!(reason.starts_with("invalid JSON: "), "{reason}");
    // Other malformed shapes.
    for (body, reason) in [
        ("[1, 2]", "expected a JSON object, got an array"),
        ("{\"arguments\": {}}", "missing \"name\""),
        ("{\"name\": 3}", "\"name\" must be a string, got a number"),
        ("{\"name\": \"f\", \"arguments\": [1]}", "\"arguments\" must be an object, got an array"),
        ("{\"name\": \"f\", \"arguments\": \"{oops\"}", "\"arguments\" string is not valid JSON"),
    ] {
        let out = whole(&ParserOptions::default(), &format!("<tool_call>{body}</tool_call>"));
        match &out.tool_calls[0].status {
            ToolCallStatus::Malformed { reason: r } => assert!(r.starts_with(reason), "{body}: {r}"),
            s => panic!("{body}: {s:?}"),
        }
    }
    // Arguments given as a JSON string, or as "parameters", or missing.
    let out = whole(&ParserOptions::default(), "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call><tool_call>{\"name\": \"g\", \"parameters\": {\"b\": 2}}</tool_call><tool_call>{\"name\": \"h\"}</tool_call>");
    let args: Vec<_> = out.tool_calls.iter().map(|c| (c.name.as_str(), c.arguments.clone(), c.is_ok())).collect();
    assert_eq!(args, vec![("f", json!({"a": 1}), true), ("g", json!({"b": 2}), true), ("h", json!({}), true)]);
    // An unterminated call (cut by the length limit) is parsed as it stands.
    let out = whole(&ParserOptions::default(), "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n");
    assert!(out.tool_calls[0].is_ok());
    let out = whole(&ParserOptions::default(), "<tool_call>\n{\"name\": \"f\", \"argu");
    assert!(matches!(&out.tool_calls[0].status, ToolCallStatus::Malformed { reason } if reason.starts_with("unterminated tool call: ")));
}

#[test]
fn starts_in_thinking_and_include_reasoning() {
    let opts = ParserOptions { starts_in_thinking: true, ..Default::default() };
    let out = whole(&opts, "\nhmm, 2+2\n</think>\n\n4");
    assert_eq!(out.thinking.as_deref(), Some("hmm, 2+2"));
    assert_eq!(out.text, "4");
    // Reasoning dropped ("none" effort): no thinking events, no thinking field; text unchanged.
    let opts = ParserOptions { include_reasoning: false, ..Default::default() };
    let mut p = OutputParser::new(opts);
    let mut ev = p.push("<think>\nsecret\n</think>\n\nanswer");
    ev.extend(p.finish());
    assert!(ev.iter().all(|e| !matches!(e, ChatEvent::ThinkingDelta(_))));
    assert_eq!(p.output().thinking, None);
    assert_eq!(p.output().text, "answer");
    // Output cut inside the think block: all of it is thinking.
    let out = whole(&ParserOptions::default(), "<think>\nstill going");
    assert_eq!((out.thinking.as_deref(), out.text.as_str()), (Some("still going"), ""));
    // A model without think tags keeps them as text.
    let opts = ParserOptions { think: None, tool_calls: None, ..Default::default() };
    assert_eq!(whole(&opts, "<think>x</think> <tool_call>{}</tool_call>").text, "<think>x</think> <tool_call>{}</tool_call>");
}

#[test]
fn events_stream_in_order_and_to_assistant_message() {
    let mut p = OutputParser::new(ParserOptions::default());
    let mut ev = Vec::new();
    for piece in ["<thi", "nk>\nA", "B\n</th", "ink>\n\nHel", "lo <tool_call>{\"name\":\"f\",\"arguments\":{\"x\":1}}</tool_call>"] {
        ev.extend(p.push(piece));
    }
    ev.extend(p.finish());
    assert_eq!(
        ev,
        vec![
            ChatEvent::ThinkingDelta("A".into()),
            ChatEvent::ThinkingDelta("B".into()),
            ChatEvent::TextDelta("Hel".into()),
            ChatEvent::TextDelta("lo".into()),
            ChatEvent::ToolCall(p.output().tool_calls[0].clone()),
        ]
    );
    let m = p.output().to_assistant_message();
    assert_eq!(m.role, Role::Assistant);
    assert_eq!(m.content, "Hello");
    assert_eq!(m.reasoning_content.as_deref(), Some("AB"));
    let calls = m.tool_calls.unwrap();
    assert_eq!((calls[0].id.as_deref(), calls[0].name.as_str(), &calls[0].arguments), (Some("call_0"), "f", &json!({"x": 1})));
}

/// A malformed call (here a random model's `<tool_call> null </tool_call>`) is reported, but the
/// history message keeps only well-formed calls, so the next turn's messages still validate.
#[test]
fn malformed_calls_stay_out_of_the_history_message() {
    use mlx_models::chat::{validate_messages, ChatMessage};
    let out = whole(&ParserOptions::default(), "Hi <tool_call> null </tool_call> and <tool_call>{\"name\": \"f\"}</tool_call>");
    assert_eq!(out.tool_calls.len(), 2);
    assert!(!out.tool_calls[0].is_ok() && out.tool_calls[1].is_ok());
    let m = out.to_assistant_message();
    let calls = m.tool_calls.clone().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].name, "f");
    validate_messages(&[ChatMessage::user("hello"), m, ChatMessage::user("and then?")]).unwrap();
    let only_bad = whole(&ParserOptions::default(), "<tool_call>{\"arguments\": {}}</tool_call>").to_assistant_message();
    assert!(only_bad.tool_calls.is_none());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Any split of the output gives the same result and the same concatenated events.
    #[test]
    fn any_split_equals_whole(cuts in proptest::collection::vec(0usize..400, 0..40), start_in in any::<bool>(), include in any::<bool>()) {
        let opts = ParserOptions { starts_in_thinking: start_in, include_reasoning: include, ..Default::default() };
        let text = if start_in { &SAMPLE["<think>".len()..] } else { SAMPLE };
        let expect = whole(&opts, text);
        let (got, events) = split_feed(&opts, text, &cuts);
        prop_assert_eq!(&got, &expect);
        prop_assert_eq!(ParsedOutput::from_events(&events), ParsedOutput { raw_text: String::new(), ..expect });
    }
}

#[test]
fn split_at_every_byte_equals_whole() {
    let opts = ParserOptions::default();
    let expect = whole(&opts, SAMPLE);
    // One byte (char) at a time.
    let every: Vec<usize> = (0..SAMPLE.len()).collect();
    let (got, events) = split_feed(&opts, SAMPLE, &every);
    assert_eq!(got, expect);
    assert_eq!(ParsedOutput::from_events(&events).text, expect.text);
    // And every two-piece split.
    for k in 0..=SAMPLE.len() {
        if SAMPLE.is_char_boundary(k) {
            assert_eq!(split_feed(&opts, SAMPLE, &[k]).0, expect, "split at {k}");
        }
    }
}

#[test]
fn thinking_budget_forces_the_end_token() {
    const START: u32 = 10;
    const END: u32 = 11;
    // Budget 3, model opens the block itself.
    let mut b = ThinkingBudget::new(Some(3), Some(START), END, false);
    let mut out = Vec::new();
    let model = [START, 1, 2, 3, 4, 5, 6];
    let mut it = model.iter();
    for _ in 0..6 {
        let t = b.forced_token().unwrap_or_else(|| *it.next().unwrap());
        b.observe(t);
        out.push(t);
    }
    assert_eq!(out, vec![START, 1, 2, 3, END, 4]);
    assert_eq!(b.thinking_tokens(), 3);
    assert_eq!(b.times_forced(), 1);
    assert!(!b.in_thinking());
    assert_eq!(b.forced_token(), None);

    // Prompt opened the block, budget 0: the first token is forced.
    let b = ThinkingBudget::new(Some(0), Some(START), END, true);
    assert_eq!(b.forced_token(), Some(END));

    // No budget: never forces, counts; a natural end stops counting.
    let mut b = ThinkingBudget::new(None, Some(START), END, true);
    for t in [1, 2, END, 3, 4] {
        assert_eq!(b.forced_token(), None);
        b.observe(t);
    }
    assert_eq!((b.thinking_tokens(), b.times_forced()), (2, 0));
}

#[test]
fn lfm2_pythonic_tool_calls() {
    use mlx_models::chat::{ToolCallFormat, LFM2_TOOL_CALLS};
    assert_eq!(ToolCallFormat::detect("{{ '<|tool_call_start|>' }}"), Some(LFM2_TOOL_CALLS));
    assert_eq!(ToolCallFormat::detect("<tool_call>").map(|f| f.name), Some("qwen3"));
    let opts = ParserOptions { tool_calls: Some(LFM2_TOOL_CALLS), ..Default::default() };
    let text = "Checking.<|tool_call_start|>[get_weather(city=\"Paris\", days=2, metric=True, extra=None), \
                search(q='it\\'s', tags=['a', \"b\"], opts={'k': 1.5})]<|tool_call_end|>Done.\
                <|tool_call_start|>[bad(city=]<|tool_call_end|>";
    let out = whole(&opts, text);
    assert_eq!(out.text, "Checking.Done.");
    assert_eq!(out.tool_calls.len(), 3);
    assert_eq!(out.tool_calls[0].name, "get_weather");
    assert_eq!(out.tool_calls[0].arguments, json!({"city": "Paris", "days": 2, "metric": true, "extra": null}));
    assert_eq!(out.tool_calls[1].name, "search");
    assert_eq!(out.tool_calls[1].arguments, json!({"q": "it's", "tags": ["a", "b"], "opts": {"k": 1.5}}));
    assert_eq!(out.tool_calls.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["call_0", "call_1", "call_2"]);
    assert!(matches!(&out.tool_calls[2].status, ToolCallStatus::Malformed { reason } if reason.starts_with("invalid call syntax")));
    assert_eq!(out.tool_calls[2].raw, "[bad(city=]");
    for k in 0..=text.len() {
        if text.is_char_boundary(k) {
            assert_eq!(split_feed(&opts, text, &[k]).0, out, "split at {k}");
        }
    }
}

/// Qwen3.5's XML tool calls (as its chat template asks the model to write them), thinking
/// first, parse into the same events as Qwen3's JSON ones, at every split of the stream.
#[test]
fn qwen3_5_xml_tool_calls_parse_at_every_split() {
    use mlx_models::chat::{ToolCallFormat, QWEN3_5_TOOL_CALLS, QWEN3_TOOL_CALLS};
    let tpl = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + k + '>\\n' }}";
    assert_eq!(ToolCallFormat::detect(tpl), Some(QWEN3_5_TOOL_CALLS));
    assert_eq!(ToolCallFormat::detect("{{ '<tool_call>\\n' + tool_call | tojson }}"), Some(QWEN3_TOOL_CALLS));
    let text = "<think>\nNeed the weather.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n東京 🌧\n</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=options>\n{\"unit\": \"celsius\"}\n</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=broken>\n<parameter=city>\nParis\n</function>\n</tool_call>\n<tool_call>\nnot a function\n</tool_call>";
    let opts = ParserOptions { tool_calls: Some(QWEN3_5_TOOL_CALLS), ..Default::default() };
    let out = whole(&opts, text);
    let args = json!({"city": "東京 🌧", "days": 2, "options": {"unit": "celsius"}, "note": "line one\nline two"});
    check_three_calls(&out, ("Need the weather.", "Checking."), args, ["\"city\" has no </parameter>", "<function=NAME>"]);
    let ids: std::collections::HashSet<&str> = out.tool_calls.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids.len(), 3, "ids are unique within a reply");
    check_every_split(&opts, text, &out);
    // Three-way splits, and an unterminated call at the end of the output.
    for a in (0..text.len()).step_by(7) {
        let (split, _) = split_feed(&opts, text, &[a, a + 13]);
        assert_eq!(split.tool_calls, out.tool_calls, "splits at {a}, {}", a + 13);
    }
    // Output that ends inside a call: parsed as it stands (as for Qwen3's JSON calls).
    let cut = whole(&opts, "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>");
    assert_eq!((cut.tool_calls[0].name.as_str(), &cut.tool_calls[0].arguments), ("f", &json!({"x": 1})));
    let cut = whole(&opts, "<tool_call>\n<function=f>\n<parameter=x>\n1");
    let reason = malformed_reason(&cut.tool_calls[0].status);
    assert!(reason.starts_with("unterminated tool call"), "{reason}");
}

/// Gemma 4: the thought channel and native tool calls (`call:NAME{...}` with `<|"|>` strings)
/// parse into the same events, at every split of the stream.
#[test]
fn gemma4_thought_channel_and_tool_calls_parse_at_every_split() {
    use mlx_models::chat::{ToolCallFormat, GEMMA4_THINK_TAGS, GEMMA4_TOOL_CALLS};
    assert_eq!(ToolCallFormat::detect("{{- '<|tool_call>call:' + function['name'] + '{' }}"), Some(GEMMA4_TOOL_CALLS));
    let text = "<|channel>thought\nThe user wants Tokyo's weather.<channel|>Let me look.<|tool_call>call:get_weather{city:<|\"|>東京, Japan<|\"|>,days:2,metric:true,opts:{unit:<|\"|>c<|\"|>,hours:[6,12]},note:null}<tool_call|><|tool_call>call:broken{city:<|\"|>Paris}<tool_call|><|tool_call>get_time{}<tool_call|>";
    let opts = ParserOptions { think: Some(GEMMA4_THINK_TAGS), tool_calls: Some(GEMMA4_TOOL_CALLS), ..Default::default() };
    let out = whole(&opts, text);
    let args = json!({"city": "東京, Japan", "days": 2, "metric": true, "opts": {"unit": "c", "hours": [6, 12]}, "note": null});
    check_three_calls(&out, ("The user wants Tokyo's weather.", "Let me look."), args, ["unterminated", "call:NAME"]);
    check_every_split(&opts, text, &out);
    for a in (0..text.len()).step_by(5) {
        let (split, _) = split_feed(&opts, text, &[a, a + 11, a + 17]);
        assert_eq!(split.tool_calls, out.tool_calls, "splits at {a}");
    }
}
