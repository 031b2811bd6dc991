//! Text side of chat: tokenizer, chat template, messages, output parsing.
//!
//! What a chat session does with it, in order:
//! 1. `let fmt = ChatFormat::from_dir(model_dir)?` once per loaded model (shared, `Sync`).
//! 2. Start: `let prompt = fmt.render(&messages, &render_opts)?` (validates the messages, renders
//!    the checkpoint template as HF does, tokenizes) and prefill `prompt.ids`
//!    (or `fmt.render_reusing(&messages, &cached_ids, &opts)` to reuse a cached prefix).
//! 3. Per reply: `let mut dec = fmt.stream_decoder();`
//!    `let mut parser = fmt.parser(&render_opts, prompt.starts_in_thinking, include_reasoning);`
//!    `let mut budget = fmt.thinking_budget(thinking_token_budget, prompt.starts_in_thinking)?;`
//!    stop ids: `fmt.stop_token_ids()`. Each step: token = `budget.forced_token()` or sample;
//!    `budget.observe(token)`; if not a stop id, `dec.step(token)?` → `parser.push(&delta)` → forward
//!    the [`ChatEvent`]s. At the end `dec.finish()` → `parser.push`, then `parser.finish()`;
//!    `parser.output()` gives text, thinking, tool calls and raw text; `budget.thinking_tokens()`
//!    the reasoning token count.
//! 4. Append `output.to_assistant_message()` to the history; keep the cached ids (prompt +
//!    generated, stop token included).
//! 5. Continue: `fmt.plan_continuation(&history, &cached_ids, &[ChatMessage::user(text)], &opts)?`
//!    or, for a tool result, `&[ChatMessage::tool(id, content).with_error(is_error)]`.
//!    `PromptPlan::Append { delta, cached_tokens, .. }` → prefill only `delta`;
//!    `PromptPlan::Reprefill { prompt, .. }` → reset and prefill `prompt.ids`.
mod budget;
mod error;
mod format;
mod message;
mod parser;
mod template;
mod tokenizer;

pub use budget::ThinkingBudget;
pub use error::{ChatError, Result};
pub use format::{common_prefix_len, ChatFormat, DeltaKind, Prompt, PromptPlan};
pub use message::{validate_messages, ChatMessage, FunctionDefinition, Role, ToolCall, ToolDefinition, TOOL_ERROR_MARKER};
pub use parser::{
    ChatEvent, OutputParser, ParsedOutput, ParsedToolCall, ParserOptions, ThinkTags, ToolCallFormat, ToolCallStatus,
    ToolCallSyntax, GEMMA4_THINK_TAGS, GEMMA4_TOOL_CALLS, LFM2_TOOL_CALLS, QWEN3_5_TOOL_CALLS, QWEN3_TOOL_CALLS, THINK_TAGS,
    TOOL_CALL_FORMATS,
};
pub use template::{ChatTemplate, ReasoningEffort, RenderOptions};
pub use tokenizer::{SpecialTokens, StreamDecoder, Tokenizer};
