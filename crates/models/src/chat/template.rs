//! The checkpoint's Jinja chat template, rendered with minijinja the way Hugging Face
//! `apply_chat_template` renders it.
//!
//! HF compatibility: `trim_blocks` and `lstrip_blocks` on, loop controls, `tojson` with Python's
//! `json.dumps` spacing (`", "`, `": "`) and `ensure_ascii=False`, `raise_exception(msg)`,
//! `strftime_now(fmt)`, Python string/dict methods (`startswith`, `split`, `strip`, `items`, ...)
//! through minijinja-contrib's pycompat, and the `{% generation %}` tags of assistant-mask
//! templates (ignored). The context holds `messages`, `tools` (none when not given),
//! `documents` (none), `add_generation_prompt`, the special-token strings (`bos_token`, `eos_token`, ...),
//! `enable_thinking` and `reasoning_effort` when set, and any extra variables.
use std::collections::HashSet;
use std::path::Path;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde_json::Value as Json;

use super::error::{ChatError, Result};
use super::message::{ChatMessage, ToolDefinition};
use super::tokenizer::{read_json, SpecialTokens};

/// How much the model should think. `None` and `Low` close the think block before the answer;
/// `None` also drops reasoning from the output by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReasoningEffort {
    None,
    Low,
    Medium,
    High,
}

impl ReasoningEffort {
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::None => "none",
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }
    /// Whether this effort lets the model think.
    pub fn thinks(self) -> bool {
        matches!(self, ReasoningEffort::Medium | ReasoningEffort::High)
    }
}

impl std::str::FromStr for ReasoningEffort {
    type Err = ChatError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(ReasoningEffort::None),
            "low" => Ok(ReasoningEffort::Low),
            "medium" => Ok(ReasoningEffort::Medium),
            "high" => Ok(ReasoningEffort::High),
            other => Err(ChatError::InvalidReasoningEffort(other.to_owned())),
        }
    }
}

/// What to render.
#[derive(Debug, Clone)]
pub struct RenderOptions {
    /// Append the assistant header so the model answers (default true).
    pub add_generation_prompt: bool,
    /// Tools the model may call; `None` (or empty) leaves `tools` undefined in the template.
    pub tools: Option<Vec<ToolDefinition>>,
    /// Explicit thinking switch; when `None` it follows `reasoning_effort` (thinking on by default).
    pub enable_thinking: Option<bool>,
    pub reasoning_effort: Option<ReasoningEffort>,
    /// Pick a named template of a list-of-templates config (default: "tool_use" when tools are
    /// given and the checkpoint has one, else "default").
    pub template_name: Option<String>,
    /// More template variables (HF `**kwargs`).
    pub extra: serde_json::Map<String, Json>,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions { add_generation_prompt: true, tools: None, enable_thinking: None, reasoning_effort: None, template_name: None, extra: Default::default() }
    }
}

impl RenderOptions {
    /// Whether the model is allowed to think: `enable_thinking` if set, else false for reasoning
    /// effort "none"/"low", else true.
    pub fn thinking_enabled(&self) -> bool {
        self.enable_thinking.unwrap_or_else(|| self.reasoning_effort.is_none_or(ReasoningEffort::thinks))
    }
    /// Default of `include_reasoning`: false only for reasoning effort "none".
    pub fn include_reasoning_default(&self) -> bool {
        self.reasoning_effort != Some(ReasoningEffort::None)
    }
    /// The template variable `enable_thinking`: passed when either knob is set.
    fn enable_thinking_var(&self) -> Option<bool> {
        if self.enable_thinking.is_some() || self.reasoning_effort.is_some() {
            Some(self.thinking_enabled())
        } else {
            None
        }
    }
}

/// Error source that marks a `raise_exception` call.
#[derive(Debug)]
struct Raised(String);
impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Raised {}

struct Entry {
    name: String,
    source: String,
    /// Variables the template reads (to know whether it handles `enable_thinking` itself).
    variables: HashSet<String>,
}

/// A compiled chat template (one or several named ones). `Send + Sync`.
pub struct ChatTemplate {
    env: Environment<'static>,
    entries: Vec<Entry>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("names", &self.names()).finish()
    }
}

/// Remove `{% generation %}` / `{% endgeneration %}` (HF's assistant-mask extension), which
/// render nothing.
fn strip_generation_tags(src: &str) -> String {
    let re = regex::Regex::new(r"\{%-?\s*(?:end)?generation\s*-?%\}").expect("static regex");
    re.replace_all(src, "").into_owned()
}

impl ChatTemplate {
    /// One unnamed template ("default").
    pub fn from_source(source: &str) -> Result<Self> {
        Self::from_named(vec![("default".to_owned(), source.to_owned())])
    }

    /// Several named templates (tokenizer_config.json's list form).
    pub fn from_named(templates: Vec<(String, String)>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, "raise_exception").with_source(Raised(msg)))
        });
        env.add_function("strftime_now", |fmt: String| -> std::result::Result<Value, JinjaError> {
            let now = jiff::Zoned::now();
            jiff::fmt::strtime::format(fmt.as_str(), &now)
                .map(Value::from)
                .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("strftime_now({fmt:?}): {e}")))
        });
        let mut entries = Vec::new();
        for (name, source) in templates {
            let source = strip_generation_tags(&source);
            env.add_template_owned(name.clone(), source.clone()).map_err(|e| ChatError::TemplateSyntax(describe(&e)))?;
            let variables = env.get_template(&name).map_err(|e| ChatError::TemplateSyntax(describe(&e)))?.undeclared_variables(false);
            entries.push(Entry { name, source, variables });
        }
        Ok(ChatTemplate { env, entries })
    }

    /// Find the checkpoint's template: `chat_template.jinja`, else tokenizer_config.json
    /// `chat_template` (a string or a list of `{name, template}`), else `chat_template.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let jinja = dir.join("chat_template.jinja");
        match std::fs::read_to_string(&jinja) {
            Ok(s) => return Self::from_source(&s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ChatError::io(&jinja, e)),
        }
        let cfg_path = dir.join("tokenizer_config.json");
        if let Some(cfg) = read_json(&cfg_path)? {
            if let Some(t) = Self::from_config_value(cfg.get("chat_template"), &cfg_path)? {
                return Ok(t);
            }
        }
        let json_path = dir.join("chat_template.json");
        if let Some(cfg) = read_json(&json_path)? {
            if let Some(t) = Self::from_config_value(cfg.get("chat_template"), &json_path)? {
                return Ok(t);
            }
        }
        Err(ChatError::NoChatTemplate(dir.to_path_buf()))
    }

    /// From the value of a `chat_template` key (string, list of named templates, or null).
    pub fn from_config_value(value: Option<&Json>, origin: &Path) -> Result<Option<Self>> {
        match value {
            None | Some(Json::Null) => Ok(None),
            Some(Json::String(s)) => Self::from_source(s).map(Some),
            Some(Json::Array(list)) => {
                let mut named = Vec::new();
                for item in list {
                    let name = item.get("name").and_then(Json::as_str);
                    let tpl = item.get("template").and_then(Json::as_str);
                    match (name, tpl) {
                        (Some(n), Some(t)) => named.push((n.to_owned(), t.to_owned())),
                        _ => return Err(ChatError::malformed(origin, "\"chat_template\" list entries need \"name\" and \"template\" strings")),
                    }
                }
                if named.is_empty() {
                    return Ok(None);
                }
                Self::from_named(named).map(Some)
            }
            Some(other) => Err(ChatError::malformed(origin, format!("\"chat_template\" must be a string or a list, got {other}"))),
        }
    }

    pub fn names(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.name.as_str()).collect()
    }

    fn entry(&self, opts: &RenderOptions) -> Result<&Entry> {
        let find = |n: &str| self.entries.iter().find(|e| e.name == n);
        if let Some(n) = &opts.template_name {
            return find(n).ok_or_else(|| ChatError::TemplateNotFound { name: n.clone(), available: self.names().join(", ") });
        }
        let has_tools = opts.tools.as_ref().is_some_and(|t| !t.is_empty());
        Ok((if has_tools { find("tool_use") } else { None })
            .or_else(|| find("default"))
            .unwrap_or(&self.entries[0]))
    }

    /// The source of the template `opts` selects.
    pub fn source(&self, opts: &RenderOptions) -> Result<&str> {
        Ok(&self.entry(opts)?.source)
    }

    /// Whether the selected template reads `enable_thinking` (then it handles the no-think path).
    pub fn handles_enable_thinking(&self, opts: &RenderOptions) -> Result<bool> {
        Ok(self.entry(opts)?.variables.contains("enable_thinking"))
    }

    /// Render `messages` to prompt text, exactly as HF `apply_chat_template(tokenize=False)`.
    pub fn render(&self, messages: &[ChatMessage], special: &SpecialTokens, opts: &RenderOptions) -> Result<String> {
        let entry = self.entry(opts)?;
        let mut ctx = serde_json::Map::new();
        for (k, v) in &special.extra {
            ctx.insert(k.clone(), Json::from(v.as_str()));
        }
        // HF passes the special tokens that are set (absent ones stay undefined, printing "").
        for (k, t) in [
            ("bos_token", &special.bos_token),
            ("eos_token", &special.eos_token),
            ("pad_token", &special.pad_token),
            ("unk_token", &special.unk_token),
        ] {
            if let Some(t) = t {
                ctx.insert(k.into(), Json::from(t.as_str()));
            }
        }
        ctx.insert("messages".into(), Json::Array(messages.iter().map(ChatMessage::to_template_value).collect()));
        // HF passes `tools=None` and `documents=None` (defined, none) when absent.
        let tools = match opts.tools.as_ref().filter(|t| !t.is_empty()) {
            Some(tools) => serde_json::to_value(tools).map_err(|e| ChatError::TemplateRender(e.to_string()))?,
            None => Json::Null,
        };
        ctx.insert("tools".into(), tools);
        ctx.insert("documents".into(), Json::Null);
        ctx.insert("add_generation_prompt".into(), Json::Bool(opts.add_generation_prompt));
        if let Some(on) = opts.enable_thinking_var() {
            ctx.insert("enable_thinking".into(), Json::Bool(on));
        }
        if let Some(e) = opts.reasoning_effort {
            ctx.insert("reasoning_effort".into(), Json::from(e.as_str()));
        }
        for (k, v) in &opts.extra {
            ctx.insert(k.clone(), v.clone());
        }
        let tpl = self.env.get_template(&entry.name).map_err(|e| ChatError::TemplateRender(describe(&e)))?;
        tpl.render(Value::from_serialize(&ctx)).map_err(render_error)
    }
}

fn describe(e: &JinjaError) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn render_error(e: JinjaError) -> ChatError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = src {
        if let Some(r) = err.downcast_ref::<Raised>() {
            return ChatError::TemplateRaised(r.0.clone());
        }
        src = err.source();
    }
    ChatError::TemplateRender(describe(&e))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`. Key order is kept.
fn tojson_filter(value: Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<Value, JinjaError> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.as_str().is_some() => Some(v.as_str().unwrap_or_default().to_owned()),
        Some(v) => Some(" ".repeat(v.as_usize().ok_or_else(|| JinjaError::new(ErrorKind::InvalidOperation, "tojson: indent must be an integer or a string"))?)),
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() && !s.is_undefined() => {
            let a = s.get_item_by_index(0)?;
            let b = s.get_item_by_index(1)?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => (a.to_owned(), b.to_owned()),
                _ => return Err(JinjaError::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
            }
        }
        _ => ((if indent.is_some() { "," } else { ", " }).to_owned(), ": ".to_owned()),
    };
    let json = serde_json::to_value(&value).map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let opts = PyJson { indent, item_sep, key_sep, ensure_ascii: ensure_ascii.unwrap_or(false), sort_keys: sort_keys.unwrap_or(false) };
    let mut out = String::new();
    opts.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python `json.dumps` formatting.
pub(crate) struct PyJson {
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub ensure_ascii: bool,
    pub sort_keys: bool,
}

impl PyJson {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    pub(crate) fn write(&self, v: &Json, level: usize, out: &mut String) {
        match v {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => {
                if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
                    out.push_str(&py_float(f));
                } else {
                    out.push_str(&n.to_string());
                }
            }
            Json::String(s) => self.write_str(s, out),
            Json::Array(a) => {
                if a.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(x, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Json::Object(m) => {
                if m.is_empty() {
                    out.push_str("{}");
                    return;
                }
                let mut items: Vec<(&String, &Json)> = m.iter().collect();
                if self.sort_keys {
                    items.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in items.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write_str(k, out);
                    out.push_str(&self.key_sep);
                    self.write(x, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }

    fn write_str(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{:04x}", unit));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python `repr(float)`: shortest round-trip digits, exponent form below 1e-4 and from 1e16.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // `{:e}` gives the shortest round-trip digits: "1.2345e-5".
    let e = format!("{:e}", f);
    let (mant, exp) = e.split_once('e').expect("exponent form");
    let exp: i32 = exp.parse().expect("exponent");
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if neg { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let s = if exp >= 0 {
            let int_len = exp + 1;
            if n <= int_len {
                format!("{}{}.0", digits, "0".repeat((int_len - n) as usize))
            } else {
                format!("{}.{}", &digits[..int_len as usize], &digits[int_len as usize..])
            }
        } else {
            format!("0.{}{}", "0".repeat((-exp - 1) as usize), digits)
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits.clone() };
        format!("{sign}{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::py_float;

    #[test]
    fn python_float_repr() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (-2.25, "-2.25"),
            (1e15, "1000000000000000.0"),
            (3.0e-7, "3e-07"),
        ] {
            assert_eq!(py_float(f), s, "{f}");
        }
    }
}
