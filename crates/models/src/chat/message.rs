//! Chat messages, tool definitions and the validation of a message sequence.
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use super::error::{ChatError, Result};
use crate::media::{AudioInput, ImageInput, MediaItem};

/// Prefix put in front of a tool result's content when the tool failed (`is_error: true`), inside
/// the rendered tool block, so the model gets a text-level cue. The structured `content` stays
/// unchanged; `None`/`false` render exactly as before.
pub const TOOL_ERROR_MARKER: &str = "[tool error] ";

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "&'static str")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

impl From<Role> for &'static str {
    fn from(r: Role) -> Self {
        r.as_str()
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "system" => Ok(Role::System),
            "user" => Ok(Role::User),
            "assistant" => Ok(Role::Assistant),
            "tool" => Ok(Role::Tool),
            other => Err(format!(
                "unknown role \"{other}\" (expected \"system\", \"user\", \"assistant\" or \"tool\")"
            )),
        }
    }
}

impl TryFrom<String> for Role {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tool call made by the assistant (in a message of the history).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Id the tool result refers to (`tool_call_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub name: String,
    /// JSON arguments (an object for well-formed calls; a string is rendered verbatim).
    #[serde(default)]
    pub arguments: Json,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    #[serde(default)]
    pub content: String,
    /// Thinking text of an assistant turn (rendered inside `<think>` by templates that know it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For tool messages: the call this result answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For tool messages: the tool failed; the rendered content gets [`TOOL_ERROR_MARKER`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_error: Option<bool>,
    /// Images of the message (vision-language models). The template sees the content as a list
    /// of parts: one `{"type": "image"}` per image, one `{"type": "audio"}` per clip, then the
    /// text, as Hugging Face processors pass it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<ImageInput>,
    /// Sounds of the message (Gemma 4).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub audio: Vec<AudioInput>,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        ChatMessage { role, content: content.into(), reasoning_content: None, tool_calls: None, tool_call_id: None, is_error: None, images: Vec::new(), audio: Vec::new() }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }
    /// A tool result answering `tool_call_id`.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { tool_call_id: Some(tool_call_id.into()), ..Self::new(Role::Tool, content) }
    }
    /// Mark a tool result as an error (or not).
    pub fn with_error(mut self, is_error: bool) -> Self {
        self.is_error = Some(is_error);
        self
    }
    pub fn with_reasoning(mut self, reasoning: impl Into<String>) -> Self {
        self.reasoning_content = Some(reasoning.into());
        self
    }
    pub fn with_tool_calls(mut self, calls: Vec<ToolCall>) -> Self {
        self.tool_calls = Some(calls);
        self
    }
    /// Attach an image.
    pub fn with_image(mut self, image: ImageInput) -> Self {
        self.images.push(image);
        self
    }
    /// Attach a sound.
    pub fn with_audio(mut self, audio: AudioInput) -> Self {
        self.audio.push(audio);
        self
    }
    /// The message's media in template order (images, then audio).
    pub fn media(&self) -> impl Iterator<Item = MediaItem> + '_ {
        self.images.iter().cloned().map(MediaItem::Image).chain(self.audio.iter().cloned().map(MediaItem::Audio))
    }

    /// Parse a JSON array of messages, with typed errors for unknown roles and malformed entries.
    pub fn list_from_json(json: &Json) -> Result<Vec<ChatMessage>> {
        let arr = json.as_array().ok_or_else(|| ChatError::MalformedMessage {
            index: 0,
            reason: "expected a JSON array of messages".into(),
        })?;
        arr.iter()
            .enumerate()
            .map(|(index, m)| {
                let role = m.get("role").ok_or_else(|| ChatError::MalformedMessage { index, reason: "missing \"role\"".into() })?;
                let role = role.as_str().ok_or_else(|| ChatError::MalformedMessage { index, reason: format!("\"role\" must be a string, got {role}") })?;
                if role.parse::<Role>().is_err() {
                    return Err(ChatError::UnknownRole { index, role: role.to_owned() });
                }
                serde_json::from_value(m.clone()).map_err(|e| ChatError::MalformedMessage { index, reason: e.to_string() })
            })
            .collect()
    }

    /// The content as the template sees it (tool errors marked).
    pub(crate) fn rendered_content(&self) -> String {
        if self.role == Role::Tool && self.is_error == Some(true) {
            format!("{TOOL_ERROR_MARKER}{}", self.content)
        } else {
            self.content.clone()
        }
    }

    /// The dict handed to the chat template (OpenAI/HF shape: tool calls as
    /// `{"id", "type": "function", "function": {"name", "arguments"}}`).
    pub(crate) fn to_template_value(&self) -> Json {
        let mut m = serde_json::Map::new();
        m.insert("role".into(), Json::from(self.role.as_str()));
        if self.images.is_empty() && self.audio.is_empty() {
            m.insert("content".into(), Json::from(self.rendered_content()));
        } else {
            let part = |t: &str| Json::Object([("type".to_string(), Json::from(t))].into_iter().collect());
            let mut parts: Vec<Json> = self.images.iter().map(|_| part("image")).collect();
            parts.extend(self.audio.iter().map(|_| part("audio")));
            let mut text = serde_json::Map::new();
            text.insert("type".into(), Json::from("text"));
            text.insert("text".into(), Json::from(self.rendered_content()));
            parts.push(Json::Object(text));
            m.insert("content".into(), Json::Array(parts));
        }
        if let Some(r) = &self.reasoning_content {
            m.insert("reasoning_content".into(), Json::from(r.as_str()));
        }
        if let Some(calls) = self.tool_calls.as_ref().filter(|c| !c.is_empty()) {
            let calls: Vec<Json> = calls
                .iter()
                .map(|c| {
                    let mut f = serde_json::Map::new();
                    f.insert("name".into(), Json::from(c.name.as_str()));
                    f.insert("arguments".into(), c.arguments.clone());
                    let mut o = serde_json::Map::new();
                    if let Some(id) = &c.id {
                        o.insert("id".into(), Json::from(id.as_str()));
                    }
                    o.insert("type".into(), Json::from("function"));
                    o.insert("function".into(), Json::Object(f));
                    Json::Object(o)
                })
                .collect();
            m.insert("tool_calls".into(), Json::Array(calls));
        }
        if let Some(id) = &self.tool_call_id {
            m.insert("tool_call_id".into(), Json::from(id.as_str()));
        }
        Json::Object(m)
    }
}

/// A function the model may call, as the OpenAI/HF `tools` list has it:
/// `{"type": "function", "function": {"name", "description", "parameters"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionDefinition,
}

fn function_type() -> String {
    "function".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionDefinition {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON schema of the arguments (key order is kept as given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Json>,
}

impl ToolDefinition {
    pub fn function(name: impl Into<String>, description: impl Into<String>, parameters: Json) -> Self {
        ToolDefinition {
            kind: function_type(),
            function: FunctionDefinition { name: name.into(), description: Some(description.into()), parameters: Some(parameters) },
        }
    }
}

/// Check that a message sequence is a conversation a chat template can render:
/// - it is not empty and has at least one user message;
/// - only assistant messages carry tool calls, and every call has a name;
/// - every tool message follows (possibly after other tool messages) an assistant message with
///   tool calls, and when both sides have ids, its `tool_call_id` is one of that message's calls.
pub fn validate_messages(messages: &[ChatMessage]) -> Result<()> {
    if messages.is_empty() {
        return Err(ChatError::EmptyConversation);
    }
    if !messages.iter().any(|m| m.role == Role::User) {
        return Err(ChatError::NoUserMessage);
    }
    // The assistant message whose calls the following tool messages answer.
    let mut open_calls: Option<&[ToolCall]> = None;
    for (index, m) in messages.iter().enumerate() {
        if let Some(calls) = &m.tool_calls {
            if m.role != Role::Assistant && !calls.is_empty() {
                return Err(ChatError::ToolCallsOnNonAssistant { index, role: m.role.to_string() });
            }
            if let Some(call) = calls.iter().position(|c| c.name.trim().is_empty()) {
                return Err(ChatError::EmptyToolName { index, call });
            }
        }
        match m.role {
            Role::Tool => {
                let Some(calls) = open_calls else {
                    return Err(ChatError::ToolResultWithoutCall { index });
                };
                if let Some(id) = &m.tool_call_id {
                    let ids: Vec<&str> = calls.iter().filter_map(|c| c.id.as_deref()).collect();
                    if !ids.is_empty() && !ids.contains(&id.as_str()) {
                        return Err(ChatError::UnknownToolCallId { index, tool_call_id: id.clone() });
                    }
                }
            }
            Role::Assistant => {
                open_calls = m.tool_calls.as_deref().filter(|c| !c.is_empty());
            }
            Role::System | Role::User => open_calls = None,
        }
    }
    Ok(())
}
