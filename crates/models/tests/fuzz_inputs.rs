//! Untrusted inputs never panic (10,000 cases each): config.json values of any shape through
//! family detection and every family's config parsing; chat messages and tool definitions from
//! any JSON through validation and template rendering; arbitrary text (odd Unicode, long runs)
//! through the tokenizer; model output made of marker fragments through the output parser at
//! random splits (split = whole).
mod common;
use mlx_models::chat::{validate_messages, ChatFormat, ChatMessage, OutputParser, ParserOptions, RenderOptions, ToolDefinition, GEMMA4_THINK_TAGS, GEMMA4_TOOL_CALLS, LFM2_TOOL_CALLS, QWEN3_5_TOOL_CALLS};
use mlx_models::families::{gemma3::Gemma3Config, gemma4::Gemma4Config, lfm2::Lfm2Config, llama::LlamaConfig, qwen3::Qwen3Config, qwen3_5::Qwen35Config};
use proptest::prelude::*;
use serde_json::Value;
use std::path::Path;
use std::sync::OnceLock;

const CASES: u32 = 10_000;

/// Keys real configs use, so generated objects reach the interesting branches.
const KEYS: &[&str] = &[
    "model_type", "architectures", "text_config", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "intermediate_size", "rope_theta", "rope_scaling", "rope_parameters",
    "rope_type", "factor", "original_max_position_embeddings", "layer_types", "sliding_window", "tie_word_embeddings",
    "eos_token_id", "quantization", "bits", "group_size", "mode", "full_attention", "sliding_attention", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "partial_rotary_factor", "hidden_act", "type", "x",
];
const STRINGS: &[&str] = &["qwen3", "llama", "gemma3", "gemma3_text", "gemma4", "qwen3_5_moe", "lfm2", "yarn", "linear", "dynamic", "llama3", "full_attention", "sliding_attention", "silu", "", "Qwen3Model", "mxfp4", "ü🌧"];

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        prop_oneof![Just(0i64), Just(1), Just(2), Just(4), Just(16), Just(64), Just(-1), Just(i64::MAX), any::<i64>()].prop_map(|n| Value::from(n)),
        prop_oneof![Just(0.5f64), Just(1e6), Just(-3.0), Just(1e300), any::<f64>().prop_filter("finite", |x| x.is_finite())].prop_map(|x| Value::from(x)),
        prop::sample::select(STRINGS).prop_map(|s| Value::from(s)),
    ];
    leaf.prop_recursive(4, 48, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..10).prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

fn parse_every_family(v: &Value) {
    let dir = Path::new("/nonexistent");
    let _ = mlx_models::registry::detect_from_value(dir, v);
    let text = mlx_models::config::text_config(v);
    if let Ok(c) = mlx_models::config::parse::<Qwen3Config>(dir, &text) {
        let _ = c.validate();
    }
    if let Ok(c) = mlx_models::config::parse::<LlamaConfig>(dir, &text) {
        let _ = c.rope();
    }
    if let Ok(c) = mlx_models::config::parse::<Qwen35Config>(dir, &text) {
        let _ = c.validate();
    }
    if let Ok(c) = mlx_models::config::parse::<Lfm2Config>(dir, &text) {
        let _ = (c.validate(false), c.validate(true));
    }
    let _ = Gemma3Config::from_root(dir, v);
    let _ = Gemma4Config::from_root(dir, v);
    let _ = mlx_models::weights::QuantSpec::from_config(v);
}

fn format() -> &'static ChatFormat {
    static F: OnceLock<ChatFormat> = OnceLock::new();
    F.get_or_init(|| ChatFormat::from_dir(common::fixture("qwen3")).unwrap())
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,40}",
        "\\PC{0,40}",
        "[\\u{0}-\\u{1f}\\u{7f}-\\u{9f}\\u{200b}-\\u{200f}\\u{fe0f}\\u{1f300}-\\u{1f3ff}]{0,40}",
        (prop::sample::select(&["a", "é", "🌧", "\u{0}", " ", "\n", "<|im_end|>", "<think>"][..]), 1usize..3000).prop_map(|(s, n)| s.repeat(n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn configs_of_any_shape_never_panic(v in json()) {
        parse_every_family(&v);
        // the same value as a family's text_config and under rope_parameters
        parse_every_family(&serde_json::json!({"model_type": "gemma3", "text_config": v.clone(), "rope_parameters": v}));
    }

    #[test]
    fn chat_messages_and_tools_from_any_json_never_panic(v in json(), role in prop::sample::select(&["user", "assistant", "system", "tool", "developer", "x"][..]), content in text()) {
        let _ = serde_json::from_value::<Vec<ChatMessage>>(v.clone());
        let _ = serde_json::from_value::<Vec<ToolDefinition>>(v.clone());
        let msg = serde_json::json!([{"role": role, "content": content, "tool_calls": v.clone(), "tool_call_id": v}]);
        if let Ok(msgs) = serde_json::from_value::<Vec<ChatMessage>>(msg) {
            if validate_messages(&msgs).is_ok() {
                let _ = format().render(&msgs, &RenderOptions::default());
            }
        }
    }

    #[test]
    fn tokenizer_takes_any_text(s in text()) {
        let t = format().tokenizer();
        let ids = t.encode(&s, true).unwrap();
        let _ = t.decode(&ids, false).unwrap();
        let mut d = t.stream_decoder(false);
        for &id in &ids {
            let _ = d.step(id).unwrap();
        }
    }

    #[test]
    fn parser_on_marker_soup_split_equals_whole(parts in prop::collection::vec(prop_oneof![
            prop::sample::select(&["<|channel>thought", "<channel|>", "<|tool_call>", "<tool_call|>", "call:f{", "<|\"|>", "}", "<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">", "\n", "{\"name\": \"f\", \"arguments\": {}}", "[f(x=1)]", "<|tool_call_start|>", "<|tool_call_end|>", "<", "</", "🌧", "é"][..]).prop_map(str::to_string),
            ".{0,6}",
        ], 0..24),
        cuts in prop::collection::vec(0usize..200, 0..8),
        fmt in 0usize..4, starts in any::<bool>()) {
        let tool_calls = [None, Some(QWEN3_5_TOOL_CALLS), Some(LFM2_TOOL_CALLS), Some(GEMMA4_TOOL_CALLS)][fmt];
        let think = if fmt == 3 { Some(GEMMA4_THINK_TAGS) } else { ParserOptions::default().think };
        let opts = ParserOptions { think, tool_calls: tool_calls.or(ParserOptions::default().tool_calls), starts_in_thinking: starts, ..Default::default() };
        let s: String = parts.concat();
        let whole = OutputParser::parse_all(opts.clone(), &s);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (s.len() + 1)).filter(|&c| s.is_char_boundary(c)).collect();
        cuts.sort();
        let mut p = OutputParser::new(opts);
        let mut last = 0;
        for c in cuts {
            p.push(&s[last..c]);
            last = c;
        }
        p.push(&s[last..]);
        p.finish();
        prop_assert_eq!(p.output(), whole);
    }
}
