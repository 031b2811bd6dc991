//! Errors of the text side: tokenizer, chat template, message validation.
use std::path::PathBuf;

/// Everything that can go wrong between chat messages and token ids.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// A file could not be read.
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON side file (tokenizer_config.json, generation_config.json, ...) is not valid JSON
    /// or has the wrong structure.
    #[error("Malformed {} : {reason}", path.display())]
    MalformedFile { path: PathBuf, reason: String },
    /// `tokenizer.json` is missing from the checkpoint directory.
    #[error("tokenizer.json not found in {}", .0.display())]
    TokenizerNotFound(PathBuf),
    /// The `tokenizers` crate refused the tokenizer file.
    #[error("Cannot load tokenizer {}: {reason}", path.display())]
    TokenizerLoad { path: PathBuf, reason: String },
    /// Encoding text failed.
    #[error("tokenizer encode failed: {0}")]
    Encode(String),
    /// Decoding token ids failed (for example an id outside the vocabulary).
    #[error("tokenizer decode failed: {0}")]
    Decode(String),
    /// The checkpoint has no chat template anywhere we look.
    #[error(
        "No chat template in {}: looked for chat_template.jinja, tokenizer_config.json \"chat_template\" and chat_template.json",
        .0.display()
    )]
    NoChatTemplate(PathBuf),
    /// A named template was requested that the checkpoint does not define.
    #[error("chat template \"{name}\" not found (available: {available})")]
    TemplateNotFound { name: String, available: String },
    /// The template does not compile.
    #[error("chat template syntax error: {0}")]
    TemplateSyntax(String),
    /// The template called `raise_exception(message)`.
    #[error("chat template raised an exception: {0}")]
    TemplateRaised(String),
    /// Rendering failed for another reason (undefined attribute, type error, ...).
    #[error("chat template render failed: {0}")]
    TemplateRender(String),
    /// `reasoning_effort` must be one of none, low, medium, high.
    #[error("Invalid reasoning effort \"{0}\": expected one of \"none\", \"low\", \"medium\", \"high\"")]
    InvalidReasoningEffort(String),
    /// The conversation is empty.
    #[error("Invalid messages: the message list is empty")]
    EmptyConversation,
    /// A message role that is none of system, user, assistant, tool.
    #[error(
        "Invalid messages: message {index} has unknown role \"{role}\" (expected \"system\", \"user\", \"assistant\" or \"tool\")"
    )]
    UnknownRole { index: usize, role: String },
    /// A message that is not an object with a role and content.
    #[error("Invalid messages: message {index} is malformed: {reason}")]
    MalformedMessage { index: usize, reason: String },
    /// A tool message whose previous non-tool message is not an assistant turn with tool calls.
    #[error(
        "Invalid messages: tool message {index} does not follow an assistant message with tool calls"
    )]
    ToolResultWithoutCall { index: usize },
    /// A tool message names a tool call id that the preceding assistant turn did not make.
    #[error(
        "Invalid messages: tool message {index} answers tool_call_id \"{tool_call_id}\", but the preceding assistant message made no call with that id"
    )]
    UnknownToolCallId { index: usize, tool_call_id: String },
    /// An assistant tool call without a function name.
    #[error("Invalid messages: tool call {call} of message {index} has an empty name")]
    EmptyToolName { index: usize, call: usize },
    /// tool_calls on a message that is not an assistant message.
    #[error("Invalid messages: message {index} has role \"{role}\" but only assistant messages can carry tool_calls")]
    ToolCallsOnNonAssistant { index: usize, role: String },
    /// There is no user message at all (a system prompt alone is not a conversation).
    #[error("Invalid messages: the conversation has no user message")]
    NoUserMessage,
    /// A delta was asked for, but the conversation in the cache does not end where a new turn
    /// can start (for example the last cached message is a user message).
    #[error("Cannot append a delta: {0}")]
    InvalidDelta(String),
    /// The thinking budget needs the think-end marker as one token.
    #[error("thinking budget: \"{0}\" is not a single token in this tokenizer")]
    ThinkEndNotSingleToken(String),
}

pub type Result<T, E = ChatError> = std::result::Result<T, E>;

impl ChatError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ChatError::Io { path: path.into(), source }
    }
    pub(crate) fn malformed(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Self {
        ChatError::MalformedFile { path: path.into(), reason: reason.to_string() }
    }
}
