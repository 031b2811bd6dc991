//! The built-in reward functions' scores on hand-made completions, and weighted combination
//! with user closures.
use mlx_training::rewards::{
    JsonSchemaReward, LengthReward, RewardFunction, RewardSet, ToolUseReward, XmlFormatReward,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn tool_use() {
    let r = ToolUseReward {
        allowed_tools: vec!["search".into(), "calculate".into()],
        required: true,
    };
    let s = |c: &str| r.score("p", c).unwrap();
    assert!(close(
        s(r#"<tool_call><name>search</name><arguments>{"q": "x"}</arguments></tool_call>"#),
        1.0
    ));
    assert!(close(s("<tool_call><name>search</name></tool_call>"), 0.7));
    assert!(close(
        s("<tool_call>\n{\"name\": \"calculate\", \"arguments\": {\"x\": 1}}\n</tool_call>"),
        1.0
    ));
    assert!(close(
        s("<tool_call>{\"name\": \"calculate\"}</tool_call>"),
        0.7
    ));
    assert!(
        close(s("<tool_call><name>delete</name></tool_call>"), -0.5),
        "unknown tool"
    );
    assert!(
        close(s("<tool_call>{not json</tool_call>"), -0.5),
        "malformed"
    );
    assert!(
        close(s("<tool_call><name>search</name>"), -0.5),
        "unbalanced"
    );
    assert!(close(s("</tool_call><tool_call>"), -0.5), "wrong order");
    assert!(close(s("no call"), 0.0), "required but missing");
    let optional = ToolUseReward {
        required: false,
        ..Default::default()
    };
    assert!(close(optional.score("p", "no call").unwrap(), 0.5));
    assert_eq!(
        ToolUseReward::default().allowed_tools,
        vec!["search", "calculate", "code"]
    );
}

#[test]
fn xml_format() {
    let r = XmlFormatReward::default();
    let s = |c: &str| r.score("p", c).unwrap();
    assert!(close(s("<thinking>a</thinking><answer>42</answer>"), 1.0));
    assert!(close(s("<thinking>a</thinking>"), 0.5));
    assert!(
        close(s("<thinking>a</thinking><answer>42"), 0.2),
        "0.5 - 0.3 for the unbalanced tag"
    );
    assert!(close(s("<thinking><answer>"), 0.0), "clamped");
    assert!(close(
        XmlFormatReward {
            required_tags: vec![]
        }
        .score("p", "x")
        .unwrap(),
        1.0
    ));
}

#[test]
fn length() {
    let r = LengthReward::new(10, 50, true).unwrap();
    let s = |c: &str| r.score("p", c).unwrap();
    assert!(close(s("exactly twenty chars"), 1.0));
    assert!(close(s("Hi"), 0.2));
    assert!(close(s(&"a".repeat(60)), 0.9));
    assert!(close(s(&"a".repeat(500)), 0.5), "penalty capped at 0.5");
    let r12 = LengthReward::new(12, 50, true).unwrap();
    assert!(
        close(r12.score("p", "héllo wörld").unwrap(), 11.0 / 12.0),
        "11 characters (13 bytes)"
    );
    let words = LengthReward::new(2, 3, false).unwrap();
    assert!(close(words.score("p", "one").unwrap(), 0.5));
    assert!(close(words.score("p", "one two three").unwrap(), 1.0));
    assert!(LengthReward::new(5, 0, true).is_err());
    assert!(LengthReward::new(5, 4, true).is_err());
    assert_eq!(
        LengthReward::default(),
        LengthReward {
            min_length: 50,
            max_length: 500,
            use_chars: true
        }
    );
}

#[test]
fn json_schema() {
    let r = JsonSchemaReward {
        required_fields: vec!["name".into(), "value".into()],
    };
    let s = |c: &str| r.score("p", c).unwrap();
    assert!(close(s(r#"Here: {"name": "x", "value": 42} done"#), 1.0));
    assert!(close(s(r#"{"name": "x"}"#), 0.5));
    assert!(
        close(s(r#"{"other": {"name": 1}}"#), 0.0),
        "top-level keys only"
    );
    assert!(
        close(s(r#"{"name": "x", "value": }"#), 0.2),
        "does not parse"
    );
    assert!(close(s("no json"), 0.0));
    assert!(close(
        JsonSchemaReward::default().score("p", "[1, 2]").unwrap(),
        1.0
    ));
}

#[test]
fn weighted_set_with_closures() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = calls.clone();
    let mut set = RewardSet::new();
    set.add(
        XmlFormatReward {
            required_tags: vec!["answer".into()],
        },
        2.0,
    )
    .unwrap();
    set.add_fn("mentions_42", 0.5, move |_p, c| {
        c2.fetch_add(1, Ordering::SeqCst);
        Some(if c.contains("42") { 1.0 } else { 0.0 })
    })
    .unwrap();
    set.add_fn("only_long", 1.0, |_p, c| (c.len() > 20).then_some(1.0))
        .unwrap();
    assert_eq!(set.names(), vec!["xml_format", "mentions_42", "only_long"]);
    let scores = set.score("p", "<answer>42</answer>");
    assert!(
        close(scores[0], 1.0) && close(scores[1], 1.0) && scores[2].is_nan(),
        "{scores:?}"
    );
    assert!(close(set.combine(&scores), 2.5), "NaN scores are left out");
    assert!(set.combine(&[f64::NAN; 3]).is_nan());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(
        set.add_fn("mentions_42", 1.0, |_, _| None).is_err(),
        "names are unique"
    );
    assert!(set.add_fn("nan_weight", f64::NAN, |_, _| None).is_err());
    // a closure returning a non-finite score counts as not applying
    let mut s2 = RewardSet::new();
    s2.add_fn("inf", 1.0, |_, _| Some(f64::INFINITY)).unwrap();
    assert!(s2.score("p", "c")[0].is_nan());
    // the set can move to another thread
    let handle = std::thread::spawn(move || set.score("p", "x").len());
    assert_eq!(handle.join().unwrap(), 3);
}
