//! SFT datasets: JSONL lines in three forms, tokenised into ids with a loss mask, and padded
//! batches.
//!
//! * `{"messages": [{"role": ..., "content": ...}, ...]}`: the checkpoint's chat template renders
//!   the conversation; the loss covers the assistant turns only. An assistant turn starts where
//!   the rendering of the messages before it (with the generation prompt) ends, and ends with
//!   the template's turn-end marker (`<|im_end|>`, included), or, for templates without one,
//!   where the rendering through it ends. Whatever the template writes inside the turn is
//!   trained (Qwen3's empty think block before an answer after the last user query). The spans
//!   are tokenised one by one, in order.
//! * `{"prompt": "...", "completion": "..."}`: `prompt` tokenised with the tokenizer's special
//!   tokens, then `completion` without, then the first end-of-sequence id; the loss covers the
//!   completion and that end id.
//! * `{"prompt_ids": [...], "completion_ids": [...]}`: ids as given; the loss covers the
//!   completion ids.
use crate::error::{io_err, Result, TrainError};
use mlx_array::Array;
use mlx_models::chat::{ChatFormat, ChatMessage, RenderOptions, Role, Tokenizer};
use std::path::Path;

/// One training sequence: token ids and, per token, whether the loss counts it.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub ids: Vec<u32>,
    pub loss_mask: Vec<bool>,
}

impl Example {
    /// An example from prompt ids (no loss) and completion ids (loss).
    pub fn prompt_completion(prompt: &[u32], completion: &[u32]) -> Self {
        let ids = prompt.iter().chain(completion).copied().collect();
        let loss_mask = std::iter::repeat_n(false, prompt.len()).chain(std::iter::repeat_n(true, completion.len())).collect();
        Example { ids, loss_mask }
    }

    /// Tokens the loss counts (those predicted from an earlier position).
    pub fn loss_tokens(&self) -> usize {
        self.loss_mask.iter().skip(1).filter(|&&m| m).count()
    }
}

/// How text lines are tokenised: the checkpoint's tokenizer and, for `messages` lines, its chat
/// template. A directory without them can still train on pre-tokenised lines; why they could not
/// be loaded is reported when a line needs them.
pub struct TextEncoder {
    tokenizer: std::result::Result<Tokenizer, String>,
    format: std::result::Result<ChatFormat, String>,
}

impl TextEncoder {
    /// Tokenizer and chat template of a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Self {
        let why = |e: mlx_models::chat::ChatError| format!("{}: {e}", dir.display());
        TextEncoder { tokenizer: Tokenizer::from_dir(dir).map_err(why), format: ChatFormat::from_dir(dir).map_err(why) }
    }

    /// No tokenizer: only pre-tokenised lines.
    pub fn none() -> Self {
        let why = || "no tokenizer given (pre-tokenised lines only)".to_string();
        TextEncoder { tokenizer: Err(why()), format: Err(why()) }
    }

    /// The tokenizer, or why there is none.
    pub fn tokenizer(&self) -> std::result::Result<&Tokenizer, &str> {
        self.tokenizer.as_ref().map_err(String::as_str)
    }

    /// The chat format (tokenizer + template), or why there is none.
    pub fn chat_format(&self) -> std::result::Result<&ChatFormat, &str> {
        self.format.as_ref().map_err(String::as_str)
    }
}

/// Parse one JSONL line into an example. `max_len` truncates (keeping the start).
pub fn parse_line(line: &str, enc: &TextEncoder, max_len: Option<usize>) -> std::result::Result<Example, String> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("a line must be a JSON object")?;
    let mut ex = if let Some(m) = obj.get("messages") {
        let messages: Vec<ChatMessage> = serde_json::from_value(m.clone()).map_err(|e| format!("messages: {e}"))?;
        encode_messages(&messages, enc)?
    } else if obj.contains_key("prompt_ids") || obj.contains_key("completion_ids") {
        let ids = |k: &str| -> std::result::Result<Vec<u32>, String> {
            let a = obj.get(k).and_then(|x| x.as_array()).ok_or(format!("{k} must be an array of token ids"))?;
            a.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or(format!("{k}: {x} is not a token id"))).collect()
        };
        Example::prompt_completion(&ids("prompt_ids")?, &ids("completion_ids")?)
    } else if obj.contains_key("prompt") || obj.contains_key("completion") {
        let text = |k: &str| obj.get(k).and_then(|x| x.as_str()).ok_or(format!("{k} must be a string"));
        let tok = enc.tokenizer().map_err(|e| format!("text lines need the model's tokenizer: {e}"))?;
        let prompt = tok.encode(text("prompt")?, true).map_err(|e| e.to_string())?;
        let mut completion = tok.encode(text("completion")?, false).map_err(|e| e.to_string())?;
        completion.extend(tok.eos_token_ids().first());
        Example::prompt_completion(&prompt, &completion)
    } else {
        return Err("expected \"messages\", \"prompt\"/\"completion\" or \"prompt_ids\"/\"completion_ids\"".into());
    };
    if let Some(n) = max_len {
        ex.ids.truncate(n);
        ex.loss_mask.truncate(n);
    }
    if ex.loss_tokens() == 0 {
        return Err("no token to train on (empty completion, or truncated away)".into());
    }
    Ok(ex)
}

fn encode_messages(messages: &[ChatMessage], enc: &TextEncoder) -> std::result::Result<Example, String> {
    let format = enc.chat_format().map_err(|e| format!("\"messages\" lines need the model's tokenizer and chat template: {e}"))?;
    let render = |msgs: &[ChatMessage], gen: bool| -> std::result::Result<String, String> {
        let opts = RenderOptions { add_generation_prompt: gen, ..Default::default() };
        format.render(msgs, &opts).map(|p| p.text).map_err(|e| e.to_string())
    };
    let full = render(messages, false)?;
    // spans of text: (start, end, trained)
    let mut spans: Vec<(usize, usize, bool)> = Vec::new();
    let mut at = 0;
    for (i, m) in messages.iter().enumerate() {
        if m.role != Role::Assistant {
            continue;
        }
        let before = if i == 0 { String::new() } else { render(&messages[..i], true)? };
        let unlocated = || format!("the chat template does not render the messages before message {i} as a prefix of the conversation; the assistant turn cannot be located");
        if !full.starts_with(&before) || before.len() < at {
            return Err(unlocated());
        }
        let start = before.len();
        // The turn ends at the template's turn-end marker (included); for templates without
        // one, where rendering through it ends.
        let marker_end = format.turn_end().and_then(|(marker, _)| full[start..].find(marker).map(|k| start + k + marker.len()));
        let end = match marker_end {
            Some(e) => e,
            None => {
                let through = render(&messages[..=i], false)?;
                if !full.starts_with(&through) || through.len() <= start {
                    return Err(unlocated());
                }
                through.len()
            }
        };
        spans.push((at, start, false));
        spans.push((start, end, true));
        at = end;
    }
    if spans.is_empty() {
        return Err("no assistant message to train on".into());
    }
    spans.push((at, full.len(), false));
    let tok = format.tokenizer();
    let mut ex = Example { ids: Vec::new(), loss_mask: Vec::new() };
    for (s, e, trained) in spans {
        if s == e {
            continue;
        }
        let ids = tok.encode(&full[s..e], false).map_err(|e| e.to_string())?;
        ex.loss_mask.extend(std::iter::repeat_n(trained, ids.len()));
        ex.ids.extend(ids);
    }
    Ok(ex)
}

/// Read a JSONL dataset (blank lines skipped).
pub fn load_jsonl(path: &Path, enc: &TextEncoder, max_len: Option<usize>) -> Result<Vec<Example>> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        out.push(parse_line(line, enc, max_len).map_err(|msg| TrainError::Data { path: path.to_path_buf(), line: i + 1, msg })?);
    }
    if out.is_empty() {
        return Err(TrainError::Data { path: path.to_path_buf(), line: 0, msg: "no examples".into() });
    }
    Ok(out)
}

/// A padded batch ready for the loss: inputs `[B, L-1]`, and the flat positions (row-major over
/// `[B, L-1]`) whose next token the loss counts, with those tokens.
pub struct Batch {
    pub inputs: Array,
    pub rows: usize,
    pub width: usize,
    /// Flat indices into `[B * (L-1)]` of the loss positions.
    pub positions: Vec<u32>,
    /// Target id at each loss position.
    pub targets: Vec<u32>,
    /// Every non-padding input token of the batch.
    pub tokens: usize,
}

/// Right-pad `examples` with `pad_id` (causal attention: padding after a sequence does not change
/// its positions) and collect the loss positions.
pub fn make_batch(examples: &[&Example], pad_id: u32) -> Result<Batch> {
    let width = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0);
    if width < 2 {
        return Err(TrainError::InvalidInput("a batch needs a sequence of at least two tokens".into()));
    }
    let w = width - 1;
    let mut inputs = Vec::with_capacity(examples.len() * w);
    let (mut positions, mut targets, mut tokens) = (Vec::new(), Vec::new(), 0);
    for (r, e) in examples.iter().enumerate() {
        for t in 0..w {
            inputs.push(e.ids.get(t).copied().unwrap_or(pad_id));
            if t + 1 < e.ids.len() {
                tokens += 1;
                if e.loss_mask[t + 1] {
                    positions.push((r * w + t) as u32);
                    targets.push(e.ids[t + 1]);
                }
            }
        }
    }
    if positions.is_empty() {
        return Err(TrainError::InvalidInput("the batch has no loss token".into()));
    }
    Ok(Batch { inputs: Array::from_slice(&inputs, &[examples.len(), w])?, rows: examples.len(), width: w, positions, targets, tokens })
}
