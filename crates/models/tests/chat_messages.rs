//! Message serde and validation errors.
use mlx_models::chat::{validate_messages, ChatError, ChatFormat, ChatMessage, RenderOptions, Role, ToolCall};
use serde_json::json;

fn call(id: &str) -> ToolCall {
    ToolCall { id: Some(id.into()), name: "f".into(), arguments: json!({}) }
}

#[test]
fn serde_shape() {
    let m = ChatMessage::assistant("hi").with_reasoning("r").with_tool_calls(vec![call("c1")]);
    let v = serde_json::to_value(&m).unwrap();
    assert_eq!(
        v,
        json!({"role": "assistant", "content": "hi", "reasoning_content": "r", "tool_calls": [{"id": "c1", "name": "f", "arguments": {}}]})
    );
    let back: ChatMessage = serde_json::from_value(v).unwrap();
    assert_eq!(back, m);
    let t: ChatMessage = serde_json::from_value(json!({"role": "tool", "content": "x", "tool_call_id": "c1", "is_error": true})).unwrap();
    assert_eq!(t, ChatMessage::tool("c1", "x").with_error(true));
    assert_eq!(serde_json::from_value::<ChatMessage>(json!({"role": "user"})).unwrap().content, "");
    let e = serde_json::from_value::<ChatMessage>(json!({"role": "robot", "content": ""})).unwrap_err();
    assert!(e.to_string().contains("unknown role \"robot\""), "{e}");
}

#[test]
fn list_from_json_errors() {
    let e = ChatMessage::list_from_json(&json!([{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}])).unwrap_err();
    assert!(matches!(&e, ChatError::UnknownRole { index: 1, role } if role == "developer"));
    assert_eq!(
        e.to_string(),
        "Invalid messages: message 1 has unknown role \"developer\" (expected \"system\", \"user\", \"assistant\" or \"tool\")"
    );
    assert!(matches!(ChatMessage::list_from_json(&json!([{"content": "a"}])), Err(ChatError::MalformedMessage { index: 0, .. })));
    assert!(matches!(ChatMessage::list_from_json(&json!([{"role": 1}])), Err(ChatError::MalformedMessage { index: 0, .. })));
    assert!(matches!(
        ChatMessage::list_from_json(&json!([{"role": "user", "content": 5}])),
        Err(ChatError::MalformedMessage { index: 0, .. })
    ));
    assert!(matches!(ChatMessage::list_from_json(&json!({"role": "user"})), Err(ChatError::MalformedMessage { .. })));
}

#[test]
fn validation_errors() {
    let e = validate_messages(&[]).unwrap_err();
    assert!(matches!(e, ChatError::EmptyConversation));
    assert_eq!(e.to_string(), "Invalid messages: the message list is empty");

    assert!(matches!(validate_messages(&[ChatMessage::system("s")]), Err(ChatError::NoUserMessage)));

    let e = validate_messages(&[ChatMessage::user("u"), ChatMessage::tool("c1", "r")]).unwrap_err();
    assert!(matches!(e, ChatError::ToolResultWithoutCall { index: 1 }));
    assert_eq!(e.to_string(), "Invalid messages: tool message 1 does not follow an assistant message with tool calls");

    // An assistant message without calls does not open tool results.
    let e = validate_messages(&[ChatMessage::user("u"), ChatMessage::assistant("a"), ChatMessage::tool("c1", "r")]).unwrap_err();
    assert!(matches!(e, ChatError::ToolResultWithoutCall { index: 2 }));

    let asked = ChatMessage::assistant("").with_tool_calls(vec![call("c1"), call("c2")]);
    validate_messages(&[ChatMessage::user("u"), asked.clone(), ChatMessage::tool("c1", "r"), ChatMessage::tool("c2", "r")]).unwrap();
    // A user message in between closes the calls.
    let e = validate_messages(&[ChatMessage::user("u"), asked.clone(), ChatMessage::user("x"), ChatMessage::tool("c1", "r")]).unwrap_err();
    assert!(matches!(e, ChatError::ToolResultWithoutCall { index: 3 }));

    let e = validate_messages(&[ChatMessage::user("u"), asked.clone(), ChatMessage::tool("c9", "r")]).unwrap_err();
    assert!(matches!(&e, ChatError::UnknownToolCallId { index: 2, tool_call_id } if tool_call_id == "c9"));

    let mut nameless = call("c1");
    nameless.name = " ".into();
    let e = validate_messages(&[ChatMessage::user("u"), ChatMessage::assistant("").with_tool_calls(vec![nameless])]).unwrap_err();
    assert!(matches!(e, ChatError::EmptyToolName { index: 1, call: 0 }));

    let e = validate_messages(&[ChatMessage::user("u").with_tool_calls(vec![call("c1")])]).unwrap_err();
    assert!(matches!(&e, ChatError::ToolCallsOnNonAssistant { index: 0, role } if role == "user"));
    assert_eq!(Role::Tool.to_string(), "tool");
}

#[test]
fn render_validates_first() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/qwen3");
    let fmt = ChatFormat::from_dir(dir).unwrap();
    assert!(matches!(fmt.render(&[], &RenderOptions::default()), Err(ChatError::EmptyConversation)));
    assert!(matches!(
        fmt.render(&[ChatMessage::user("u"), ChatMessage::tool("x", "y")], &RenderOptions::default()),
        Err(ChatError::ToolResultWithoutCall { index: 1 })
    ));
}
