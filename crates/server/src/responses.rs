//! `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.
//!
//! A request's conversation is its `instructions` (as a system message), the stored chain of
//! `previous_response_id` (each response's input items and output items, oldest first), then
//! its own `input`. The engine keeps the KV caches of recent sequences, so a response that
//! continues a live one prefills only the new tokens (`usage.input_tokens_details.cached_tokens`);
//! otherwise the history is rendered from the store and prefilled again.
//!
//! Reasoning (thinking) text is not part of the output items; tool calls are `function_call`
//! items.
use crate::error::{parse_body, ApiError};
use crate::http::{
    apply_tool_choice, chat_plan, convert_messages, make_id, sampling_of, tool_arguments,
    tool_call_from, ChatPlanInput, Shared,
};
use crate::pipeline::{self, Final, Out};
use crate::store::{now_secs, StoredResponse};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlx_models::chat::{
    ChatMessage, FunctionDefinition, ParsedToolCall, PromptPlan, Role, ToolDefinition,
};
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Instant;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResponsesRequest {
    model: String,
    input: Value,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    store: Option<bool>,
    #[serde(default)]
    stream: bool,
    max_output_tokens: Option<usize>,
    tools: Option<Vec<FlatTool>>,
    tool_choice: Option<Value>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    min_p: Option<f32>,
    seed: Option<u64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
}

/// The Responses API's function tool: `{"type": "function", "name", "description", "parameters"}`.
#[derive(Deserialize, serde::Serialize, Clone)]
#[serde(deny_unknown_fields)]
struct FlatTool {
    #[serde(rename = "type")]
    kind: String,
    name: String,
    description: Option<String>,
    parameters: Option<Value>,
    strict: Option<bool>,
}

/// The input as a list of items (a string is one user message).
fn input_items(input: &Value) -> Result<Vec<Value>, ApiError> {
    match input {
        Value::String(s) => Ok(vec![json!({ "role": "user", "content": s })]),
        Value::Array(a) if !a.is_empty() => Ok(a.clone()),
        _ => Err(ApiError::invalid_param(
            "input",
            "input must be a non-empty string or a non-empty list of items",
        )),
    }
}

/// Input or output items to chat messages.
fn items_to_messages(items: &[Value], at: &str) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out: Vec<ChatMessage> = Vec::new();
    for (i, it) in items.iter().enumerate() {
        let p = format!("{at}[{i}]");
        let kind = it.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let mut m = serde_json::Map::new();
                m.insert(
                    "role".into(),
                    it.get("role").cloned().unwrap_or(Value::Null),
                );
                m.insert(
                    "content".into(),
                    it.get("content").cloned().unwrap_or(Value::Null),
                );
                let mut v = convert_messages(&[Value::Object(m)]).map_err(|e| ApiError {
                    param: Some(p.clone()),
                    ..e
                })?;
                out.append(&mut v);
            }
            "function_call" => {
                let name = it.get("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid_param(&p, "function_call item without a name")
                })?;
                let call = tool_call_from(
                    it.get("call_id").and_then(Value::as_str),
                    name,
                    it.get("arguments"),
                );
                match out.last_mut() {
                    Some(last) if last.role == Role::Assistant => {
                        last.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => out.push(ChatMessage::assistant("").with_tool_calls(vec![call])),
                }
            }
            "function_call_output" => {
                let id = it.get("call_id").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid_param(&p, "function_call_output item without a call_id")
                })?;
                let output = match it.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v) => v.to_string(),
                    None => String::new(),
                };
                out.push(ChatMessage::tool(id, output));
            }
            "reasoning" => {}
            other => {
                return Err(ApiError::invalid_param(
                    &p,
                    format!("unsupported input item type {other:?}"),
                ))
            }
        }
    }
    Ok(out)
}

fn usage_json(f: &Final) -> Value {
    json!({
        "input_tokens": f.prompt_tokens,
        "input_tokens_details": { "cached_tokens": f.cached_tokens },
        "output_tokens": f.completion_tokens,
        "output_tokens_details": { "reasoning_tokens": f.reasoning_tokens },
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({ "id": id, "type": "message", "status": status, "role": "assistant",
            "content": [{ "type": "output_text", "text": text, "annotations": [] }] })
}

fn call_item(c: &ParsedToolCall) -> Value {
    let args = tool_arguments(c);
    json!({ "id": format!("fc_{}", c.id), "type": "function_call", "status": "completed", "call_id": c.id, "name": c.name, "arguments": args })
}

/// The settings echoed in a response object.
struct Echo {
    instructions: Option<String>,
    previous_response_id: Option<String>,
    store: bool,
    config: Value,
}

fn response_json(
    id: &str,
    created: i64,
    model: &str,
    status: &str,
    output: Value,
    usage: Value,
    echo: &Echo,
) -> Value {
    let incomplete = if status == "incomplete" {
        json!({ "reason": "max_output_tokens" })
    } else {
        Value::Null
    };
    let mut r = json!({
        "id": id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "usage": usage, "error": Value::Null, "incomplete_details": incomplete,
        "instructions": echo.instructions, "previous_response_id": echo.previous_response_id, "store": echo.store,
        "parallel_tool_calls": true, "text": { "format": { "type": "text" } }, "metadata": {},
    });
    for k in [
        "temperature",
        "top_p",
        "max_output_tokens",
        "tools",
        "tool_choice",
    ] {
        r[k] = echo.config.get(k).cloned().unwrap_or(Value::Null);
    }
    if r["tools"].is_null() {
        r["tools"] = json!([]);
    }
    if r["tool_choice"].is_null() {
        r["tool_choice"] = json!("auto");
    }
    r
}

pub async fn create(State(st): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let r: ResponsesRequest = parse_body(&body)?;
    st.check_model(&r.model)?;
    let b = st.lm()?;
    let items = input_items(&r.input)?;
    let new_messages = items_to_messages(&items, "input")?;
    let mut messages = Vec::new();
    if let Some(ins) = &r.instructions {
        messages.push(ChatMessage::system(ins.clone()));
    }
    if let Some(prev) = &r.previous_response_id {
        let store = st.store.clone();
        let p = prev.clone();
        let chain = tokio::task::spawn_blocking(move || store.get_chain(&p))
            .await
            .map_err(|_| ApiError::internal("store task failed"))?;
        let chain = chain.map_err(|e| match e {
            crate::store::StoreError::NotFound(_)
            | crate::store::StoreError::BrokenChain { .. } => ApiError::invalid_param(
                "previous_response_id",
                format!("Previous response with id '{prev}' not found ({e})"),
            )
            .with_code("previous_response_not_found"),
            other => ApiError::internal(other.to_string()),
        })?;
        for rec in &chain {
            let input: Vec<Value> = serde_json::from_str(&rec.input_json)
                .map_err(|e| ApiError::internal(format!("stored response {}: {e}", rec.id)))?;
            let output: Vec<Value> = serde_json::from_str(&rec.output_json)
                .map_err(|e| ApiError::internal(format!("stored response {}: {e}", rec.id)))?;
            messages.extend(items_to_messages(&input, "stored input")?);
            messages.extend(items_to_messages(&output, "stored output")?);
        }
    }
    let live = r
        .previous_response_id
        .as_deref()
        .and_then(|p| st.live.get(p))
        .filter(|(ins, _)| *ins == r.instructions)
        .map(|(_, ids)| ids);
    let tools: Option<Vec<ToolDefinition>> = match &r.tools {
        None => None,
        Some(ts) => Some(
            ts.iter()
                .enumerate()
                .map(|(i, t)| {
                    if t.strict == Some(true) {
                        return Err(ApiError::invalid_param(format!("tools[{i}].strict"), "strict function schemas are not enforced by this server: pass strict false or leave it out"));
                    }
                    if t.kind != "function" {
                        return Err(ApiError::invalid_param(
                            format!("tools[{i}].type"),
                            format!("only function tools are supported, got {:?}", t.kind),
                        ));
                    }
                    Ok(ToolDefinition {
                        kind: "function".into(),
                        function: FunctionDefinition {
                            name: t.name.clone(),
                            description: t.description.clone(),
                            parameters: t.parameters.clone(),
                        },
                    })
                })
                .collect::<Result<_, _>>()?,
        ),
    };
    let tools = apply_tool_choice(tools, r.tool_choice.as_ref())?;
    let sampling = sampling_of!(r);
    let opts = mlx_models::chat::RenderOptions {
        tools: tools.clone(),
        ..Default::default()
    };
    let prompt = match live {
        Some(ids) => match b
            .format
            .plan_continuation(&messages, &ids, &new_messages, &opts)
            .map_err(|e| ApiError::invalid_param("input", e.to_string()))?
        {
            PromptPlan::Append {
                delta,
                starts_in_thinking,
                ..
            } => Some(([ids, delta].concat(), starts_in_thinking)),
            PromptPlan::Reprefill { prompt, .. } => Some((prompt.ids, prompt.starts_in_thinking)),
        },
        None => None,
    };
    messages.extend(new_messages);
    let plan = chat_plan(
        b,
        ChatPlanInput {
            messages,
            prompt,
            tools,
            max_new: r.max_output_tokens,
            sampling: &sampling,
            stop: Vec::new(),
            logprobs: false,
            arrived,
        },
    )?;
    let rx = pipeline::start(&b.engine, &b.format, &st.metrics, plan)?;
    let (id, msg_id, created, model) = (
        make_id("resp_"),
        make_id("msg_"),
        now_secs(),
        st.model_id.clone(),
    );
    let config = json!({ "temperature": r.temperature, "top_p": r.top_p, "max_output_tokens": r.max_output_tokens,
                         "tools": r.tools, "tool_choice": r.tool_choice });
    let echo = Echo {
        instructions: r.instructions.clone(),
        previous_response_id: r.previous_response_id.clone(),
        store: r.store.unwrap_or(true),
        config,
    };
    let msg_id2 = msg_id.clone();
    let in_progress = response_json(
        &id,
        created,
        &model,
        "in_progress",
        json!([]),
        Value::Null,
        &echo,
    );
    let finish = move |f: &Final, st: &Shared| -> (Value, Option<StoredResponse>) {
        let status = if f.finish_reason == "length" {
            "incomplete"
        } else {
            "completed"
        };
        let mut output = vec![message_item(&msg_id, &f.text, status)];
        output.extend(f.tool_calls.iter().map(call_item));
        let usage = usage_json(f);
        if let Some(seq) = &f.sequence {
            st.live
                .put(id.clone(), echo.instructions.clone(), seq.clone());
        }
        let resp = response_json(
            &id,
            created,
            &model,
            status,
            Value::Array(output.clone()),
            usage.clone(),
            &echo,
        );
        let rec = echo.store.then(|| StoredResponse {
            id: id.clone(),
            created_at: created,
            model: model.clone(),
            status: status.to_string(),
            instructions: echo.instructions.clone(),
            input_json: Value::Array(items.clone()).to_string(),
            output_json: Value::Array(output).to_string(),
            output_text: f.text.clone(),
            usage_json: usage.to_string(),
            previous_response_id: echo.previous_response_id.clone(),
            config_json: Some(echo.config.to_string()),
            expires_at: Some(created + st.retention_secs),
        });
        (resp, rec)
    };
    async fn save(st: &Shared, rec: Option<StoredResponse>) -> Result<(), ApiError> {
        if let Some(rec) = rec {
            let store = st.store.clone();
            tokio::task::spawn_blocking(move || store.store(&rec))
                .await
                .map_err(|_| ApiError::internal("store task failed"))?
                .map_err(|e| ApiError::internal(e.to_string()))?;
        }
        Ok(())
    }
    if !r.stream {
        let (f, _) = pipeline::collect(rx).await?;
        let (resp, rec) = finish(&f, &st);
        save(&st, rec).await?;
        return Ok(Json(resp).into_response());
    }
    let (tx, out) = tokio::sync::mpsc::unbounded_channel::<String>();
    let st2 = st.clone();
    tokio::spawn(async move {
        let mut rx = rx;
        let mut seq = 0u64;
        let mut ev = |kind: &str, mut v: Value| {
            v["type"] = json!(kind);
            v["sequence_number"] = json!(seq);
            seq += 1;
            tx.send(format!("event: {kind}\ndata: {v}\n\n")).is_ok()
        };
        if !ev("response.created", json!({ "response": in_progress }))
            || !ev("response.in_progress", json!({ "response": in_progress }))
        {
            return;
        }
        let item = json!({ "id": msg_id2, "type": "message", "status": "in_progress", "role": "assistant", "content": [] });
        if !ev(
            "response.output_item.added",
            json!({ "output_index": 0, "item": item }),
        ) {
            return;
        }
        let part = json!({ "type": "output_text", "text": "", "annotations": [] });
        if !ev(
            "response.content_part.added",
            json!({ "item_id": msg_id2, "output_index": 0, "content_index": 0, "part": part }),
        ) {
            return;
        }
        while let Some(o) = rx.recv().await {
            match o {
                Out::Text(t) => {
                    if !ev(
                        "response.output_text.delta",
                        json!({ "item_id": msg_id2, "output_index": 0, "content_index": 0, "delta": t, "logprobs": [] }),
                    ) {
                        return;
                    }
                }
                Out::Thinking(_) | Out::Logprob(_) | Out::ToolCall(_) => {}
                Out::Done(f) => {
                    let (resp, rec) = finish(&f, &st2);
                    if let Err(e) = save(&st2, rec).await {
                        ev(
                            "error",
                            json!({ "code": "server_error", "message": e.message, "param": Value::Null }),
                        );
                        return;
                    }
                    let part = json!({ "type": "output_text", "text": f.text, "annotations": [] });
                    ev(
                        "response.output_text.done",
                        json!({ "item_id": msg_id2, "output_index": 0, "content_index": 0, "text": f.text, "logprobs": [] }),
                    );
                    ev(
                        "response.content_part.done",
                        json!({ "item_id": msg_id2, "output_index": 0, "content_index": 0, "part": part }),
                    );
                    ev(
                        "response.output_item.done",
                        json!({ "output_index": 0, "item": resp["output"][0] }),
                    );
                    for (k, c) in f.tool_calls.iter().enumerate() {
                        let done = call_item(c);
                        let mut added = done.clone();
                        added["status"] = json!("in_progress");
                        added["arguments"] = json!("");
                        let (iid, idx) = (done["id"].clone(), k + 1);
                        ev(
                            "response.output_item.added",
                            json!({ "output_index": idx, "item": added }),
                        );
                        ev(
                            "response.function_call_arguments.delta",
                            json!({ "item_id": iid, "output_index": idx, "delta": done["arguments"] }),
                        );
                        ev(
                            "response.function_call_arguments.done",
                            json!({ "item_id": iid, "output_index": idx, "arguments": done["arguments"] }),
                        );
                        ev(
                            "response.output_item.done",
                            json!({ "output_index": idx, "item": done }),
                        );
                    }
                    let kind = if resp["status"] == "incomplete" {
                        "response.incomplete"
                    } else {
                        "response.completed"
                    };
                    ev(kind, json!({ "response": resp }));
                    return;
                }
                Out::Error(e) => {
                    let mut failed = in_progress.clone();
                    failed["status"] = json!("failed");
                    failed["error"] = json!({ "code": "server_error", "message": e });
                    ev("response.failed", json!({ "response": failed }));
                    return;
                }
            }
        }
    });
    Ok(crate::http::sse(out))
}

pub async fn get_one(
    State(st): State<Shared>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let store = st.store.clone();
    let i = id.clone();
    let rec = tokio::task::spawn_blocking(move || store.get(&i))
        .await
        .map_err(|_| ApiError::internal("store task failed"))?
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let rec =
        rec.ok_or_else(|| ApiError::not_found(format!("No response found with id '{id}'")))?;
    let output: Value = serde_json::from_str(&rec.output_json).unwrap_or(json!([]));
    let usage: Value = serde_json::from_str(&rec.usage_json).unwrap_or(Value::Null);
    let config: Value = rec
        .config_json
        .as_deref()
        .and_then(|c| serde_json::from_str(c).ok())
        .unwrap_or(json!({}));
    let echo = Echo {
        instructions: rec.instructions.clone(),
        previous_response_id: rec.previous_response_id.clone(),
        store: true,
        config,
    };
    Ok(Json(response_json(
        &rec.id,
        rec.created_at,
        &rec.model,
        &rec.status,
        output,
        usage,
        &echo,
    ))
    .into_response())
}

pub async fn delete_one(
    State(st): State<Shared>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let store = st.store.clone();
    let i = id.clone();
    let deleted = tokio::task::spawn_blocking(move || store.delete(&i))
        .await
        .map_err(|_| ApiError::internal("store task failed"))?
        .map_err(|e| ApiError::internal(e.to_string()))?;
    if !deleted {
        return Err(ApiError::not_found(format!(
            "No response found with id '{id}'"
        )));
    }
    Ok(Json(json!({ "id": id, "object": "response.deleted", "deleted": true })).into_response())
}
