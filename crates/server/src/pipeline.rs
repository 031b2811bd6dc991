//! From engine tokens to what the endpoints send: incremental detokenization, stop strings,
//! thinking and tool-call parsing, per-token log-probs, usage. One blocking task per request
//! turns [`GenEvent`]s into [`Out`]s; when the endpoint drops its receiver (the client went
//! away) the task drops the engine's receiver, which cancels the generation.
use crate::engine::{Engine, EventStream, GenEvent, GenRequest};
use crate::error::ApiError;
use crate::metrics::Metrics;
use mlx_models::chat::{ChatEvent, ChatFormat, OutputParser, ParsedToolCall, ParserOptions};
use mlx_models::{CancelHandle, FinishReason};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// A prepared generation.
pub struct Plan {
    pub req: GenRequest,
    /// Text that ends the output (not included).
    pub stop_strings: Vec<String>,
    /// Parse thinking and tool calls (chat); `None` passes text through (completions).
    pub parser: Option<ParserOptions>,
    pub starts_in_thinking: bool,
    pub logprobs: bool,
    /// When the HTTP request arrived (time to first token is measured from it).
    pub arrived: Instant,
}

/// One generated token's log-prob.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// What the endpoints receive, in order: any of the first four, then `Done` or `Error`.
#[derive(Debug, Clone)]
pub enum Out {
    Text(String),
    Thinking(String),
    ToolCall(ParsedToolCall),
    Logprob(TokenLogprob),
    Done(Final),
    Error(String),
}

/// The end of a generation.
#[derive(Debug, Clone)]
pub struct Final {
    /// OpenAI's finish reason: `stop`, `length`, `tool_calls` (or `repetition`, when a stop
    /// guard of the sampling settings fired).
    pub finish_reason: &'static str,
    pub text: String,
    pub thinking: Option<String>,
    pub tool_calls: Vec<ParsedToolCall>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub reasoning_tokens: usize,
    /// Every token of the sequence (prompt, generated, stop token), when the output is exactly
    /// what was generated (not cut by a stop string): what the engine's KV cache now holds.
    pub sequence: Option<Vec<u32>>,
}

/// Holds back text that may be the start of a stop string.
struct StopStrings {
    stops: Vec<String>,
    buf: String,
}

enum StopStep {
    Emit(String),
    Stopped(String),
}

impl StopStrings {
    fn push(&mut self, delta: &str) -> StopStep {
        if self.stops.is_empty() {
            return StopStep::Emit(delta.to_string());
        }
        self.buf.push_str(delta);
        if let Some(pos) = self
            .stops
            .iter()
            .filter_map(|s| self.buf.find(s.as_str()))
            .min()
        {
            let out = self.buf[..pos].to_string();
            self.buf.clear();
            return StopStep::Stopped(out);
        }
        // Keep the longest tail that is a proper prefix of a stop string.
        let mut hold = 0;
        for (i, _) in self.buf.char_indices() {
            let tail = &self.buf[i..];
            if self.stops.iter().any(|s| s.starts_with(tail)) {
                hold = self.buf.len() - i;
                break;
            }
        }
        let cut = self.buf.len() - hold;
        let out = self.buf[..cut].to_string();
        self.buf.drain(..cut);
        StopStep::Emit(out)
    }
    fn flush(&mut self) -> String {
        std::mem::take(&mut self.buf)
    }
}

/// Submit `plan` to `engine` and start its decoding task. Refusals (queue full, engine down)
/// come back at once.
pub fn start(
    engine: &Arc<dyn Engine>,
    format: &Arc<ChatFormat>,
    metrics: &Arc<Metrics>,
    plan: Plan,
) -> Result<UnboundedReceiver<Out>, ApiError> {
    let prompt_tokens = plan.req.prompt.len();
    let sub = engine.submit(plan.req.clone())?;
    let (rx, cancel) = (sub.events, sub.cancel);
    let (tx, out) = unbounded_channel();
    let (format, metrics) = (format.clone(), metrics.clone());
    tokio::task::spawn_blocking(move || {
        if run(rx, &tx, &format, &metrics, &plan, &cancel, prompt_tokens).is_none() {
            metrics.cancelled();
        }
    });
    Ok(out)
}

/// `None` when the receiver went away (cancelled).
fn run(
    mut rx: Box<dyn EventStream>,
    tx: &UnboundedSender<Out>,
    format: &ChatFormat,
    metrics: &Metrics,
    plan: &Plan,
    cancel: &CancelHandle,
    prompt_tokens: usize,
) -> Option<()> {
    let mut dec = format.stream_decoder();
    let mut parser = plan.parser.clone().map(OutputParser::new);
    let mut budget = if plan.parser.is_some() {
        format
            .thinking_budget(None, plan.starts_in_thinking)
            .ok()
            .flatten()
    } else {
        None
    };
    let mut stops = StopStrings {
        stops: plan.stop_strings.clone(),
        buf: String::new(),
    };
    let mut text = String::new();
    let mut n = 0usize;
    let mut gen_ids: Vec<u32> = Vec::new();
    let mut stopped = false;
    let send = |o: Out| tx.send(o).ok();
    let emit = |s: String, parser: &mut Option<OutputParser>, text: &mut String| -> Option<()> {
        if s.is_empty() {
            return Some(());
        }
        match parser {
            Some(p) => {
                for e in p.push(&s) {
                    send(event_out(e))?;
                }
            }
            None => {
                text.push_str(&s);
                send(Out::Text(s))?;
            }
        }
        Some(())
    };
    let summary = loop {
        match rx.recv() {
            Some(GenEvent::Token { id, logprob }) => {
                if stopped {
                    continue;
                }
                n += 1;
                gen_ids.push(id);
                if n == 1 {
                    metrics.ttft(plan.arrived.elapsed());
                }
                metrics.tokens(1);
                if let Some(b) = budget.as_mut() {
                    b.observe(id);
                }
                if plan.logprobs {
                    let token = format.tokenizer().decode(&[id], false).unwrap_or_default();
                    send(Out::Logprob(TokenLogprob {
                        bytes: token.as_bytes().to_vec(),
                        token,
                        logprob,
                    }))?;
                }
                let delta = match dec.step(id) {
                    Ok(d) => d,
                    Err(e) => {
                        send(Out::Error(e.to_string()));
                        return Some(());
                    }
                };
                if let Some(d) = delta {
                    match stops.push(&d) {
                        StopStep::Emit(s) => emit(s, &mut parser, &mut text)?,
                        StopStep::Stopped(s) => {
                            emit(s, &mut parser, &mut text)?;
                            stopped = true;
                            cancel.cancel();
                        }
                    }
                }
            }
            Some(GenEvent::Done(s)) => break s,
            Some(GenEvent::Error(e)) => {
                send(Out::Error(e));
                return Some(());
            }
            None => {
                send(Out::Error("the generation engine stopped".into()));
                return Some(());
            }
        }
    };
    if !stopped {
        let tail = dec.finish().unwrap_or_default();
        match stops.push(&tail) {
            StopStep::Emit(s) => {
                emit(s, &mut parser, &mut text)?;
                let rest = stops.flush();
                emit(rest, &mut parser, &mut text)?;
            }
            StopStep::Stopped(s) => {
                emit(s, &mut parser, &mut text)?;
                stopped = true;
            }
        }
    }
    let (mut thinking, mut tool_calls) = (None, Vec::new());
    if let Some(p) = parser.as_mut() {
        for e in p.finish() {
            send(event_out(e))?;
        }
        let o = p.output();
        text = o.text;
        thinking = o.thinking;
        tool_calls = o.tool_calls;
    }
    let finish_reason = if !tool_calls.is_empty() {
        "tool_calls"
    } else if stopped {
        "stop"
    } else {
        match summary.finish_reason {
            FinishReason::Length => "length",
            FinishReason::Repetition => "repetition",
            _ => "stop",
        }
    };
    metrics.prompt(prompt_tokens, summary.cached_tokens);
    let sequence = (!stopped).then(|| {
        let mut s = plan.req.prompt.clone();
        s.extend_from_slice(&gen_ids);
        s.extend(summary.stop_token);
        s
    });
    send(Out::Done(Final {
        finish_reason,
        text,
        thinking,
        tool_calls,
        prompt_tokens,
        cached_tokens: summary.cached_tokens,
        completion_tokens: n,
        reasoning_tokens: budget.map_or(0, |b| b.thinking_tokens()),
        sequence,
    }))?;
    Some(())
}

fn event_out(e: ChatEvent) -> Out {
    match e {
        ChatEvent::TextDelta(t) => Out::Text(t),
        ChatEvent::ThinkingDelta(t) => Out::Thinking(t),
        ChatEvent::ToolCall(c) => Out::ToolCall(c),
    }
}

/// Collect a whole generation (non-streaming answers).
pub async fn collect(
    mut rx: UnboundedReceiver<Out>,
) -> Result<(Final, Vec<TokenLogprob>), ApiError> {
    let mut lps = Vec::new();
    while let Some(o) = rx.recv().await {
        match o {
            Out::Logprob(l) => lps.push(l),
            Out::Done(f) => return Ok((f, lps)),
            Out::Error(e) => return Err(ApiError::internal(e)),
            Out::Text(_) | Out::Thinking(_) | Out::ToolCall(_) => {}
        }
    }
    Err(ApiError::internal("generation ended without a result"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_stops(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let mut s = StopStrings {
            stops: stops.iter().map(|s| s.to_string()).collect(),
            buf: String::new(),
        };
        let mut out = String::new();
        for d in deltas {
            match s.push(d) {
                StopStep::Emit(t) => out.push_str(&t),
                StopStep::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&s.flush());
        (out, false)
    }

    #[test]
    fn stop_strings_across_deltas() {
        assert_eq!(
            run_stops(&["END"], &["hello E", "N", "D more"]),
            ("hello ".into(), true)
        );
        assert_eq!(
            run_stops(&["END"], &["hello E", "N", "x"]),
            ("hello ENx".into(), false)
        );
        assert_eq!(run_stops(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(
            run_stops(&["\n\n", "é!"], &["caf", "é", "!"]),
            ("caf".into(), true)
        );
    }
}
