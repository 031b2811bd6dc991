//! The server on the tiny Qwen3 fixture (random weights, 512-token context) and the tiny Harrier
//! fixture, through HTTP on 127.0.0.1.
mod common;
use common::{fixture, Server};
use mlx_models::chat::ChatFormat;
use mlx_models::{generate, load_model, GenerateConfig, LoadOptions};
use sampling::SamplingConfig;
use serde_json::{json, Value};

fn start(extra: &[&str]) -> (Server, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let s = Server::start(&fixture("qwen3"), &dir.path().join("responses.db"), extra);
    (s, dir)
}

fn chat(content: &str, max_tokens: usize) -> Value {
    json!({ "model": "qwen3", "messages": [{ "role": "user", "content": content }], "max_tokens": max_tokens, "temperature": 0 })
}

#[test]
fn models_health_and_metrics() {
    let (s, _d) = start(&[]);
    let h = s.get("/health");
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["status"], "ok");
    let m = s.get("/v1/models").json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "qwen3");
    assert_eq!(s.post("/v1/chat/completions", &chat("hi", 3)).status, 200);
    let text = s.get("/metrics").body;
    for name in [
        "mlx_serve_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1",
        "mlx_serve_queue_depth 0",
        "mlx_serve_generation_tokens_total 3",
        "mlx_serve_time_to_first_token_seconds_count 1",
        "mlx_serve_kv_blocks_used",
        "mlx_serve_kv_blocks_cached",
        "mlx_serve_memory_bytes{kind=\"active\"}",
        "mlx_serve_generation_tokens_per_second",
    ] {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
    assert_eq!(s.get("/nope").status, 404);
}

/// Greedy completions over token ids equal the library's `generate` on the same prompt:
/// same tokens, log-probs within 1e-4.
#[test]
fn completions_match_the_library() {
    let (s, _d) = start(&[]);
    let prompt: Vec<u32> = vec![5, 17, 42, 99, 3];
    let r = s.post("/v1/completions", &json!({ "model": "qwen3", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0 }));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<String> = serde_json::from_value(lp["tokens"].clone()).unwrap();
    let lps: Vec<f32> = serde_json::from_value(lp["token_logprobs"].clone()).unwrap();

    let dir = fixture("qwen3");
    let model = load_model(&dir, &LoadOptions::default())
        .unwrap()
        .into_lm()
        .unwrap();
    let format = ChatFormat::from_dir(&dir).unwrap();
    let mut cache = model.new_cache();
    let cfg = GenerateConfig {
        max_new_tokens: 12,
        sampling: SamplingConfig::greedy(),
        stop_tokens: Some(model.info().eos_token_ids.clone()),
        ..Default::default()
    };
    let want: Vec<_> = generate(&model, &mut cache, &prompt, cfg)
        .unwrap()
        .map(|t| t.unwrap())
        .collect();
    assert_eq!(tokens.len(), want.len());
    for (i, t) in want.iter().enumerate() {
        assert_eq!(
            tokens[i],
            format.tokenizer().decode(&[t.id], false).unwrap(),
            "token {i}"
        );
        assert!(
            (lps[i] - t.logprob).abs() < 1e-4,
            "logprob {i}: server {} library {}",
            lps[i],
            t.logprob
        );
    }
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], 5);
    assert_eq!(u["completion_tokens"], want.len());
    assert_eq!(
        v["choices"][0]["finish_reason"],
        if want.len() == 12 { "length" } else { "stop" }
    );
}

#[test]
fn chat_streaming_equals_non_streaming() {
    let (s, _d) = start(&[]);
    let one = s
        .post("/v1/chat/completions", &chat("Tell me a story", 20))
        .json();
    let content = one["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(one["object"], "chat.completion");
    assert_eq!(one["usage"]["completion_tokens"], 20);
    assert_eq!(one["choices"][0]["finish_reason"], "length");
    let mut req = chat("Tell me a story", 20);
    req["stream"] = json!(true);
    req["stream_options"] = json!({ "include_usage": true });
    let r = s.post("/v1/chat/completions", &req);
    assert_eq!(r.status, 200);
    assert!(
        r.headers
            .to_ascii_lowercase()
            .contains("content-type: text/event-stream"),
        "{}",
        r.headers
    );
    let data = r.sse_data();
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content);
    let finish: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .map(|c| &c["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("length")]);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 20);
    assert_eq!(usage["prompt_tokens"], one["usage"]["prompt_tokens"]);
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());
}

#[test]
fn sampling_seed_stop_and_max_completion_tokens() {
    let (s, _d) = start(&[]);
    let mut req = json!({ "model": "qwen3", "messages": [{ "role": "user", "content": "x" }], "max_completion_tokens": 16,
                          "temperature": 1.0, "top_p": 0.9, "seed": 7 });
    let a = s.post("/v1/chat/completions", &req).json();
    let b = s.post("/v1/chat/completions", &req).json();
    assert_eq!(
        a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"],
        "same seed, same text"
    );
    assert_eq!(a["usage"]["completion_tokens"], 16);
    // A stop string cut from the greedy output ends it just before.
    let greedy = s.post("/v1/chat/completions", &chat("x", 16)).json();
    let text = greedy["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 1].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];
    req = chat("x", 16);
    req["stop"] = json!([stop]);
    let r = s.post("/v1/chat/completions", &req).json();
    assert_eq!(r["choices"][0]["message"]["content"], cut);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
}

#[test]
fn tools_are_rendered_and_tool_turns_accepted() {
    let (s, _d) = start(&[]);
    let tools = json!([{ "type": "function", "function": { "name": "get_weather", "description": "Weather of a city",
        "parameters": { "type": "object", "properties": { "city": { "type": "string" } }, "required": ["city"] } } }]);
    let plain = s
        .post("/v1/chat/completions", &chat("Weather in Paris?", 2))
        .json();
    let mut req = chat("Weather in Paris?", 2);
    req["tools"] = tools.clone();
    let with = s.post("/v1/chat/completions", &req);
    assert_eq!(with.status, 200, "{}", with.body);
    let with = with.json();
    assert!(
        with["usage"]["prompt_tokens"].as_u64().unwrap()
            > plain["usage"]["prompt_tokens"].as_u64().unwrap() + 20,
        "tools are in the prompt"
    );
    req["tool_choice"] = json!("none");
    let none = s.post("/v1/chat/completions", &req).json();
    assert_eq!(
        none["usage"]["prompt_tokens"], plain["usage"]["prompt_tokens"],
        "tool_choice none drops the tools"
    );
    req["tool_choice"] = json!("required");
    let r = s.post("/v1/chat/completions", &req);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "tool_choice");
    // A conversation with a tool call and its result.
    let conv = json!({ "model": "qwen3", "max_tokens": 2, "temperature": 0, "tools": tools, "messages": [
        { "role": "user", "content": "Weather in Paris?" },
        { "role": "assistant", "content": null, "tool_calls": [{ "id": "call_1", "type": "function", "function": { "name": "get_weather", "arguments": "{\"city\": \"Paris\"}" } }] },
        { "role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny" } ] });
    let r = s.post("/v1/chat/completions", &conv);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.json()["usage"]["prompt_tokens"].as_u64().unwrap()
            > with["usage"]["prompt_tokens"].as_u64().unwrap()
    );
}

#[test]
fn errors_are_openai_shaped() {
    let (s, _d) = start(&[]);
    // (body, `param`, `code`): each a 400 with an invalid_request_error body
    let long = json!({ "model": "qwen3", "messages": [{ "role": "user", "content": "word ".repeat(600) }] }).to_string();
    let hi = r#""model":"qwen3","messages":[{"role":"user","content":"hi"}]"#;
    let cases: Vec<(String, Option<&str>, Option<&str>)> = vec![
        ("{\"model\": \"qwen3\", ".into(), None, Some("invalid_json")),
        ("[1, 2]".into(), None, Some("invalid_json")),
        (
            format!(r#"{{{hi},"max_tokens":"ten"}}"#),
            Some("max_tokens"),
            None,
        ),
        (
            format!(r#"{{{hi},"temperature":[1]}}"#),
            Some("temperature"),
            None,
        ),
        (
            format!(r#"{{{hi},"frobnicate":1}}"#),
            Some("frobnicate"),
            None,
        ),
        (
            r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#.into(),
            Some("model"),
            Some("model_not_found"),
        ),
        (
            r#"{"model":"qwen3","messages":[{"role":"wizard","content":"hi"}]}"#.into(),
            Some("messages[0].role"),
            None,
        ),
        (format!(r#"{{{hi},"n":2}}"#), Some("n"), None),
        (
            format!(r#"{{{hi},"max_tokens":100000}}"#),
            None,
            Some("context_length_exceeded"),
        ),
        (long, None, Some("context_length_exceeded")),
    ];
    for (body, param, code) in cases {
        let r = s.req("POST", "/v1/chat/completions", Some(&body));
        assert_eq!(r.status, 400, "{body} -> {}", r.body);
        let e = &r.json()["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["param"], json!(param), "{}", r.body);
        assert_eq!(e["code"], json!(code), "{}", r.body);
    }
    let r = s.post(
        "/v1/completions",
        &json!({ "model": "qwen3", "prompt": vec![1u32; 600] }),
    );
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (400, json!("context_length_exceeded"))
    );
    let r = s.post(
        "/v1/embeddings",
        &json!({ "model": "qwen3", "input": "hi" }),
    );
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (400, json!("model_not_supported"))
    );
    let r = s.post("/v1/chat/completions", &json!({ "model": "qwen3", "messages": [{ "role": "user", "content": "hi" }], "temperature": -1 }));
    assert_eq!(r.status, 400, "{}", r.body);
}

#[test]
fn full_queue_answers_429() {
    let (s, _d) = start(&["--max-queue", "1", "--max-batch", "1"]);
    let port = s.port;
    let long =
        json!({ "model": "qwen3", "prompt": [1], "max_tokens": 500, "temperature": 0 }).to_string();
    let handles: Vec<_> = (0..6)
        .map(|i| {
            let body = long.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20 * i));
                common::request(port, "POST", "/v1/completions", Some(&body))
            })
        })
        .collect();
    let rs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let ok = rs.iter().filter(|r| r.status == 200).count();
    let full: Vec<_> = rs.iter().filter(|r| r.status == 429).collect();
    assert!(
        ok >= 1 && !full.is_empty(),
        "statuses {:?}",
        rs.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert_eq!(full[0].json()["error"]["code"], "queue_full");
    assert_eq!(ok + full.len(), 6);
}

#[test]
fn client_disconnect_cancels_generation() {
    let (s, _d) = start(&[]);
    let body = json!({ "model": "qwen3", "prompt": [1], "max_tokens": 500, "temperature": 0, "stream": true }).to_string();
    let mut conn = common::connect(s.port, "POST", "/v1/completions", Some(&body));
    let mut buf = [0u8; 512];
    let n = std::io::Read::read(&mut conn, &mut buf).unwrap();
    assert!(n > 0);
    drop(conn);
    let t0 = std::time::Instant::now();
    while s.metric("mlx_serve_requests_cancelled_total") < 1.0 {
        assert!(
            t0.elapsed().as_secs() < 60,
            "the generation was not cancelled"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    while s.metric("mlx_serve_running_requests") > 0.0 {
        assert!(t0.elapsed().as_secs() < 60);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(s.metric("mlx_serve_generation_tokens_total") < 500.0);
    // The engine is free for the next request.
    assert_eq!(s.post("/v1/chat/completions", &chat("hi", 2)).status, 200);
}

/// 32 concurrent streaming requests at temperature 0 each equal the same request sent alone, on
/// the batch engine with K/V where `kv` says; returns the server.
fn concurrent_streams_equal_lone(kv: &str) -> (Server, tempfile::TempDir) {
    let (s, d) = start(&["--engine-kv", kv]);
    let req = |i: usize| json!({ "model": "qwen3", "messages": [{ "role": "user", "content": format!("question number {i}") }], "max_tokens": 12, "temperature": 0, "stream": true });
    let text_of = |r: common::Resp| -> String {
        r.sse_data()
            .iter()
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str::<Value>(d).unwrap())
            .filter_map(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(String::from)
            })
            .collect()
    };
    let alone: Vec<String> = (0..32)
        .map(|i| text_of(s.post("/v1/chat/completions", &req(i))))
        .collect();
    let port = s.port;
    let handles: Vec<_> = (0..32)
        .map(|i| {
            let body = req(i).to_string();
            std::thread::spawn(move || {
                common::request(port, "POST", "/v1/chat/completions", Some(&body))
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(text_of(r), alone[i], "{kv}: request {i}");
    }
    // The concurrent requests shared forward passes.
    let rows = s.metric("mlx_serve_max_sequences_per_step");
    assert!(
        rows > 1.0,
        "{kv}: most sequences in one forward pass: {rows}"
    );
    (s, d)
}

#[test]
fn concurrent_streams_equal_lone_requests() {
    concurrent_streams_equal_lone("flat");
}

/// The same with the sequences in the paged pool; a prompt sent again starts on its cached
/// blocks, with the same greedy output.
#[test]
fn paged_engine_streams_equal_lone_requests_and_reuse_prefixes() {
    let (s, _d) = concurrent_streams_equal_lone("paged");
    let q = chat("Tell me a story about a lighthouse keeper and the sea", 8);
    let (a, b) = (
        s.post("/v1/chat/completions", &q).json(),
        s.post("/v1/chat/completions", &q).json(),
    );
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );
    let cached = |r: &Value| {
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert!(
        cached(&b) > cached(&a),
        "{} then {}",
        a["usage"],
        b["usage"]
    );
}

/// The sequential engine continues a kept sequence: the same prompt again is served from its
/// KV cache (all but the last prompt token), with the same greedy output.
#[test]
fn sequential_engine_reuses_kept_caches() {
    let (s, _d) = start(&["--engine", "sequential"]);
    let a = s
        .post("/v1/chat/completions", &chat("Tell me a story", 8))
        .json();
    let b = s
        .post("/v1/chat/completions", &chat("Tell me a story", 8))
        .json();
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );
    let p = b["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        p - 1,
        "{}",
        b["usage"]
    );
    assert_eq!(s.metric("mlx_serve_max_sequences_per_step"), 1.0);
}

/// The batching engine serves the responses chain too (the history is rendered again and
/// prefilled in full: its batch caches are not kept between requests).
#[test]
fn responses_chain_on_the_batch_engine() {
    let (s, _d) = start(&[]);
    let r1 = s.post("/v1/responses", &json!({ "model": "qwen3", "input": "Hello there", "max_output_tokens": 4, "temperature": 0 })).json();
    let r2 = s.post("/v1/responses", &json!({ "model": "qwen3", "input": "And then?", "previous_response_id": r1["id"], "max_output_tokens": 4, "temperature": 0 }));
    assert_eq!(r2.status, 200, "{}", r2.body);
    let u = &r2.json()["usage"];
    let live = r1["usage"]["input_tokens"].as_u64().unwrap()
        + r1["usage"]["output_tokens"].as_u64().unwrap();
    assert!(u["input_tokens"].as_u64().unwrap() > live, "{u}");
    assert_eq!(u["input_tokens_details"]["cached_tokens"], 0);
}

fn events_in_order(events: &[(String, Value)]) {
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let first = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    assert_eq!(&names[..4], &first);
    let tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ];
    let n = names.len();
    assert!(
        names[4..n - 4]
            .iter()
            .all(|&e| e == "response.output_text.delta"),
        "{names:?}"
    );
    assert_eq!(&names[n - 4..n - 1], &tail);
    assert!(matches!(
        names[n - 1],
        "response.completed" | "response.incomplete"
    ));
    for (i, (name, v)) in events.iter().enumerate() {
        assert_eq!(v["sequence_number"], i, "{name}");
        assert_eq!(v["type"], name.as_str());
    }
}

#[test]
fn responses_chain_stream_store_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("store/responses.db");
    let s = Server::start(&fixture("qwen3"), &db, &["--engine", "sequential"]);
    let r1 = s.post("/v1/responses", &json!({ "model": "qwen3", "input": "Hello there", "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0 }));
    assert_eq!(r1.status, 200, "{}", r1.body);
    let r1 = r1.json();
    assert_eq!(r1["object"], "response");
    assert_eq!(r1["output"][0]["type"], "message");
    assert_eq!(r1["status"], "incomplete");
    let (in1, out1) = (
        r1["usage"]["input_tokens"].as_u64().unwrap(),
        r1["usage"]["output_tokens"].as_u64().unwrap(),
    );
    // Continuing the live sequence: the whole first turn is reused.
    let r2 = s.post("/v1/responses", &json!({ "model": "qwen3", "input": [{ "role": "user", "content": [{ "type": "input_text", "text": "And then?" }] }],
        "instructions": "Be brief.", "previous_response_id": r1["id"], "max_output_tokens": 4, "temperature": 0 })).json();
    assert_eq!(r2["previous_response_id"], r1["id"]);
    assert_eq!(
        r2["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        in1 + out1,
        "{}",
        r2["usage"]
    );
    assert!(r2["usage"]["input_tokens"].as_u64().unwrap() > in1 + out1);
    // Streaming: the documented event order with consecutive sequence numbers.
    let st = s.post("/v1/responses", &json!({ "model": "qwen3", "input": "Stream this", "max_output_tokens": 5, "temperature": 0, "stream": true }));
    let events = st.sse_events();
    events_in_order(&events);
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, v)| v["delta"].as_str().unwrap().to_string())
        .collect();
    let done = &events.last().unwrap().1["response"];
    assert_eq!(
        done["output"][0]["content"][0]["text"].as_str().unwrap(),
        deltas
    );
    // store: false is not retrievable.
    let nost = s
        .post(
            "/v1/responses",
            &json!({ "model": "qwen3", "input": "x", "max_output_tokens": 2, "store": false }),
        )
        .json();
    assert_eq!(
        s.get(&format!("/v1/responses/{}", nost["id"].as_str().unwrap()))
            .status,
        404
    );
    let got = s.get(&format!("/v1/responses/{}", r2["id"].as_str().unwrap()));
    assert_eq!(got.status, 200);
    assert_eq!(got.json()["output"], r2["output"]);
    // A killed server keeps its stored responses.
    s.kill();
    let s = Server::start(&fixture("qwen3"), &db, &["--engine", "sequential"]);
    let got = s
        .get(&format!("/v1/responses/{}", r2["id"].as_str().unwrap()))
        .json();
    assert_eq!(got["output"], r2["output"]);
    assert_eq!(got["previous_response_id"], r1["id"]);
    let stream_id = done["id"].as_str().unwrap();
    assert_eq!(s.get(&format!("/v1/responses/{stream_id}")).status, 200);
    // No live sequence after the restart: the history is replayed from the store.
    let r3 = s.post("/v1/responses", &json!({ "model": "qwen3", "input": "Go on", "previous_response_id": r2["id"], "max_output_tokens": 2, "temperature": 0 }));
    assert_eq!(r3.status, 200, "{}", r3.body);
    assert!(r3.json()["usage"]["input_tokens"].as_u64().unwrap() > in1);
    // Deleting a link breaks the chain.
    let del = s.req(
        "DELETE",
        &format!("/v1/responses/{}", r1["id"].as_str().unwrap()),
        None,
    );
    assert_eq!(
        del.json(),
        json!({ "id": r1["id"], "object": "response.deleted", "deleted": true })
    );
    assert_eq!(
        s.req(
            "DELETE",
            &format!("/v1/responses/{}", r1["id"].as_str().unwrap()),
            None
        )
        .status,
        404
    );
    let r4 = s.post(
        "/v1/responses",
        &json!({ "model": "qwen3", "input": "again", "previous_response_id": r2["id"] }),
    );
    assert_eq!(r4.status, 400);
    assert_eq!(r4.json()["error"]["code"], "previous_response_not_found");
}

#[test]
fn embeddings_match_the_library() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = fixture("qwen3_embed");
    let s = Server::start(&model_dir, &dir.path().join("r.db"), &[]);
    let texts = ["the cat sat", "a completely different sentence"];
    let r = s.post(
        "/v1/embeddings",
        &json!({ "model": "qwen3_embed", "input": texts }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let m = load_model(&model_dir, &LoadOptions::default())
        .unwrap()
        .into_embedding()
        .unwrap();
    for (i, t) in texts.iter().enumerate() {
        let got: Vec<f32> = serde_json::from_value(v["data"][i]["embedding"].clone()).unwrap();
        let want = m.encode(t, None).unwrap();
        assert_eq!(got.len(), m.hidden_size());
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-5, "text {i}: max |diff| {diff}");
    }
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    // base64 (the openai client's default): little-endian f32.
    let b = s
        .post(
            "/v1/embeddings",
            &json!({ "model": "qwen3_embed", "input": texts[0], "encoding_format": "base64" }),
        )
        .json();
    let bytes = base64_decode(b["data"][0]["embedding"].as_str().unwrap());
    let floats: Vec<f32> = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let first: Vec<f32> = serde_json::from_value(v["data"][0]["embedding"].clone()).unwrap();
    assert_eq!(floats, first);
    let r = s.post(
        "/v1/embeddings",
        &json!({ "model": "qwen3_embed", "input": "x", "dimensions": 3 }),
    );
    assert_eq!(
        (r.status, r.json()["error"]["param"].clone()),
        (400, json!("dimensions"))
    );
    let r = s.post(
        "/v1/chat/completions",
        &json!({ "model": "qwen3_embed", "messages": [{ "role": "user", "content": "hi" }] }),
    );
    assert_eq!(r.status, 400);
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("bad base64 {c}"),
    } as u32;
    let clean: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::new();
    for chunk in clean.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= val(c) << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..chunk.len() - 1]);
    }
    out
}
