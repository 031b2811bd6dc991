//! The HTTP layer: state, routes, and the OpenAI endpoints other than `/v1/responses`.
use crate::engine::{Engine, GenRequest};
use crate::error::{parse_body, ApiError};
use crate::metrics::{Gauges, Metrics};
use crate::pipeline::{self, Final, Out, Plan, TokenLogprob};
use crate::store::ResponseStore;
use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use mlx_models::chat::{
    ChatFormat, ChatMessage, ParsedToolCall, RenderOptions, Role, Tokenizer, ToolCall,
    ToolDefinition,
};
use mlx_models::families::harrier::HarrierModel;
use mlx_models::ModelInfo;
use sampling::{SamplingConfig, SamplingOverrides};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

/// A causal LM behind an engine.
pub struct LmBackend {
    pub engine: Arc<dyn Engine>,
    pub format: Arc<ChatFormat>,
    /// generation_config.json's sampling values.
    pub defaults: SamplingOverrides,
    pub info: ModelInfo,
}

/// An embedding model; `slots` bounds the requests waiting for it.
pub struct EmbedBackend {
    pub model: Arc<HarrierModel>,
    pub tokenizer: Arc<Tokenizer>,
    pub slots: Arc<tokio::sync::Semaphore>,
}

#[allow(clippy::large_enum_variant)] // one per server
pub enum Backend {
    Lm(LmBackend),
    Embedding(EmbedBackend),
}

/// Everything a handler needs.
pub struct AppState {
    /// The name clients use in `model`.
    pub model_id: String,
    /// Unix seconds at start.
    pub created: i64,
    pub backend: Backend,
    pub store: Arc<ResponseStore>,
    pub metrics: Arc<Metrics>,
    /// How long stored responses are kept, in seconds.
    pub retention_secs: i64,
    /// The token sequences of recent responses (see [`LiveSequences`]).
    pub live: LiveSequences,
}

/// (response id, instructions, token sequence).
type LiveEntry = (String, Option<String>, Vec<u32>);

/// The token sequences of the most recent responses, by response id, with the instructions
/// they were generated under: a response continuing one of them appends its new messages to
/// exactly these tokens, which the engine still holds in a KV cache.
#[derive(Default)]
pub struct LiveSequences {
    inner: std::sync::Mutex<std::collections::VecDeque<LiveEntry>>,
}

impl LiveSequences {
    pub const CAPACITY: usize = 64;
    pub fn put(&self, id: String, instructions: Option<String>, ids: Vec<u32>) {
        let mut q = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= Self::CAPACITY {
            q.pop_front();
        }
        q.push_back((id, instructions, ids));
    }
    pub fn get(&self, id: &str) -> Option<(Option<String>, Vec<u32>)> {
        let q = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        q.iter()
            .rev()
            .find(|(i, _, _)| i == id)
            .map(|(_, ins, ids)| (ins.clone(), ids.clone()))
    }
}

pub type Shared = Arc<AppState>;

impl AppState {
    pub fn lm(&self) -> Result<&LmBackend, ApiError> {
        match &self.backend {
            Backend::Lm(b) => Ok(b),
            Backend::Embedding(_) => Err(ApiError::invalid(format!(
                "model '{}' is an embedding model: use /v1/embeddings",
                self.model_id
            ))
            .with_code("model_not_supported")),
        }
    }
    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model != self.model_id {
            return Err(ApiError::invalid_param(
                "model",
                format!(
                    "The model '{model}' does not exist; this server serves '{}'",
                    self.model_id
                ),
            )
            .with_code("model_not_found"));
        }
        Ok(())
    }
}

pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(crate::responses::create))
        .route(
            "/v1/responses/{id}",
            get(crate::responses::get_one).delete(crate::responses::delete_one),
        )
        .fallback(|| async { ApiError::not_found("Unknown endpoint") })
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

async fn count_requests(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let path = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "other".to_string(), |p| p.as_str().to_string());
    let resp = next.run(req).await;
    st.metrics.request(&path, resp.status().as_u16());
    resp
}

async fn health(State(st): State<Shared>) -> Json<Value> {
    Json(json!({ "status": "ok", "model": st.model_id }))
}

async fn models(State(st): State<Shared>) -> Json<Value> {
    Json(
        json!({ "object": "list", "data": [{ "id": st.model_id, "object": "model", "created": st.created, "owned_by": "mlx-models" }] }),
    )
}

async fn metrics(State(st): State<Shared>) -> Response {
    let engine = match &st.backend {
        Backend::Lm(b) => b.engine.stats(),
        Backend::Embedding(e) => crate::engine::EngineStats {
            queue_capacity: e.slots.available_permits(),
            ..Default::default()
        },
    };
    let g = Gauges {
        engine,
        memory: mlx_models::observe::memory_stats().ok(),
    };
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(&g),
    )
        .into_response()
}

/// `"stop"`: a string or a list of strings.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    pub fn into_vec(self) -> Result<Vec<String>, ApiError> {
        let v = match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        };
        if v.len() > 4 || v.iter().any(|s| s.is_empty()) {
            return Err(ApiError::invalid_param(
                "stop",
                "'stop' takes at most 4 non-empty strings",
            ));
        }
        Ok(v)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by the generating endpoints.
#[derive(Default)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// The sampling fields of a request struct (they are spelled out in each: serde's
/// `deny_unknown_fields` does not combine with `flatten`).
macro_rules! sampling_of {
    ($r:expr) => {
        $crate::http::SamplingFields {
            temperature: $r.temperature,
            top_p: $r.top_p,
            top_k: $r.top_k,
            min_p: $r.min_p,
            seed: $r.seed,
            presence_penalty: $r.presence_penalty,
            frequency_penalty: $r.frequency_penalty,
            repetition_penalty: $r.repetition_penalty,
        }
    };
}
pub(crate) use sampling_of;

impl SamplingFields {
    pub fn resolve(&self, defaults: &SamplingOverrides) -> Result<SamplingConfig, ApiError> {
        let o = SamplingOverrides {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            ..Default::default()
        };
        SamplingConfig::resolve(&o, defaults)
            .map_err(|e| ApiError::invalid(format!("Invalid sampling settings: {e}")))
    }
}

/// The stop ids of generated text: the template's turn end and the model's eos ids.
pub fn stop_ids(b: &LmBackend) -> Vec<u32> {
    let mut stop = b.format.stop_token_ids();
    for &e in &b.info.eos_token_ids {
        if !stop.contains(&e) {
            stop.push(e);
        }
    }
    stop
}

/// `max_new` tokens after a `prompt`-token prompt must fit the context.
pub fn check_context(
    b: &LmBackend,
    prompt: usize,
    max_new: Option<usize>,
) -> Result<usize, ApiError> {
    let ctx = b.info.max_position_embeddings;
    if prompt == 0 {
        return Err(ApiError::invalid("The prompt is empty"));
    }
    let max_new = max_new.unwrap_or(ctx.saturating_sub(prompt));
    if prompt + max_new > ctx || prompt >= ctx {
        return Err(ApiError::invalid(format!(
            "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({prompt} in the messages, {max_new} in the completion). Please reduce the length of the messages or completion.",
            prompt + max_new
        ))
        .with_code("context_length_exceeded"));
    }
    if max_new == 0 {
        return Err(ApiError::invalid_param(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    Ok(max_new)
}

fn new_id(prefix: &str) -> String {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let h = std::collections::hash_map::RandomState::new()
        .hash_one((N.fetch_add(1, Ordering::Relaxed), Instant::now()));
    let h2 = std::collections::hash_map::RandomState::new().hash_one(h);
    format!("{prefix}{h:016x}{:08x}", h2 as u32)
}

pub fn make_id(prefix: &str) -> String {
    new_id(prefix)
}

/// Server-sent events from a stream of JSON payloads (each `data: <json>`), then `data: [DONE]`
/// when `done` is set.
pub fn sse(rx: UnboundedReceiver<String>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|s| (Ok::<_, std::convert::Infallible>(Bytes::from(s)), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream.boxed()))
        .unwrap_or_else(|_| ApiError::internal("building the event stream failed").into_response())
}

/// How a chat or completion stream ends after its last chunk: the usage chunk (with
/// `stream_options.include_usage`), then `data: [DONE]`.
struct StreamEnd {
    id: String,
    object: &'static str,
    created: i64,
    model: String,
    include_usage: bool,
}

impl StreamEnd {
    fn new(
        id: &str,
        object: &'static str,
        created: i64,
        model: &str,
        opts: Option<StreamOptions>,
    ) -> Self {
        let include_usage = opts.is_some_and(|o| o.include_usage);
        StreamEnd {
            id: id.to_string(),
            object,
            created,
            model: model.to_string(),
            include_usage,
        }
    }
}

/// Server-sent events of a generation: `first` at once, then `chunk(o)` for each output `o` of
/// `rx` (`None`: nothing to send for it, e.g. a log-prob held for the next chunk); `Done`'s chunk
/// is followed by [`StreamEnd`]'s; an `Error` ends the stream with an OpenAI error body.
fn stream_chunks(
    mut rx: UnboundedReceiver<Out>,
    first: Option<String>,
    end: StreamEnd,
    mut chunk: impl FnMut(&Out) -> Option<String> + Send + 'static,
) -> Response {
    let (tx, out) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        if let Some(f) = first {
            if tx.send(f).is_err() {
                return;
            }
        }
        while let Some(o) = rx.recv().await {
            let msg = match &o {
                Out::Error(e) => {
                    let _ = tx.send(format!(
                        "data: {}\n\n",
                        ApiError::internal(e.clone()).body()
                    ));
                    return;
                }
                Out::Done(f) => {
                    let mut s = chunk(&o).unwrap_or_default();
                    if end.include_usage {
                        let u = json!({ "id": end.id, "object": end.object, "created": end.created, "model": end.model, "choices": [], "usage": usage_json(f) });
                        s.push_str(&format!("data: {u}\n\n"));
                    }
                    s.push_str("data: [DONE]\n\n");
                    let _ = tx.send(s);
                    return;
                }
                _ => match chunk(&o) {
                    Some(m) => m,
                    None => continue,
                },
            };
            if tx.send(msg).is_err() {
                return;
            }
        }
    });
    sse(out)
}

// ---------------------------------------------------------------- chat completions

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatRequest {
    model: String,
    messages: Vec<Value>,
    tools: Option<Vec<ToolDefinition>>,
    tool_choice: Option<Value>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    stop: Option<StopSpec>,
    #[serde(default)]
    logprobs: bool,
    top_logprobs: Option<u32>,
    n: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    min_p: Option<f32>,
    seed: Option<u64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
}

/// `tools` as the template sees them, after `tool_choice` (`auto` or `none`; forcing a call
/// needs constrained decoding, which the server does not do, so it is refused).
pub fn apply_tool_choice(
    tools: Option<Vec<ToolDefinition>>,
    choice: Option<&Value>,
) -> Result<Option<Vec<ToolDefinition>>, ApiError> {
    match choice {
        None => Ok(tools),
        Some(Value::String(s)) if s == "auto" => Ok(tools),
        Some(Value::String(s)) if s == "none" => Ok(None),
        Some(other) => Err(ApiError::invalid_param(
            "tool_choice",
            format!("tool_choice {other} is not supported: only \"auto\" and \"none\" (forcing a tool call needs constrained decoding)"),
        )),
    }
}

fn text_of_content(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("text" | "input_text" | "output_text", Some(t)) => out.push_str(t),
                    _ => return Err(ApiError::invalid_param(format!("{at}[{i}]"), format!("unsupported content part (type {kind:?}): only text parts are supported"))),
                }
            }
            Ok(out)
        }
        other => Err(ApiError::invalid_param(
            at,
            format!("content must be a string or a list of text parts, got {other}"),
        )),
    }
}

/// OpenAI chat messages to ours.
pub fn convert_messages(raw: &[Value]) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
        let at = format!("messages[{i}]");
        let obj = m
            .as_object()
            .ok_or_else(|| ApiError::invalid_param(&at, "each message must be an object"))?;
        for k in obj.keys() {
            if !matches!(
                k.as_str(),
                "role"
                    | "content"
                    | "tool_calls"
                    | "tool_call_id"
                    | "reasoning_content"
                    | "reasoning"
            ) {
                return Err(ApiError::invalid_param(
                    format!("{at}.{k}"),
                    format!("unknown message field '{k}'"),
                ));
            }
        }
        let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid_param(format!("{at}.role"), "missing or non-string 'role'")
        })?;
        let role = match role {
            "developer" => Role::System,
            r => r
                .parse::<Role>()
                .map_err(|e| ApiError::invalid_param(format!("{at}.role"), e))?,
        };
        let content = text_of_content(
            obj.get("content").unwrap_or(&Value::Null),
            &format!("{at}.content"),
        )?;
        let mut msg = ChatMessage::new(role, content);
        if let Some(r) = obj
            .get("reasoning_content")
            .or_else(|| obj.get("reasoning"))
            .and_then(Value::as_str)
        {
            msg = msg.with_reasoning(r);
        }
        if let Some(calls) = obj.get("tool_calls").filter(|v| !v.is_null()) {
            let calls = calls.as_array().ok_or_else(|| {
                ApiError::invalid_param(format!("{at}.tool_calls"), "tool_calls must be a list")
            })?;
            let mut list = Vec::new();
            for (j, c) in calls.iter().enumerate() {
                let f = c.get("function").ok_or_else(|| {
                    ApiError::invalid_param(format!("{at}.tool_calls[{j}]"), "missing 'function'")
                })?;
                let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid_param(
                        format!("{at}.tool_calls[{j}].function.name"),
                        "missing name",
                    )
                })?;
                list.push(tool_call_from(
                    c.get("id").and_then(Value::as_str),
                    name,
                    f.get("arguments"),
                ));
            }
            msg = msg.with_tool_calls(list);
        }
        if let Some(id) = obj.get("tool_call_id").and_then(Value::as_str) {
            msg.tool_call_id = Some(id.to_string());
        }
        out.push(msg);
    }
    Ok(out)
}

/// A tool call of a request's history: `arguments` as OpenAI sends them (a JSON string,
/// kept as a string when it is not JSON) or as an object; `{}` when absent.
pub fn tool_call_from(id: Option<&str>, name: &str, arguments: Option<&Value>) -> ToolCall {
    let arguments = match arguments {
        Some(Value::String(s)) => {
            serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
        }
        Some(v) => v.clone(),
        None => json!({}),
    };
    ToolCall {
        id: id.map(String::from),
        name: name.to_string(),
        arguments,
    }
}

/// A parsed tool call's arguments as the JSON string OpenAI sends (the raw text when they did
/// not parse).
pub fn tool_arguments(c: &ParsedToolCall) -> String {
    if c.is_ok() {
        c.arguments.to_string()
    } else {
        c.raw.clone()
    }
}

/// OpenAI's form of a parsed tool call (`arguments` as a JSON string).
pub fn tool_call_json(c: &ParsedToolCall) -> Value {
    let args = tool_arguments(c);
    json!({ "id": c.id, "type": "function", "function": { "name": c.name, "arguments": args } })
}

fn usage_json(f: &Final) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": f.cached_tokens },
        "completion_tokens_details": { "reasoning_tokens": f.reasoning_tokens },
    })
}

fn logprob_json(l: &TokenLogprob) -> Value {
    json!({ "token": l.token, "logprob": l.logprob, "bytes": l.bytes, "top_logprobs": [] })
}

/// A chat prompt: render, check the context, build the plan.
pub struct ChatPlanInput<'a> {
    pub messages: Vec<ChatMessage>,
    /// Prompt ids and whether they end in an open think block, when already planned (a
    /// continued conversation); else `messages` are rendered.
    pub prompt: Option<(Vec<u32>, bool)>,
    pub tools: Option<Vec<ToolDefinition>>,
    pub max_new: Option<usize>,
    pub sampling: &'a SamplingFields,
    pub stop: Vec<String>,
    pub logprobs: bool,
    pub arrived: Instant,
}

pub fn chat_plan(b: &LmBackend, inp: ChatPlanInput<'_>) -> Result<Plan, ApiError> {
    let opts = RenderOptions {
        tools: inp.tools,
        ..Default::default()
    };
    let (ids, starts_in_thinking) = match inp.prompt {
        Some(p) => p,
        None => {
            let p = b
                .format
                .render(&inp.messages, &opts)
                .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
            (p.ids, p.starts_in_thinking)
        }
    };
    let max_new = check_context(b, ids.len(), inp.max_new)?;
    let mut parser = b.format.parser_options(&opts, starts_in_thinking, None);
    parser.call_id_prefix = format!("{}_", make_id("call_"));
    Ok(Plan {
        req: GenRequest {
            prompt: ids,
            max_new_tokens: max_new,
            sampling: inp.sampling.resolve(&b.defaults)?,
            stop_tokens: stop_ids(b),
        },
        stop_strings: inp.stop,
        parser: Some(parser),
        starts_in_thinking,
        logprobs: inp.logprobs,
        arrived: inp.arrived,
    })
}

fn check_unsupported(n: Option<u32>, top_logprobs: Option<u32>) -> Result<(), ApiError> {
    if n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid_param("n", "only n = 1 is supported"));
    }
    if top_logprobs.is_some_and(|k| k > 0) {
        return Err(ApiError::invalid_param(
            "top_logprobs",
            "top_logprobs > 0 is not supported: logprobs reports the sampled tokens' log-probs",
        ));
    }
    Ok(())
}

async fn chat_completions(State(st): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let r: ChatRequest = parse_body(&body)?;
    st.check_model(&r.model)?;
    let b = st.lm()?;
    check_unsupported(r.n, r.top_logprobs)?;
    if r.messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must not be empty",
        ));
    }
    let messages = convert_messages(&r.messages)?;
    let tools = apply_tool_choice(r.tools, r.tool_choice.as_ref())?;
    let stop = r
        .stop
        .map(StopSpec::into_vec)
        .transpose()?
        .unwrap_or_default();
    let plan = chat_plan(
        b,
        ChatPlanInput {
            messages,
            prompt: None,
            tools,
            max_new: r.max_completion_tokens.or(r.max_tokens),
            sampling: &sampling_of!(r),
            stop,
            logprobs: r.logprobs,
            arrived,
        },
    )?;
    let rx = pipeline::start(&b.engine, &b.format, &st.metrics, plan)?;
    let (id, created, model) = (
        make_id("chatcmpl-"),
        crate::store::now_secs(),
        st.model_id.clone(),
    );
    if !r.stream {
        let (f, lps) = pipeline::collect(rx).await?;
        let mut message = json!({ "role": "assistant", "content": if f.text.is_empty() && !f.tool_calls.is_empty() { Value::Null } else { Value::String(f.text.clone()) } });
        if let Some(t) = &f.thinking {
            message["reasoning_content"] = json!(t);
        }
        if !f.tool_calls.is_empty() {
            message["tool_calls"] = Value::Array(f.tool_calls.iter().map(tool_call_json).collect());
        }
        let logprobs = if r.logprobs {
            json!({ "content": lps.iter().map(logprob_json).collect::<Vec<_>>() })
        } else {
            Value::Null
        };
        return Ok(Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{ "index": 0, "message": message, "logprobs": logprobs, "finish_reason": f.finish_reason }],
            "usage": usage_json(&f),
        }))
        .into_response());
    }
    let end = StreamEnd::new(
        &id,
        "chat.completion.chunk",
        created,
        &model,
        r.stream_options,
    );
    let logprobs = r.logprobs;
    let chunk = move |delta: Value, finish: Value, lps: Value| {
        let c = json!({ "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{ "index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish }] });
        format!("data: {c}\n\n")
    };
    let first = chunk(
        json!({ "role": "assistant", "content": "" }),
        Value::Null,
        Value::Null,
    );
    let lp_field = move |v: &mut Vec<Value>| {
        if logprobs {
            json!({ "content": std::mem::take(v) })
        } else {
            Value::Null
        }
    };
    let mut pending_lps: Vec<Value> = Vec::new();
    let mut n_calls = 0usize;
    Ok(stream_chunks(rx, Some(first), end, move |o| {
        Some(match o {
            Out::Logprob(l) => {
                pending_lps.push(logprob_json(l));
                return None;
            }
            Out::Text(t) => chunk(
                json!({ "content": t }),
                Value::Null,
                lp_field(&mut pending_lps),
            ),
            Out::Thinking(t) => chunk(
                json!({ "reasoning_content": t }),
                Value::Null,
                lp_field(&mut pending_lps),
            ),
            Out::ToolCall(c) => {
                let mut tc = tool_call_json(c);
                tc["index"] = json!(n_calls);
                n_calls += 1;
                chunk(
                    json!({ "tool_calls": [tc] }),
                    Value::Null,
                    lp_field(&mut pending_lps),
                )
            }
            Out::Done(f) => chunk(
                json!({}),
                json!(f.finish_reason),
                lp_field(&mut pending_lps),
            ),
            Out::Error(_) => return None,
        })
    }))
}

// ---------------------------------------------------------------- completions

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptSpec {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompletionRequest {
    model: String,
    prompt: PromptSpec,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<usize>,
    stop: Option<StopSpec>,
    logprobs: Option<u32>,
    #[serde(default)]
    echo: bool,
    n: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    min_p: Option<f32>,
    seed: Option<u64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
}

async fn completions(State(st): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let r: CompletionRequest = parse_body(&body)?;
    st.check_model(&r.model)?;
    let b = st.lm()?;
    check_unsupported(r.n, None)?;
    if r.echo {
        return Err(ApiError::invalid_param("echo", "echo is not supported"));
    }
    if r.logprobs.is_some_and(|k| k > 0) {
        return Err(ApiError::invalid_param("logprobs", "logprobs > 0 (top alternatives) is not supported; 0 reports the sampled tokens' log-probs"));
    }
    let tok = b.format.tokenizer();
    let ids = match r.prompt {
        PromptSpec::Text(t) => tok
            .encode(&t, true)
            .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?,
        PromptSpec::Texts(v) if v.len() == 1 => tok
            .encode(&v[0], true)
            .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?,
        PromptSpec::Texts(_) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "only one prompt per request is supported",
            ))
        }
        PromptSpec::Ids(ids) => {
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= b.info.vocab_size) {
                return Err(ApiError::invalid_param(
                    "prompt",
                    format!(
                        "token id {bad} out of range for vocab size {}",
                        b.info.vocab_size
                    ),
                ));
            }
            ids
        }
    };
    // OpenAI's default for /v1/completions is 16 tokens.
    let max_new = check_context(b, ids.len(), Some(r.max_tokens.unwrap_or(16)))?;
    let logprobs = r.logprobs.is_some();
    let plan = Plan {
        req: GenRequest {
            prompt: ids,
            max_new_tokens: max_new,
            sampling: sampling_of!(r).resolve(&b.defaults)?,
            stop_tokens: b.info.eos_token_ids.clone(),
        },
        stop_strings: r
            .stop
            .map(StopSpec::into_vec)
            .transpose()?
            .unwrap_or_default(),
        parser: None,
        starts_in_thinking: false,
        logprobs,
        arrived,
    };
    let rx = pipeline::start(&b.engine, &b.format, &st.metrics, plan)?;
    let (id, created, model) = (
        make_id("cmpl-"),
        crate::store::now_secs(),
        st.model_id.clone(),
    );
    let lp_json = |lps: &[TokenLogprob]| {
        json!({ "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": Value::Null, "text_offset": Value::Null })
    };
    if !r.stream {
        let (f, lps) = pipeline::collect(rx).await?;
        return Ok(Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{ "index": 0, "text": f.text, "logprobs": if logprobs { lp_json(&lps) } else { Value::Null }, "finish_reason": f.finish_reason }],
            "usage": usage_json(&f),
        }))
        .into_response());
    }
    let end = StreamEnd::new(&id, "text_completion", created, &model, r.stream_options);
    let chunk = move |text: &str, finish: Value, lps: Value| {
        let c = json!({ "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{ "index": 0, "text": text, "logprobs": lps, "finish_reason": finish }] });
        format!("data: {c}\n\n")
    };
    let lps = move |p: &mut Vec<TokenLogprob>| {
        if logprobs {
            lp_json(&std::mem::take(p))
        } else {
            Value::Null
        }
    };
    let mut pending: Vec<TokenLogprob> = Vec::new();
    Ok(stream_chunks(rx, None, end, move |o| match o {
        Out::Logprob(l) => {
            pending.push(l.clone());
            None
        }
        Out::Text(t) => Some(chunk(t, Value::Null, lps(&mut pending))),
        Out::Done(f) => Some(chunk("", json!(f.finish_reason), lps(&mut pending))),
        Out::Thinking(_) | Out::ToolCall(_) | Out::Error(_) => None,
    }))
}

// ---------------------------------------------------------------- embeddings

#[derive(Deserialize)]
#[serde(untagged)]
enum EmbedInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EmbeddingRequest {
    model: String,
    input: EmbedInput,
    encoding_format: Option<String>,
    dimensions: Option<usize>,
}

async fn embeddings(State(st): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    let r: EmbeddingRequest = parse_body(&body)?;
    st.check_model(&r.model)?;
    let Backend::Embedding(e) = &st.backend else {
        return Err(ApiError::invalid(format!(
            "model '{}' is not an embedding model",
            st.model_id
        ))
        .with_code("model_not_supported"));
    };
    let base64 = match r.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid_param(
                "encoding_format",
                format!("encoding_format must be \"float\" or \"base64\", got {other:?}"),
            ))
        }
    };
    let dim = e.model.hidden_size();
    if let Some(d) = r.dimensions.filter(|&d| d != dim) {
        return Err(ApiError::invalid_param("dimensions", format!("this model produces {dim}-dimensional embeddings; dimensions = {d} is not supported")));
    }
    let prefix = match e.model.default_prompt_name.as_deref() {
        Some(name) => e.model.prompts.get(name).cloned().unwrap_or_default(),
        None => String::new(),
    };
    let encode = |t: &str| {
        e.tokenizer
            .encode(&format!("{prefix}{t}"), true)
            .map_err(|err| ApiError::invalid_param("input", err.to_string()))
    };
    let batch: Vec<Vec<u32>> = match r.input {
        EmbedInput::Text(t) => vec![encode(&t)?],
        EmbedInput::Texts(v) => v.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
        EmbedInput::Ids(ids) => vec![ids],
        EmbedInput::IdLists(v) => v,
    };
    let max = e.model.max_length();
    for (i, ids) in batch.iter().enumerate() {
        if ids.is_empty() {
            return Err(ApiError::invalid_param(
                format!("input[{i}]"),
                "input must not be empty",
            ));
        }
        if ids.len() > max {
            return Err(ApiError::invalid_param(format!("input[{i}]"), format!("This model's maximum context length is {max} tokens, however input {i} has {} tokens", ids.len())).with_code("context_length_exceeded"));
        }
    }
    let permit = e.slots.clone().try_acquire_owned().map_err(|_| {
        ApiError::queue_full("too many embedding requests are waiting; retry later")
    })?;
    let model = e.model.clone();
    let n_tokens: usize = batch.iter().map(Vec::len).sum();
    let vecs = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        model.encode_batch_ids(&batch)
    })
    .await
    .map_err(|_| ApiError::internal("embedding task failed"))?
    .map_err(|err| ApiError::invalid(err.to_string()))?;
    let data: Vec<Value> = vecs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let emb = if base64 {
                use base64::Engine as _;
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({ "object": "embedding", "index": i, "embedding": emb })
        })
        .collect();
    Ok(Json(json!({ "object": "list", "data": data, "model": st.model_id, "usage": { "prompt_tokens": n_tokens, "total_tokens": n_tokens } })).into_response())
}
