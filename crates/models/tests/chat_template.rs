//! Chat template parity with Hugging Face (reference.json of the tiny fixtures, and
//! fixtures/chat/expected.json rendered by jinja2 the way transformers does), tools, thinking.
use std::path::{Path, PathBuf};

use mlx_models::chat::{
    ChatError, ChatFormat, ChatMessage, ChatTemplate, ReasoningEffort, RenderOptions, SpecialTokens, ToolDefinition,
};
use serde_json::{json, Value};

fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny").join(name)
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn reference_chat_text_and_ids_for_every_fixture() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny");
    let mut checked = 0;
    let mut entries: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for d in entries {
        let rp = d.join("reference.json");
        if !rp.is_file() {
            continue;
        }
        let r = read_json(&rp);
        let Some(msgs) = r.get("chat_messages") else { continue };
        let messages = ChatMessage::list_from_json(msgs).unwrap();
        let fmt = ChatFormat::from_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
        let p = fmt.render(&messages, &RenderOptions::default()).unwrap();
        assert_eq!(p.text, r["chat_text"].as_str().unwrap(), "chat_text of {}", d.display());
        assert_eq!(p.ids, ids(&r["chat_input_ids"]), "chat_input_ids of {}", d.display());
        assert!(!p.starts_in_thinking);
        checked += 1;
    }
    // Every fixture but qwen3_embed (an embedding model) has chat references.
    assert_eq!(checked, 12);
}

#[derive(Debug)]
struct Case {
    name: String,
    fixture: Option<String>,
    value: Value,
}

fn expected_cases() -> Vec<Case> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/expected.json");
    read_json(&p)
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().to_owned(),
            fixture: c.get("fixture").and_then(Value::as_str).map(str::to_owned),
            value: c.clone(),
        })
        .collect()
}

fn options_from(v: &Value) -> RenderOptions {
    let mut o = RenderOptions::default();
    if let Some(t) = v.get("tools") {
        o.tools = Some(serde_json::from_value::<Vec<ToolDefinition>>(t.clone()).unwrap());
    }
    if let Some(b) = v.get("enable_thinking") {
        o.enable_thinking = Some(b.as_bool().unwrap());
    }
    if let Some(b) = v.get("add_generation_prompt") {
        o.add_generation_prompt = b.as_bool().unwrap();
    }
    o
}

#[test]
fn hf_jinja_parity_tools_thinking_multiturn() {
    let mut n = 0;
    for case in expected_cases().into_iter().filter(|c| c.fixture.is_some()) {
        let fmt = ChatFormat::from_dir(tiny(case.fixture.as_deref().unwrap())).unwrap();
        let messages = ChatMessage::list_from_json(&case.value["messages"]).unwrap();
        let opts = options_from(&case.value["options"]);
        let got = fmt.render(&messages, &opts);
        if let Some(err) = case.value.get("error") {
            match got {
                Err(ChatError::TemplateRaised(m)) => assert_eq!(m, err.as_str().unwrap(), "{}", case.name),
                other => panic!("{}: expected the template's exception, got {other:?}", case.name),
            }
        } else {
            let p = got.unwrap_or_else(|e| panic!("{}: {e}", case.name));
            assert_eq!(p.text, case.value["text"].as_str().unwrap(), "text of {}", case.name);
            assert_eq!(p.ids, ids(&case.value["ids"]), "ids of {}", case.name);
        }
        n += 1;
    }
    assert_eq!(n, 9);
}

#[test]
fn hf_jinja_parity_filters_and_syntax() {
    let mut n = 0;
    for case in expected_cases().into_iter().filter(|c| c.value.get("custom").is_some()) {
        let t = ChatTemplate::from_source(case.value["custom"].as_str().unwrap()).unwrap();
        let opts = RenderOptions { extra: case.value["context"].as_object().unwrap().clone(), ..Default::default() };
        let got = t
            .render(&[ChatMessage::user("x")], &SpecialTokens::default(), &opts)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(got, case.value["text"].as_str().unwrap(), "{}", case.name);
        n += 1;
    }
    assert_eq!(n, 9);
}

#[test]
fn tools_are_rendered_in_the_system_block() {
    let fmt = ChatFormat::from_dir(tiny("qwen3")).unwrap();
    let tool = ToolDefinition::function(
        "lookup",
        "Find a word",
        json!({"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}),
    );
    let opts = RenderOptions { tools: Some(vec![tool]), ..Default::default() };
    let p = fmt.render(&[ChatMessage::user("define ✓")], &opts).unwrap();
    assert!(p.text.starts_with("<|im_start|>system\n# Tools\n"), "{}", p.text);
    assert!(p.text.contains(
        "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"lookup\", \"description\": \"Find a word\", \"parameters\": {\"type\": \"object\", \"properties\": {\"word\": {\"type\": \"string\"}}, \"required\": [\"word\"]}}}\n</tools>"
    ));
    // Empty tool list = no tools.
    let none = fmt.render(&[ChatMessage::user("hi")], &RenderOptions { tools: Some(vec![]), ..Default::default() }).unwrap();
    assert_eq!(none.text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
}

#[test]
fn enable_thinking_and_reasoning_effort() {
    let fmt = ChatFormat::from_dir(tiny("qwen3")).unwrap();
    let msgs = [ChatMessage::user("Hi")];
    let base = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    let closed = format!("{base}<think>\n\n</think>\n\n");
    let render = |o: RenderOptions| fmt.render(&msgs, &o).unwrap().text;
    assert_eq!(render(RenderOptions::default()), base);
    assert_eq!(render(RenderOptions { enable_thinking: Some(true), ..Default::default() }), base);
    assert_eq!(render(RenderOptions { enable_thinking: Some(false), ..Default::default() }), closed);
    for (effort, text) in [
        (ReasoningEffort::None, &closed),
        (ReasoningEffort::Low, &closed),
        (ReasoningEffort::Medium, &base.to_owned()),
        (ReasoningEffort::High, &base.to_owned()),
    ] {
        let o = RenderOptions { reasoning_effort: Some(effort), ..Default::default() };
        assert_eq!(&render(o.clone()), text, "{effort:?}");
        assert_eq!(o.include_reasoning_default(), effort != ReasoningEffort::None);
    }
    assert!(matches!("extreme".parse::<ReasoningEffort>(), Err(ChatError::InvalidReasoningEffort(s)) if s == "extreme"));
    assert_eq!(
        "bogus".parse::<ReasoningEffort>().unwrap_err().to_string(),
        "Invalid reasoning effort \"bogus\": expected one of \"none\", \"low\", \"medium\", \"high\""
    );
    // The closed block tokenizes to the think marker tokens.
    let p = fmt.render(&msgs, &RenderOptions { enable_thinking: Some(false), ..Default::default() }).unwrap();
    let think = fmt.tokenizer().token_to_id("<think>").unwrap();
    let end = fmt.tokenizer().token_to_id("</think>").unwrap();
    assert!(p.ids.contains(&think) && p.ids.contains(&end));
}

/// A template that opens the think block itself and knows nothing of enable_thinking
/// (DeepSeek-R1 / Qwen3-thinking style): the output starts inside the block, and thinking off
/// closes it after the template.
#[test]
fn template_opened_think_block() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(tiny("qwen3").join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
    )
    .unwrap();
    let fmt = ChatFormat::from_dir(dir.path()).unwrap();
    let msgs = [ChatMessage::user("Hi")];
    let on = fmt.render(&msgs, &RenderOptions::default()).unwrap();
    assert_eq!(on.text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n");
    assert!(on.starts_in_thinking);
    let off = fmt.render(&msgs, &RenderOptions { reasoning_effort: Some(ReasoningEffort::Low), ..Default::default() }).unwrap();
    assert_eq!(off.text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
    assert!(!off.starts_in_thinking);
}

#[test]
fn template_sources_named_list_and_jinja_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(tiny("qwen3").join("tokenizer.json"), dir.path().join("tokenizer.json")).unwrap();
    let mut cfg = read_json(&tiny("qwen3").join("tokenizer_config.json"));
    cfg["chat_template"] = json!([
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools[0].function.name }}"},
    ]);
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let fmt = ChatFormat::from_dir(dir.path()).unwrap();
    let msgs = [ChatMessage::user("u")];
    assert_eq!(fmt.render(&msgs, &RenderOptions::default()).unwrap().text, "Du");
    let tools = Some(vec![ToolDefinition::function("f", "d", json!({}))]);
    assert_eq!(fmt.render(&msgs, &RenderOptions { tools: tools.clone(), ..Default::default() }).unwrap().text, "Tf");
    let pick = RenderOptions { tools, template_name: Some("default".into()), ..Default::default() };
    assert_eq!(fmt.render(&msgs, &pick).unwrap().text, "Du");
    let missing = RenderOptions { template_name: Some("rag".into()), ..Default::default() };
    assert_eq!(
        fmt.render(&msgs, &missing).unwrap_err().to_string(),
        "chat template \"rag\" not found (available: default, tool_use)"
    );
    // chat_template.jinja (transformers 5 layout) wins over tokenizer_config.json.
    std::fs::write(dir.path().join("chat_template.jinja"), "J{{ messages | length }}").unwrap();
    assert_eq!(ChatFormat::from_dir(dir.path()).unwrap().render(&msgs, &RenderOptions::default()).unwrap().text, "J1");
    // No template anywhere.
    let bare = tempfile::tempdir().unwrap();
    std::fs::copy(tiny("qwen3").join("tokenizer.json"), bare.path().join("tokenizer.json")).unwrap();
    assert!(matches!(ChatFormat::from_dir(bare.path()), Err(ChatError::NoChatTemplate(_))));
}

#[test]
fn template_errors_are_typed() {
    assert!(matches!(ChatTemplate::from_source("{% for x in %}"), Err(ChatError::TemplateSyntax(_))));
    let t = ChatTemplate::from_source("{{ raise_exception('Only user and assistant roles are supported!') }}").unwrap();
    let e = t.render(&[ChatMessage::user("x")], &SpecialTokens::default(), &RenderOptions::default()).unwrap_err();
    assert_eq!(e.to_string(), "chat template raised an exception: Only user and assistant roles are supported!");
    let t = ChatTemplate::from_source("{{ messages[0].content.nosuchmethod() }}").unwrap();
    let e = t.render(&[ChatMessage::user("x")], &SpecialTokens::default(), &RenderOptions::default()).unwrap_err();
    assert!(matches!(e, ChatError::TemplateRender(_)), "{e:?}");
    // {% generation %} blocks (assistant masks) render their body.
    let t = ChatTemplate::from_source("{% generation %}{{ messages[0].content }}{% endgeneration %}").unwrap();
    assert_eq!(t.render(&[ChatMessage::user("x")], &SpecialTokens::default(), &RenderOptions::default()).unwrap(), "x");
}

#[test]
fn strftime_now_formats_the_current_date() {
    let t = ChatTemplate::from_source("{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %B %Y') }}").unwrap();
    let out = t.render(&[ChatMessage::user("x")], &SpecialTokens::default(), &RenderOptions::default()).unwrap();
    let (iso, long) = out.split_once('|').unwrap();
    assert_eq!(iso.len(), 10, "{out}");
    let year: i32 = iso[..4].parse().unwrap();
    assert!(year >= 2024, "{out}");
    assert!(long.ends_with(&iso[..4]), "{out}");
    assert!(long.split(' ').nth(1).unwrap().chars().next().unwrap().is_uppercase(), "{out}");
}
