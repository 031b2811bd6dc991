//! [`ChatFormat`]: tokenizer + chat template + the model's markers, the one object a chat
//! session needs on the text side (prompt rendering, continuation deltas, output parsing).
use std::path::Path;

use super::budget::ThinkingBudget;
use super::error::{ChatError, Result};
use super::message::{validate_messages, ChatMessage, Role};
use super::parser::{OutputParser, ParserOptions, ThinkTags, ToolCallFormat, GEMMA4_THINK_TAGS, THINK_TAGS};
use super::template::{ChatTemplate, RenderOptions};
use super::tokenizer::{StreamDecoder, Tokenizer};

/// A rendered, tokenized prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub text: String,
    pub ids: Vec<u32>,
    /// The prompt ends inside an open think block: the output starts as thinking.
    pub starts_in_thinking: bool,
}

/// How a continuation delta was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaKind {
    /// The full re-rendered conversation starts with the cached tokens; the delta is the rest.
    Exact,
    /// The template re-renders history differently from what the cache holds (Qwen3 drops old
    /// `<think>` blocks), so the delta is the template's rendering of the new messages after the
    /// last assistant turn end, appended on the cached turn boundary (the cache is not
    /// re-rendered; this is the chat-session "raw delta").
    TurnBoundary,
}

/// What to prefill for a continued conversation.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptPlan {
    /// Keep the cache and prefill `delta` on top of its `cached_tokens` tokens.
    Append {
        delta: Vec<u32>,
        delta_text: String,
        cached_tokens: usize,
        kind: DeltaKind,
        starts_in_thinking: bool,
    },
    /// The cache does not hold a prefix of this conversation: prefill `prompt` again.
    /// `common_prefix` cached tokens agree with it (a cache that can be truncated may keep them).
    Reprefill { prompt: Prompt, common_prefix: usize, reason: String },
}

/// Text side of a chat model. `Send + Sync`: share it between sessions and threads.
#[derive(Debug)]
pub struct ChatFormat {
    tokenizer: Tokenizer,
    template: ChatTemplate,
    think: Option<ThinkTags>,
    think_ids: (Option<u32>, Option<u32>),
    /// The token string that ends an assistant turn (e.g. `<|im_end|>`, `<end_of_turn>`) and its id.
    turn_end: Option<(String, u32)>,
}

/// Length of the common prefix of two id sequences.
pub fn common_prefix_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl ChatFormat {
    /// Load tokenizer and chat template from a checkpoint directory.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tokenizer = Tokenizer::from_dir(dir)?;
        let template = ChatTemplate::from_dir(dir)?;
        Ok(Self::new(tokenizer, template))
    }

    pub fn new(tokenizer: Tokenizer, template: ChatTemplate) -> Self {
        let sources: String = template.names().iter().filter_map(|n| {
            let o = RenderOptions { template_name: Some((*n).to_owned()), ..Default::default() };
            template.source(&o).ok().map(str::to_owned)
        }).collect();
        let has_tok = |s: &str| tokenizer.token_to_id(s).is_some();
        let think = if sources.contains("<|channel>") && has_tok("<channel|>") {
            Some(GEMMA4_THINK_TAGS)
        } else {
            (sources.contains(THINK_TAGS.start) || (has_tok(THINK_TAGS.start) && has_tok(THINK_TAGS.end))).then_some(THINK_TAGS)
        };
        let think_ids = match think {
            Some(t) => (single_token(&tokenizer, t.start), single_token(&tokenizer, t.end)),
            None => (None, None),
        };
        // The eos string the template writes after each turn.
        let special = tokenizer.special_tokens();
        let mut candidates: Vec<String> = special.eos_token.iter().cloned().collect();
        candidates.extend(tokenizer.eos_token_ids().iter().filter_map(|&id| tokenizer.id_to_token(id)));
        let turn_end = candidates
            .into_iter()
            .find(|s| sources.contains(s.as_str()))
            .and_then(|s| tokenizer.token_to_id(&s).map(|id| (s, id)));
        ChatFormat { tokenizer, template, think, think_ids, turn_end }
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }
    /// Think markers, when the model has them.
    pub fn think_tags(&self) -> Option<ThinkTags> {
        self.think
    }
    /// The tool-call format the template uses.
    pub fn tool_call_format(&self, opts: &RenderOptions) -> Option<ToolCallFormat> {
        self.template.source(opts).ok().and_then(ToolCallFormat::detect)
    }
    /// The turn-end token (the session stop token) and its string.
    pub fn turn_end(&self) -> Option<(&str, u32)> {
        self.turn_end.as_ref().map(|(s, id)| (s.as_str(), *id))
    }
    /// Ids that stop generation: the turn end plus every eos id.
    pub fn stop_token_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.turn_end.iter().map(|t| t.1).collect();
        for &id in self.tokenizer.eos_token_ids() {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// Render the conversation and tokenize it (HF `apply_chat_template(tokenize=True)`:
    /// encoded without adding special tokens; the template writes `bos_token` itself).
    /// Validates the messages first. When thinking is off (`enable_thinking: false` or reasoning
    /// effort none/low) and the template does not read `enable_thinking`, the empty think block
    /// `<think>\n\n</think>\n\n` is appended after the generation prompt (closing a think block
    /// the template opened), as Qwen3's template does.
    pub fn render(&self, messages: &[ChatMessage], opts: &RenderOptions) -> Result<Prompt> {
        let text = self.render_text(messages, opts)?;
        let ids = self.tokenizer.encode(&text, false)?;
        let starts_in_thinking = self.ends_in_open_think(&text);
        Ok(Prompt { text, ids, starts_in_thinking })
    }

    fn render_text(&self, messages: &[ChatMessage], opts: &RenderOptions) -> Result<String> {
        validate_messages(messages)?;
        let mut text = self.template.render(messages, self.tokenizer.special_tokens(), opts)?;
        if let Some(t) = self.think {
            if opts.add_generation_prompt && !opts.thinking_enabled() && !self.template.handles_enable_thinking(opts)? {
                let open = text.trim_end().ends_with(t.start);
                if open {
                    let after = &text[text.rfind(t.start).expect("ends with start") + t.start.len()..];
                    let nl = "\n\n".len().saturating_sub(after.len());
                    text.push_str(&"\n".repeat(nl));
                    text.push_str(t.end);
                    text.push_str("\n\n");
                } else {
                    text.push_str(&format!("{}\n\n{}\n\n", t.start, t.end));
                }
            }
        }
        Ok(text)
    }

    fn ends_in_open_think(&self, text: &str) -> bool {
        self.think.is_some_and(|t| text.trim_end().ends_with(t.start))
    }

    /// Render with prefix reuse against whatever the cache holds (seed `reuseCache`): the number
    /// of leading ids shared with `cached_ids`.
    pub fn render_reusing(&self, messages: &[ChatMessage], cached_ids: &[u32], opts: &RenderOptions) -> Result<(Prompt, usize)> {
        let p = self.render(messages, opts)?;
        let n = common_prefix_len(&p.ids, cached_ids);
        Ok((p, n))
    }

    /// The ids to append for `new_messages` (a user message, or tool results) on top of a cache
    /// holding `cached_ids`, which came from rendering `history` and generating its last
    /// assistant reply. Tries, in order:
    /// 1. [`DeltaKind::Exact`]: the re-rendered conversation starts with `cached_ids`;
    /// 2. [`DeltaKind::TurnBoundary`]: `history` ends with an assistant message, the cache holds
    ///    as many turn ends as the rendered history (the last one may be missing when the reply
    ///    was cut by the length limit: then the delta starts with the turn-end token), and the
    ///    delta is the rendering after the history's last turn end;
    /// 3. otherwise [`PromptPlan::Reprefill`] with the full prompt.
    pub fn plan_continuation(
        &self,
        history: &[ChatMessage],
        cached_ids: &[u32],
        new_messages: &[ChatMessage],
        opts: &RenderOptions,
    ) -> Result<PromptPlan> {
        if new_messages.is_empty() {
            return Err(ChatError::InvalidDelta("no new messages to append".into()));
        }
        let mut all: Vec<ChatMessage> = history.to_vec();
        all.extend_from_slice(new_messages);
        let full_text = self.render_text(&all, opts)?;
        let full_ids = self.tokenizer.encode(&full_text, false)?;
        let starts_in_thinking = self.ends_in_open_think(&full_text);
        if !cached_ids.is_empty() && full_ids.starts_with(cached_ids) {
            let delta = full_ids[cached_ids.len()..].to_vec();
            let delta_text = self.tokenizer.decode(&delta, false)?;
            return Ok(PromptPlan::Append { delta, delta_text, cached_tokens: cached_ids.len(), kind: DeltaKind::Exact, starts_in_thinking });
        }
        let common_prefix = common_prefix_len(&full_ids, cached_ids);
        let reprefill = |reason: String| PromptPlan::Reprefill {
            prompt: Prompt { text: full_text.clone(), ids: full_ids.clone(), starts_in_thinking },
            common_prefix,
            reason,
        };
        let Some((end_str, end_id)) = self.turn_end() else {
            return Ok(reprefill("the template has no turn-end token to append a delta after".into()));
        };
        if history.last().map(|m| m.role) != Some(Role::Assistant) {
            return Ok(reprefill("the cached conversation does not end with an assistant turn".into()));
        }
        let hist_opts = RenderOptions { add_generation_prompt: false, ..opts.clone() };
        let hist_text = self.template.render(history, self.tokenizer.special_tokens(), &hist_opts)?;
        let n_turns = hist_text.matches(end_str).count();
        let n_cached = cached_ids.iter().filter(|&&t| t == end_id).count();
        let cut_reply = cached_ids.last() != Some(&end_id);
        let expected = if cut_reply { n_turns.saturating_sub(1) } else { n_turns };
        if n_turns == 0 || n_cached != expected {
            return Ok(reprefill(format!(
                "the cache holds {n_cached} turn ends ({end_str}) but the history renders {n_turns}"
            )));
        }
        let Some((pos, _)) = full_text.match_indices(end_str).nth(n_turns - 1) else {
            return Ok(reprefill("the full conversation renders fewer turns than its history".into()));
        };
        let mut delta_text = String::new();
        if cut_reply {
            delta_text.push_str(end_str);
        }
        delta_text.push_str(&full_text[pos + end_str.len()..]);
        let delta = self.tokenizer.encode(&delta_text, false)?;
        Ok(PromptPlan::Append { delta, delta_text, cached_tokens: cached_ids.len(), kind: DeltaKind::TurnBoundary, starts_in_thinking })
    }

    /// Parser options for one reply. `include_reasoning` None uses the default of the render
    /// options (false for reasoning effort "none").
    pub fn parser_options(&self, opts: &RenderOptions, starts_in_thinking: bool, include_reasoning: Option<bool>) -> ParserOptions {
        ParserOptions {
            think: self.think,
            tool_calls: self.tool_call_format(opts),
            starts_in_thinking: starts_in_thinking && self.think.is_some(),
            include_reasoning: include_reasoning.unwrap_or_else(|| opts.include_reasoning_default()),
            call_id_prefix: "call_".into(),
        }
    }

    /// A parser for one reply (see [`ChatFormat::parser_options`]).
    pub fn parser(&self, opts: &RenderOptions, starts_in_thinking: bool, include_reasoning: Option<bool>) -> OutputParser {
        OutputParser::new(self.parser_options(opts, starts_in_thinking, include_reasoning))
    }

    /// Thinking tracker with an optional budget; `None` when the model has no think markers.
    /// A budget needs the end marker to be one token.
    pub fn thinking_budget(&self, budget: Option<usize>, starts_in_thinking: bool) -> Result<Option<ThinkingBudget>> {
        let Some(t) = self.think else { return Ok(None) };
        match self.think_ids.1 {
            Some(end) => Ok(Some(ThinkingBudget::new(budget, self.think_ids.0, end, starts_in_thinking))),
            None if budget.is_some() => Err(ChatError::ThinkEndNotSingleToken(t.end.to_owned())),
            None => Ok(None),
        }
    }

    /// Incremental decoder for generated ids (special tokens skipped; think and tool-call markers
    /// are ordinary added tokens and stay).
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        self.tokenizer.stream_decoder(true)
    }
}

fn single_token(tok: &Tokenizer, s: &str) -> Option<u32> {
    let id = tok.token_to_id(s)?;
    (tok.encode(s, false).ok()?.as_slice() == [id]).then_some(id)
}
