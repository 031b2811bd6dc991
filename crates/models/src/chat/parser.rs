//! Incremental parsing of generated text into answer text, thinking and tool calls.
//!
//! [`OutputParser`] is fed text deltas (from [`super::StreamDecoder`]) and returns
//! [`ChatEvent`]s. Markers may be split across deltas at any byte: text that could be the start
//! of a marker is held back until it is decided. Feeding the same text in any split gives the
//! same events once concatenated, and the same [`ParsedOutput`].
//!
//! Whitespace: a thinking block is trimmed at both ends; the answer loses leading whitespace and
//! trailing whitespace at the end of the output or before a tool call (held whitespace is emitted
//! as soon as more answer text follows).
use serde_json::Value as Json;

use super::message::{ChatMessage, Role, ToolCall};

/// Markers of a thinking block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkTags {
    pub start: &'static str,
    pub end: &'static str,
}

/// Qwen3 / DeepSeek-R1 style `<think>…</think>`.
pub const THINK_TAGS: ThinkTags = ThinkTags { start: "<think>", end: "</think>" };

/// Gemma 4's thought channel: `<|channel>thought\n…<channel|>`.
pub const GEMMA4_THINK_TAGS: ThinkTags = ThinkTags { start: "<|channel>thought", end: "<channel|>" };

/// How the body between the tool-call markers is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallSyntax {
    /// One JSON object `{"name": "...", "arguments": {...}}` (Hermes / Qwen). `arguments` may
    /// also be a JSON-encoded string, or be called `parameters`.
    JsonObject,
    /// A Python-style list of calls `[name(key=value, ...), ...]` with Python literal values
    /// (LFM2).
    PythonicList,
    /// Gemma 4's native calls: `call:NAME{key:value,...}` with strings between `<|"|>` markers,
    /// nested `{...}` objects and `[...]` arrays, bare numbers, booleans and null.
    GemmaCall,
    /// XML-style functions (Qwen3.5, Qwen3-Coder):
    /// `<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>`. A value that
    /// parses as JSON (numbers, booleans, objects, arrays, null) is taken as such, anything else
    /// as a string.
    XmlFunction,
}

/// A tool-call format: markers plus body syntax. Add Gemma / LFM2 formats as new rows of
/// [`TOOL_CALL_FORMATS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolCallFormat {
    pub name: &'static str,
    pub start: &'static str,
    pub end: &'static str,
    pub syntax: ToolCallSyntax,
}

/// Qwen3 (Hermes) format: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`.
pub const QWEN3_TOOL_CALLS: ToolCallFormat =
    ToolCallFormat { name: "qwen3", start: "<tool_call>", end: "</tool_call>", syntax: ToolCallSyntax::JsonObject };

/// Qwen3.5 format: `<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>`.
pub const QWEN3_5_TOOL_CALLS: ToolCallFormat =
    ToolCallFormat { name: "qwen3_5", start: "<tool_call>", end: "</tool_call>", syntax: ToolCallSyntax::XmlFunction };

/// Gemma 4 format: `<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>`.
pub const GEMMA4_TOOL_CALLS: ToolCallFormat =
    ToolCallFormat { name: "gemma4", start: "<|tool_call>", end: "<tool_call|>", syntax: ToolCallSyntax::GemmaCall };

/// LFM2 format: `<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>`.
pub const LFM2_TOOL_CALLS: ToolCallFormat = ToolCallFormat {
    name: "lfm2",
    start: "<|tool_call_start|>",
    end: "<|tool_call_end|>",
    syntax: ToolCallSyntax::PythonicList,
};

/// Known formats, tried in order by [`ToolCallFormat::detect`].
pub const TOOL_CALL_FORMATS: &[ToolCallFormat] = &[GEMMA4_TOOL_CALLS, LFM2_TOOL_CALLS, QWEN3_5_TOOL_CALLS, QWEN3_TOOL_CALLS];

impl ToolCallFormat {
    /// The format the chat template writes, if any: its start marker, and for the XML syntax
    /// also `<function=` (Qwen3's JSON body shares the markers).
    pub fn detect(template_source: &str) -> Option<ToolCallFormat> {
        TOOL_CALL_FORMATS.iter().copied().find(|f| {
            template_source.contains(f.start) && (f.syntax != ToolCallSyntax::XmlFunction || template_source.contains("<function="))
        })
    }
}

/// Whether a tool call could be parsed.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolCallStatus {
    Ok,
    /// The body was not a valid call; `reason` says why, the raw text is in
    /// [`ParsedToolCall::raw`].
    Malformed { reason: String },
}

/// A tool call found in the output.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedToolCall {
    /// Generated id (`<prefix><n>`), for the tool result's `tool_call_id`.
    pub id: String,
    /// Function name ("" when malformed and no name could be found).
    pub name: String,
    /// Parsed arguments (an object; `Null` when malformed).
    pub arguments: Json,
    pub status: ToolCallStatus,
    /// The text between the markers, as generated.
    pub raw: String,
}

impl ParsedToolCall {
    pub fn is_ok(&self) -> bool {
        self.status == ToolCallStatus::Ok
    }
    /// The history form of this call.
    pub fn to_tool_call(&self) -> ToolCall {
        ToolCall {
            id: Some(self.id.clone()),
            name: self.name.clone(),
            arguments: if self.is_ok() { self.arguments.clone() } else { Json::String(self.raw.clone()) },
        }
    }
}

/// What the parser reports, in output order.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatEvent {
    TextDelta(String),
    ThinkingDelta(String),
    ToolCall(ParsedToolCall),
}

/// Options of an [`OutputParser`].
#[derive(Debug, Clone)]
pub struct ParserOptions {
    /// Thinking markers; `None` for models without thinking.
    pub think: Option<ThinkTags>,
    /// Tool-call format; `None` for no tool-call parsing.
    pub tool_calls: Option<ToolCallFormat>,
    /// The prompt already opened a think block, so the output starts inside it.
    pub starts_in_thinking: bool,
    /// Report thinking (`false` drops `ThinkingDelta`s and `ParsedOutput::thinking`).
    pub include_reasoning: bool,
    /// Prefix of the generated tool-call ids.
    pub call_id_prefix: String,
}

impl Default for ParserOptions {
    fn default() -> Self {
        ParserOptions {
            think: Some(THINK_TAGS),
            tool_calls: Some(QWEN3_TOOL_CALLS),
            starts_in_thinking: false,
            include_reasoning: true,
            call_id_prefix: "call_".into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Text,
    Thinking,
    Tool,
}

/// The accumulated result of a whole output.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParsedOutput {
    /// Answer text, markers and thinking removed.
    pub text: String,
    /// Thinking text (None when there was none or reasoning is not included).
    pub thinking: Option<String>,
    pub tool_calls: Vec<ParsedToolCall>,
    /// The output as given to the parser.
    pub raw_text: String,
}

impl ParsedOutput {
    /// Build from events (what a streaming consumer collects).
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a ChatEvent>) -> Self {
        let mut out = ParsedOutput::default();
        out.absorb(events);
        out
    }

    fn absorb<'a>(&mut self, events: impl IntoIterator<Item = &'a ChatEvent>) {
        for e in events {
            match e {
                ChatEvent::TextDelta(t) => self.text.push_str(t),
                ChatEvent::ThinkingDelta(t) => self.thinking.get_or_insert_with(String::new).push_str(t),
                ChatEvent::ToolCall(c) => self.tool_calls.push(c.clone()),
            }
        }
    }

    /// The assistant message to append to the history for the next turn. Only well-formed tool
    /// calls go in: a malformed one stays in [`ParsedOutput::tool_calls`] with its status and
    /// raw text for the caller, but no chat template can render a call without a name, so the
    /// history leaves it out (the next turn must not fail on what the model wrote).
    pub fn to_assistant_message(&self) -> ChatMessage {
        let calls: Vec<ToolCall> = self.tool_calls.iter().filter(|c| c.is_ok()).map(ParsedToolCall::to_tool_call).collect();
        ChatMessage {
            role: Role::Assistant,
            content: self.text.clone(),
            reasoning_content: self.thinking.clone(),
            tool_calls: if calls.is_empty() { None } else { Some(calls) },
            tool_call_id: None,
            is_error: None,
            images: Vec::new(),
            audio: Vec::new(),
        }
    }
}

/// Incremental output parser. See the module docs.
#[derive(Debug, Clone)]
pub struct OutputParser {
    opts: ParserOptions,
    mode: Mode,
    /// Text not yet decided (a possible marker prefix).
    pending: String,
    /// Whitespace held back in the current text/thinking segment.
    held_ws: String,
    /// Nothing emitted yet in the current segment (leading whitespace is dropped).
    at_segment_start: bool,
    /// Any answer text emitted yet (leading whitespace of the answer is dropped).
    text_started: bool,
    tool_body: String,
    n_calls: usize,
    raw: String,
    result: ParsedOutput,
}

impl OutputParser {
    pub fn new(opts: ParserOptions) -> Self {
        let mode = if opts.starts_in_thinking && opts.think.is_some() { Mode::Thinking } else { Mode::Text };
        OutputParser {
            opts,
            mode,
            pending: String::new(),
            held_ws: String::new(),
            at_segment_start: true,
            text_started: false,
            tool_body: String::new(),
            n_calls: 0,
            raw: String::new(),
            result: ParsedOutput::default(),
        }
    }

    /// Whether the parser is inside a thinking block right now.
    pub fn in_thinking(&self) -> bool {
        self.mode == Mode::Thinking
    }

    /// Feed a text delta; returns the events it decides.
    pub fn push(&mut self, delta: &str) -> Vec<ChatEvent> {
        self.raw.push_str(delta);
        self.pending.push_str(delta);
        let mut events = Vec::new();
        self.drain(false, &mut events);
        self.result.absorb(&events);
        events
    }

    /// End of output: flush what is held back. An unterminated thinking block counts as
    /// thinking; an unterminated tool call is parsed as it stands (malformed if it does not parse).
    pub fn finish(&mut self) -> Vec<ChatEvent> {
        let mut events = Vec::new();
        self.drain(true, &mut events);
        if self.mode == Mode::Tool {
            let body = std::mem::take(&mut self.tool_body);
            events.extend(self.make_calls(body, false).into_iter().map(ChatEvent::ToolCall));
            self.mode = Mode::Text;
        }
        self.held_ws.clear();
        self.result.absorb(&events);
        events
    }

    /// The result so far (complete after [`OutputParser::finish`]).
    pub fn output(&self) -> ParsedOutput {
        let mut out = self.result.clone();
        out.raw_text = self.raw.clone();
        out
    }

    /// Parse a whole output at once.
    pub fn parse_all(opts: ParserOptions, text: &str) -> ParsedOutput {
        let mut p = OutputParser::new(opts);
        p.push(text);
        p.finish();
        p.output()
    }

    /// Markers that end or switch the current mode.
    fn markers(&self) -> Vec<&'static str> {
        let mut m = Vec::new();
        match self.mode {
            Mode::Text => {
                if let Some(t) = self.opts.think {
                    m.push(t.start);
                    m.push(t.end); // a stray end marker is dropped
                }
                if let Some(f) = self.opts.tool_calls {
                    m.push(f.start);
                }
            }
            Mode::Thinking => m.push(self.opts.think.expect("thinking mode needs think tags").end),
            Mode::Tool => m.push(self.opts.tool_calls.expect("tool mode needs a format").end),
        }
        m
    }

    fn drain(&mut self, at_end: bool, events: &mut Vec<ChatEvent>) {
        loop {
            let markers = self.markers();
            // Earliest marker occurrence (longest marker first at the same position).
            let found = markers
                .iter()
                .filter_map(|m| self.pending.find(m).map(|i| (i, *m)))
                .min_by(|a, b| a.0.cmp(&b.0).then(b.1.len().cmp(&a.1.len())));
            match found {
                Some((i, marker)) => {
                    let before: String = self.pending[..i].to_owned();
                    self.pending.drain(..i + marker.len());
                    self.content(&before, events);
                    self.on_marker(marker, events);
                }
                None => {
                    // Keep the longest suffix that could begin a marker.
                    let keep = if at_end { 0 } else { partial_marker_suffix(&self.pending, &markers) };
                    let cut = self.pending.len() - keep;
                    let ready: String = self.pending[..cut].to_owned();
                    self.pending.drain(..cut);
                    self.content(&ready, events);
                    return;
                }
            }
        }
    }

    /// Text inside the current mode.
    fn content(&mut self, s: &str, events: &mut Vec<ChatEvent>) {
        if s.is_empty() {
            return;
        }
        match self.mode {
            Mode::Tool => self.tool_body.push_str(s),
            Mode::Text | Mode::Thinking => {
                let mut s = s;
                let drop_leading = match self.mode {
                    Mode::Thinking => self.at_segment_start,
                    _ => !self.text_started,
                };
                if drop_leading {
                    s = s.trim_start();
                    if s.is_empty() {
                        return;
                    }
                }
                let body = s.trim_end();
                let trailing = &s[body.len()..];
                if !body.is_empty() {
                    let mut out = std::mem::take(&mut self.held_ws);
                    out.push_str(body);
                    self.at_segment_start = false;
                    if self.mode == Mode::Thinking {
                        if self.opts.include_reasoning {
                            events.push(ChatEvent::ThinkingDelta(out));
                        }
                    } else {
                        self.text_started = true;
                        events.push(ChatEvent::TextDelta(out));
                    }
                }
                self.held_ws.push_str(trailing);
            }
        }
    }

    fn on_marker(&mut self, marker: &str, events: &mut Vec<ChatEvent>) {
        let think = self.opts.think;
        let tools = self.opts.tool_calls;
        match self.mode {
            Mode::Text if think.is_some_and(|t| t.start == marker) => {
                self.held_ws.clear();
                self.mode = Mode::Thinking;
                self.at_segment_start = true;
            }
            Mode::Text if tools.is_some_and(|f| f.start == marker) => {
                // Whitespace before a call stays held: it is emitted only if more text follows.
                self.mode = Mode::Tool;
                self.tool_body.clear();
            }
            Mode::Text => {} // stray think end marker: dropped
            Mode::Thinking => {
                self.held_ws.clear();
                self.mode = Mode::Text;
            }
            Mode::Tool => {
                let body = std::mem::take(&mut self.tool_body);
                events.extend(self.make_calls(body, true).into_iter().map(ChatEvent::ToolCall));
                self.mode = Mode::Text;
            }
        }
    }

    /// The calls of one tool-call block (a pythonic list may hold several; a malformed block is
    /// one malformed call).
    fn make_calls(&mut self, raw: String, terminated: bool) -> Vec<ParsedToolCall> {
        let syntax = self.opts.tool_calls.map(|f| f.syntax).unwrap_or(ToolCallSyntax::JsonObject);
        let parsed: Vec<CallParse> = match syntax {
            ToolCallSyntax::JsonObject => vec![parse_json_call(raw.trim())],
            ToolCallSyntax::PythonicList => match pythonic::parse_calls(raw.trim()) {
                Ok(calls) => calls.into_iter().map(Ok).collect(),
                Err(reason) => vec![Err((None, reason))],
            },
            ToolCallSyntax::XmlFunction => parse_xml_calls(&raw),
            ToolCallSyntax::GemmaCall => vec![gemma_call::parse(raw.trim())],
        };
        parsed
            .into_iter()
            .map(|p| {
                let id = format!("{}{}", self.opts.call_id_prefix, self.n_calls);
                self.n_calls += 1;
                let raw = raw.clone();
                match p {
                    Ok((name, arguments)) => ParsedToolCall { id, name, arguments, status: ToolCallStatus::Ok, raw },
                    Err((name, reason)) => {
                        let reason = if terminated { reason } else { format!("unterminated tool call: {reason}") };
                        ParsedToolCall { id, name: name.unwrap_or_default(), arguments: Json::Null, status: ToolCallStatus::Malformed { reason }, raw }
                    }
                }
            })
            .collect()
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of one of `markers`.
fn partial_marker_suffix(s: &str, markers: &[&str]) -> usize {
    let mut best = 0;
    for m in markers {
        let max = (m.len() - 1).min(s.len());
        for k in (best + 1..=max).rev() {
            if s.is_char_boundary(s.len() - k) && m.as_bytes().starts_with(&s.as_bytes()[s.len() - k..]) {
                best = k;
                break;
            }
        }
    }
    best
}

type CallParse = std::result::Result<(String, Json), (Option<String>, String)>;

/// The `<function=NAME>...</function>` blocks of one tool-call body (see
/// [`ToolCallSyntax::XmlFunction`]); a body without one is one malformed call.
fn parse_xml_calls(body: &str) -> Vec<CallParse> {
    const FN: &str = "<function=";
    const FN_END: &str = "</function>";
    const P: &str = "<parameter=";
    const P_END: &str = "</parameter>";
    // One newline on each side of a value belongs to the format, not to the value.
    let strip = |v: &str| -> String {
        let v = v.strip_prefix('\n').unwrap_or(v);
        v.strip_suffix('\n').unwrap_or(v).to_owned()
    };
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(i) = rest.find(FN) {
        rest = &rest[i + FN.len()..];
        let Some(gt) = rest.find('>') else {
            calls.push(Err((None, "unterminated <function= tag".into())));
            return calls;
        };
        let name = rest[..gt].trim().to_owned();
        rest = &rest[gt + 1..];
        let (inner, after) = match rest.find(FN_END) {
            Some(e) => (&rest[..e], &rest[e + FN_END.len()..]),
            None => (rest, ""),
        };
        let closed = rest.contains(FN_END);
        rest = after;
        if name.is_empty() {
            calls.push(Err((None, "empty function name".into())));
            continue;
        }
        if !closed {
            calls.push(Err((Some(name), "missing </function>".into())));
            continue;
        }
        let mut args = serde_json::Map::new();
        let mut p = inner;
        let mut err = None;
        while let Some(j) = p.find(P) {
            p = &p[j + P.len()..];
            let Some(gt) = p.find('>') else {
                err = Some("unterminated <parameter= tag".to_string());
                break;
            };
            let key = p[..gt].trim().to_owned();
            p = &p[gt + 1..];
            let Some(e) = p.find(P_END) else {
                err = Some(format!("parameter {key:?} has no </parameter>"));
                break;
            };
            let value = strip(&p[..e]);
            p = &p[e + P_END.len()..];
            if key.is_empty() {
                err = Some("empty parameter name".into());
                break;
            }
            let v = match serde_json::from_str::<Json>(value.trim()) {
                Ok(v) if !value.trim().is_empty() => v,
                _ => Json::String(value),
            };
            args.insert(key, v);
        }
        calls.push(match err {
            Some(reason) => Err((Some(name), reason)),
            None => Ok((name, Json::Object(args))),
        });
    }
    if calls.is_empty() {
        calls.push(Err((None, "expected <function=NAME>...</function>".into())));
    }
    calls
}

/// `{"name": "...", "arguments": {...}}`; `arguments` may be a JSON string holding an object,
/// or be named `parameters`; missing arguments are `{}`.
fn parse_json_call(body: &str) -> CallParse {
    let v: Json = match serde_json::from_str(body) {
        Ok(v) => v,
        Err(e) => {
            // Best effort name for the report.
            let name = regex::Regex::new(r#""name"\s*:\s*"([^"\\]*)""#)
                .expect("static regex")
                .captures(body)
                .map(|c| c[1].to_owned());
            return Err((name, format!("invalid JSON: {e}")));
        }
    };
    let Some(obj) = v.as_object() else {
        return Err((None, format!("expected a JSON object, got {}", kind(&v))));
    };
    let name = match obj.get("name") {
        Some(Json::String(s)) if !s.trim().is_empty() => s.clone(),
        Some(Json::String(_)) => return Err((None, "empty \"name\"".into())),
        Some(other) => return Err((None, format!("\"name\" must be a string, got {}", kind(other)))),
        None => return Err((None, "missing \"name\"".into())),
    };
    let args = obj.get("arguments").or_else(|| obj.get("parameters")).cloned().unwrap_or(Json::Object(Default::default()));
    let args = match args {
        Json::String(s) => match serde_json::from_str::<Json>(&s) {
            Ok(v @ Json::Object(_)) => v,
            Ok(v) => return Err((Some(name), format!("\"arguments\" must be an object, got {}", kind(&v)))),
            Err(e) => return Err((Some(name), format!("\"arguments\" string is not valid JSON: {e}"))),
        },
        v @ Json::Object(_) => v,
        Json::Null => Json::Object(Default::default()),
        other => return Err((Some(name), format!("\"arguments\" must be an object, got {}", kind(&other)))),
    };
    Ok((name, args))
}

fn kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// Python call-list syntax: `[f(a=1, b="x"), g()]` with literal values (strings, numbers,
/// True/False/None, lists, tuples, dicts).
mod pythonic {
    use serde_json::{Map, Number, Value as Json};

    struct P<'a> {
        s: &'a [u8],
        src: &'a str,
        i: usize,
    }

    pub(super) fn parse_calls(src: &str) -> Result<Vec<(String, Json)>, String> {
        let mut p = P { s: src.as_bytes(), src, i: 0 };
        p.ws();
        let bracketed = p.eat(b'[');
        let mut calls = Vec::new();
        loop {
            p.ws();
            if bracketed && p.eat(b']') {
                break;
            }
            calls.push(p.call()?);
            p.ws();
            if p.eat(b',') {
                continue;
            }
            if bracketed {
                p.ws();
                if !p.eat(b']') {
                    return Err(p.err("expected ',' or ']'"));
                }
            }
            break;
        }
        p.ws();
        if p.i != p.s.len() {
            return Err(p.err("unexpected text after the calls"));
        }
        if calls.is_empty() {
            return Err("no call in the list".into());
        }
        Ok(calls)
    }

    impl<'a> P<'a> {
        fn err(&self, what: &str) -> String {
            format!("invalid call syntax at byte {}: {what}", self.i)
        }
        fn ws(&mut self) {
            while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
                self.i += 1;
            }
        }
        fn eat(&mut self, c: u8) -> bool {
            if self.s.get(self.i) == Some(&c) {
                self.i += 1;
                true
            } else {
                false
            }
        }
        fn ident(&mut self) -> Option<String> {
            let start = self.i;
            while self.i < self.s.len() && (self.s[self.i].is_ascii_alphanumeric() || matches!(self.s[self.i], b'_' | b'.' | b'-')) {
                self.i += 1;
            }
            (self.i > start).then(|| self.src[start..self.i].to_owned())
        }
        fn call(&mut self) -> Result<(String, Json), String> {
            let name = self.ident().ok_or_else(|| self.err("expected a function name"))?;
            self.ws();
            if !self.eat(b'(') {
                return Err(self.err("expected '('"));
            }
            let mut args = Map::new();
            self.list(b')', "')'", |p| {
                let key = p.ident().ok_or_else(|| p.err("expected a keyword argument name"))?;
                p.ws();
                if !p.eat(b'=') {
                    return Err(p.err("expected '=' (only keyword arguments are supported)"));
                }
                p.ws();
                args.insert(key, p.value()?);
                Ok(())
            })?;
            Ok((name, Json::Object(args)))
        }
        /// Comma-separated items up to `close` (`what` in errors), each read by `item`.
        fn list(&mut self, close: u8, what: &str, mut item: impl FnMut(&mut Self) -> Result<(), String>) -> Result<(), String> {
            loop {
                self.ws();
                if self.eat(close) {
                    return Ok(());
                }
                item(self)?;
                self.ws();
                if !self.eat(b',') {
                    self.ws();
                    return if self.eat(close) { Ok(()) } else { Err(self.err(&format!("expected ',' or {what}"))) };
                }
            }
        }
        fn value(&mut self) -> Result<Json, String> {
            self.ws();
            match self.s.get(self.i) {
                None => Err(self.err("expected a value")),
                Some(b'"') | Some(b'\'') => self.string().map(Json::String),
                Some(b'[') | Some(b'(') => {
                    let close = if self.s[self.i] == b'[' { b']' } else { b')' };
                    self.i += 1;
                    let mut items = Vec::new();
                    self.list(close, "the closing bracket", |p| {
                        items.push(p.value()?);
                        Ok(())
                    })?;
                    Ok(Json::Array(items))
                }
                Some(b'{') => {
                    self.i += 1;
                    let mut m = Map::new();
                    self.list(b'}', "'}'", |p| {
                        let k = match p.value()? {
                            Json::String(s) => s,
                            other => other.to_string(),
                        };
                        p.ws();
                        if !p.eat(b':') {
                            return Err(p.err("expected ':'"));
                        }
                        m.insert(k, p.value()?);
                        Ok(())
                    })?;
                    Ok(Json::Object(m))
                }
                Some(_) => {
                    let start = self.i;
                    while self.i < self.s.len() && (self.s[self.i].is_ascii_alphanumeric() || matches!(self.s[self.i], b'_' | b'.' | b'-' | b'+')) {
                        self.i += 1;
                    }
                    let word = &self.src[start..self.i];
                    match word {
                        "True" | "true" => Ok(Json::Bool(true)),
                        "False" | "false" => Ok(Json::Bool(false)),
                        "None" | "null" => Ok(Json::Null),
                        _ => {
                            if let Ok(n) = word.parse::<i64>() {
                                Ok(Json::Number(n.into()))
                            } else if let Some(n) = word.parse::<f64>().ok().and_then(Number::from_f64) {
                                Ok(Json::Number(n))
                            } else {
                                self.i = start;
                                Err(self.err("expected a literal value"))
                            }
                        }
                    }
                }
            }
        }
        fn string(&mut self) -> Result<String, String> {
            let q = self.s[self.i];
            self.i += 1;
            let mut out = String::new();
            loop {
                let rest = &self.src[self.i..];
                let mut chars = rest.chars();
                let Some(c) = chars.next() else { return Err(self.err("unterminated string")) };
                self.i += c.len_utf8();
                if c as u32 == q as u32 {
                    return Ok(out);
                }
                if c != '\\' {
                    out.push(c);
                    continue;
                }
                let Some(e) = self.src[self.i..].chars().next() else { return Err(self.err("unterminated string")) };
                self.i += e.len_utf8();
                match e {
                    'n' => out.push('\n'),
                    't' => out.push('\t'),
                    'r' => out.push('\r'),
                    '0' => out.push('\0'),
                    'u' => {
                        let hex = self.src.get(self.i..self.i + 4).ok_or_else(|| self.err("bad \\u escape"))?;
                        let c = u32::from_str_radix(hex, 16).ok().and_then(char::from_u32).ok_or_else(|| self.err("bad \\u escape"))?;
                        self.i += 4;
                        out.push(c);
                    }
                    other => out.push(other),
                }
            }
        }
    }
}

/// Gemma 4's `call:NAME{...}` bodies.
mod gemma_call {
    use super::CallParse;
    use serde_json::{Map, Value as Json};

    const QUOTE: &str = "<|\"|>";

    pub(super) fn parse(body: &str) -> CallParse {
        let Some(rest) = body.strip_prefix("call:") else {
            return Err((None, "expected call:NAME{...}".into()));
        };
        let Some(brace) = rest.find('{') else {
            let name = rest.trim();
            return Err(((!name.is_empty()).then(|| name.to_owned()), "missing {arguments}".into()));
        };
        let name = rest[..brace].trim().to_owned();
        if name.is_empty() {
            return Err((None, "empty function name".into()));
        }
        let mut p = P { s: &rest[brace..] };
        match p.object() {
            Ok(args) if p.s.trim().is_empty() => Ok((name, args)),
            Ok(_) => Err((Some(name), format!("unexpected text after the arguments: {:?}", p.s.trim()))),
            Err(e) => Err((Some(name), e)),
        }
    }

    struct P<'a> {
        s: &'a str,
    }

    impl P<'_> {
        fn ws(&mut self) {
            self.s = self.s.trim_start();
        }
        fn eat(&mut self, c: char) -> bool {
            self.ws();
            match self.s.strip_prefix(c) {
                Some(r) => {
                    self.s = r;
                    true
                }
                None => false,
            }
        }
        fn object(&mut self) -> Result<Json, String> {
            if !self.eat('{') {
                return Err("expected {".into());
            }
            let mut m = Map::new();
            if self.eat('}') {
                return Ok(Json::Object(m));
            }
            loop {
                self.ws();
                let key = match self.s.strip_prefix(QUOTE) {
                    Some(r) => {
                        let end = r.find(QUOTE).ok_or("unterminated <|\"|> string key")?;
                        let k = r[..end].to_owned();
                        self.s = &r[end + QUOTE.len()..];
                        k
                    }
                    None => {
                        let end = self.s.find(':').ok_or("expected key:value")?;
                        let k = self.s[..end].trim().to_owned();
                        self.s = &self.s[end..];
                        k
                    }
                };
                if key.is_empty() || key.contains(['{', '}', ',', '[', ']']) {
                    return Err(format!("bad key {key:?}"));
                }
                if !self.eat(':') {
                    return Err(format!("expected : after {key:?}"));
                }
                let v = self.value()?;
                m.insert(key, v);
                if self.eat(',') {
                    continue;
                }
                if self.eat('}') {
                    return Ok(Json::Object(m));
                }
                return Err("expected , or }".into());
            }
        }
        fn value(&mut self) -> Result<Json, String> {
            self.ws();
            if let Some(r) = self.s.strip_prefix(QUOTE) {
                let end = r.find(QUOTE).ok_or("unterminated <|\"|> string")?;
                let v = Json::String(r[..end].to_owned());
                self.s = &r[end + QUOTE.len()..];
                return Ok(v);
            }
            if self.s.starts_with('{') {
                return self.object();
            }
            if self.eat('[') {
                let mut a = Vec::new();
                if self.eat(']') {
                    return Ok(Json::Array(a));
                }
                loop {
                    a.push(self.value()?);
                    if self.eat(',') {
                        continue;
                    }
                    if self.eat(']') {
                        return Ok(Json::Array(a));
                    }
                    return Err("expected , or ]".into());
                }
            }
            // a bare token: number, true/false/null, else text
            let end = self.s.find([',', '}', ']']).unwrap_or(self.s.len());
            let tok = self.s[..end].trim();
            self.s = &self.s[end..];
            if tok.is_empty() {
                return Err("missing value".into());
            }
            Ok(match serde_json::from_str::<Json>(tok) {
                Ok(v @ (Json::Number(_) | Json::Bool(_) | Json::Null)) => v,
                _ => Json::String(tok.to_owned()),
            })
        }
    }
}
