//! Multi-turn chat sessions over one loaded [`Model`], sharing the family-independent loop.
//!
//! A session keeps the KV cache on a turn boundary between calls: `start` renders the template
//! once and prefills it (reusing a cached prefix when the new prompt extends what the cache
//! holds), `continue_with` / `continue_tool` append only the new messages' tokens. The
//! `cached_tokens` of a result says how many prompt tokens were served from the cache.
//!
//! Streaming: [`ChatSession::start_stream`] and friends return a [`ChatStream`] iterator of
//! [`StreamEvent`]s (text, thinking, tool calls, then `Done` with the [`ChatResult`]); its
//! [`CancelHandle`] can stop it from another thread. A session is `Send`; several sessions on
//! clones of one `Model` may run on different threads (forward passes are serialized).
use crate::cache::Cache;
use crate::chat::{
    common_prefix_len, ChatEvent, ChatFormat, ChatMessage, OutputParser, ParsedOutput, ParsedToolCall, PromptPlan, ReasoningEffort,
    RenderOptions, StreamDecoder, ThinkingBudget, ToolDefinition,
};
use crate::generate::{generate, CancelHandle, FinishReason, GenerateConfig, Generator, Performance, Speculator};
use crate::media::PreparedMedia;
use crate::model::{load_family, LoadOptions, Model};
use crate::registry::{self, FamilyKind};
use crate::{ModelError, Result};
use sampling::{SamplingConfig, SamplingOverrides};
use std::path::Path;
use std::sync::Arc;

/// Per-call chat settings (defaults follow mlx-node's `ChatConfig`).
#[derive(Debug, Clone)]
pub struct ChatConfig {
    pub max_new_tokens: usize,
    /// Explicit sampling values; unset ones fall back to the model's generation_config.json,
    /// then to the sampling crate's defaults.
    pub sampling: SamplingOverrides,
    pub tools: Option<Vec<ToolDefinition>>,
    pub enable_thinking: Option<bool>,
    pub reasoning_effort: Option<ReasoningEffort>,
    /// Force the think-end token after this many thinking tokens.
    pub thinking_token_budget: Option<usize>,
    /// Report thinking in results (default true; false for reasoning effort "none").
    pub include_reasoning: Option<bool>,
    /// Fill [`ChatResult::performance`].
    pub report_performance: bool,
    /// Reuse the KV cache across turns (default true).
    pub reuse_cache: bool,
    pub prefill_step_size: usize,
}

impl Default for ChatConfig {
    fn default() -> Self {
        ChatConfig {
            max_new_tokens: 2048,
            sampling: SamplingOverrides::default(),
            tools: None,
            enable_thinking: None,
            reasoning_effort: None,
            thinking_token_budget: None,
            include_reasoning: None,
            report_performance: false,
            reuse_cache: true,
            prefill_step_size: 2048,
        }
    }
}

impl ChatConfig {
    fn render_options(&self) -> RenderOptions {
        RenderOptions {
            tools: self.tools.clone(),
            enable_thinking: self.enable_thinking,
            reasoning_effort: self.reasoning_effort,
            ..Default::default()
        }
    }
}

/// The outcome of one assistant turn.
#[derive(Debug, Clone)]
pub struct ChatResult {
    pub text: String,
    pub thinking: Option<String>,
    /// Parsed tool calls, each with a status (malformed ones are reported, not dropped).
    pub tool_calls: Vec<ParsedToolCall>,
    pub finish_reason: FinishReason,
    /// The generated text as decoded, markers included.
    pub raw_text: String,
    /// Generated tokens (stop token excluded).
    pub num_tokens: usize,
    /// Prompt tokens of this turn (cached ones included).
    pub prompt_tokens: usize,
    /// Generated tokens inside think blocks.
    pub reasoning_tokens: usize,
    /// Prompt tokens served from the reused cache.
    pub cached_tokens: usize,
    pub performance: Option<Performance>,
}

/// One streaming event.
#[derive(Debug, Clone)]
pub enum StreamEvent {
    Text(String),
    Thinking(String),
    ToolCall(ParsedToolCall),
    Done(ChatResult),
}

/// A multi-turn conversation with a model.
pub struct ChatSession {
    model: Model,
    format: Arc<ChatFormat>,
    defaults: SamplingOverrides,
    cache: Cache,
    /// Token ids the cache holds, in order.
    cached_ids: Vec<u32>,
    history: Vec<ChatMessage>,
    /// Tool-call ids of this session: `call_<nonce>_<turn>_<n>`, unique across its turns and
    /// (by the random nonce) across sessions.
    call_nonce: String,
    turns: usize,
    /// Speculative decoding for every turn ([`ChatSession::set_speculator`]).
    speculator: Option<Box<dyn Speculator>>,
    /// Where the media tokens in the cache are, and what they were made from.
    cached_media: Vec<MediaSpan>,
}

/// The tokens of one media item in a prompt: `start..end`, and the item's fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MediaSpan {
    start: usize,
    end: usize,
    fingerprint: u64,
}

/// A prompt after media expansion: its ids, where each item's tokens are, and the items.
struct Expanded {
    ids: Vec<u32>,
    spans: Vec<MediaSpan>,
    media: Vec<PreparedMedia>,
}

/// 48 random bits, as hex (std's randomly keyed hasher over a process-wide counter and the clock).
fn session_nonce() -> String {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let h = std::collections::hash_map::RandomState::new().hash_one((COUNTER.fetch_add(1, Ordering::Relaxed), t));
    format!("{:012x}", h & 0xffff_ffff_ffff)
}

impl ChatSession {
    /// A session on `model`, reading tokenizer, chat template and generation defaults from its
    /// checkpoint directory.
    pub fn new(model: Model) -> Result<Self> {
        let format = Arc::new(ChatFormat::from_dir(model.dir())?);
        Self::with_format(model, format)
    }

    /// A session sharing an already-loaded [`ChatFormat`].
    pub fn with_format(model: Model, format: Arc<ChatFormat>) -> Result<Self> {
        let defaults = std::fs::read_to_string(model.dir().join("generation_config.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .map(|v| SamplingOverrides::from_generation_config(&v))
            .unwrap_or_default();
        let cache = model.new_cache();
        Ok(ChatSession {
            model,
            format,
            defaults,
            cache,
            cached_ids: Vec::new(),
            history: Vec::new(),
            call_nonce: session_nonce(),
            turns: 0,
            speculator: None,
            cached_media: Vec::new(),
        })
    }

    pub fn format(&self) -> &Arc<ChatFormat> {
        &self.format
    }
    /// The conversation so far (assistant replies included).
    pub fn history(&self) -> &[ChatMessage] {
        &self.history
    }
    /// Tokens currently in the KV cache.
    pub fn cached_ids(&self) -> &[u32] {
        &self.cached_ids
    }
    /// The model's default sampling settings (from generation_config.json).
    pub fn model_sampling_defaults(&self) -> &SamplingOverrides {
        &self.defaults
    }

    /// Decode every following turn speculatively with `speculator` (`None`: plain decoding).
    /// Streaming and cancellation work as without it; a thinking token budget (which forces
    /// tokens) is refused with it.
    pub fn set_speculator(&mut self, speculator: Option<Box<dyn Speculator>>) {
        self.speculator = speculator;
    }
    /// Counters of the last speculative turn.
    pub fn speculator(&self) -> Option<&dyn Speculator> {
        self.speculator.as_deref()
    }

    /// Forget the conversation and the cache.
    pub fn reset(&mut self) {
        self.cache = self.model.new_cache();
        self.cached_ids.clear();
        self.history.clear();
        self.cached_media.clear();
    }

    /// Whether the model takes images (a vision-language model).
    pub fn supports_images(&self) -> bool {
        self.model.with_runtime(|rt| rt.media().is_some_and(|m| m.placeholder(crate::media::MediaKind::Image).is_some()))
    }

    /// The length of the prompt `messages` render to after each media placeholder is expanded
    /// into its tokens (what [`ChatResult::prompt_tokens`] of a start with them reports). Media
    /// are decoded and preprocessed; no forward pass runs and the cache is untouched.
    pub fn expanded_prompt_tokens(&self, messages: &[ChatMessage], cfg: &ChatConfig) -> Result<usize> {
        self.check_media(messages)?;
        let prompt = self.format.render(messages, &cfg.render_options())?;
        Ok(self.expand(&prompt.ids, messages, 0)?.ids.len())
    }

    /// Preprocess the media of `messages` and expand the placeholders of `ids` (which start at
    /// cache position `at`) into their tokens.
    fn expand(&self, ids: &[u32], messages: &[ChatMessage], at: usize) -> Result<Expanded> {
        let items: Vec<_> = messages.iter().flat_map(|m| m.media()).collect();
        self.model.with_runtime(|rt| {
            let Some(m) = rt.media() else {
                return Ok(Expanded { ids: ids.to_vec(), spans: Vec::new(), media: Vec::new() });
            };
            let media = items.iter().map(|i| m.prepare(i)).collect::<Result<Vec<_>>>()?;
            let out = m.expand(ids, &media)?;
            let marks: Vec<u32> = media.iter().filter_map(|p| m.placeholder(p.kind)).collect();
            let (mut pos, mut next, mut spans) = (at, media.iter(), Vec::new());
            for id in ids {
                if marks.contains(id) {
                    if let Some(p) = next.next() {
                        spans.push(MediaSpan { start: pos, end: pos + p.tokens, fingerprint: p.fingerprint });
                        pos += p.tokens;
                        continue;
                    }
                }
                pos += 1;
            }
            if pos != at + out.len() {
                return Err(ModelError::InvalidInput(format!("media expansion made {} tokens where the items count {}", out.len(), pos - at)));
            }
            Ok(Expanded { ids: out, spans, media })
        })
    }

    /// An error when `messages` carry a media kind the model does not take (checked before the
    /// template renders them).
    fn check_media(&self, messages: &[ChatMessage]) -> Result<()> {
        let Some(item) = messages.iter().flat_map(|m| m.media()).next() else { return Ok(()) };
        self.model.with_runtime(|rt| match rt.media() {
            Some(m) if messages.iter().flat_map(|x| x.media()).all(|i| m.placeholder(i.kind()).is_some()) => Ok(()),
            _ => Err(ModelError::UnsupportedOption(format!("{} takes no {:?} input", rt.info().model_type, item.kind()))),
        })
    }

    /// How many leading cached tokens an expanded prompt with media `spans` may reuse: up to
    /// the first item that is not the cached item at the same place.
    fn media_reuse_limit(&self, spans: &[MediaSpan]) -> usize {
        for (i, s) in spans.iter().enumerate() {
            if self.cached_media.get(i) != Some(s) {
                return s.start;
            }
        }
        self.cached_media.get(spans.len()).map_or(usize::MAX, |s| s.start)
    }

    /// Prefill what of `prompt` the cache lacks (reusing at most `reuse_limit` cached tokens) and
    /// stream the reply.
    fn begin_turn(&mut self, prompt: Expanded, starts_in_thinking: bool, reuse_limit: usize, cfg: &ChatConfig) -> Result<ChatStream<'_>> {
        let reuse = common_prefix_len(&prompt.ids, &self.cached_ids).min(self.media_reuse_limit(&prompt.spans)).min(reuse_limit);
        let cached = self.rewind_to(reuse, prompt.ids.len())?;
        let delta = prompt.ids[cached..].to_vec();
        self.cached_ids = prompt.ids[..cached].to_vec();
        let media: Vec<PreparedMedia> = prompt.spans.iter().zip(prompt.media).filter(|(s, _)| s.start >= cached).map(|(_, m)| m).collect();
        self.cached_media = prompt.spans;
        ChatStream::new(self, delta, media, cached, prompt.ids.len(), starts_in_thinking, cfg)
    }

    /// Start (or restart) a conversation from `messages` and generate the assistant reply.
    pub fn start(&mut self, messages: Vec<ChatMessage>, cfg: &ChatConfig) -> Result<ChatResult> {
        self.start_stream(messages, cfg)?.collect_result()
    }
    /// Append a user message and generate the reply.
    pub fn continue_with(&mut self, user: impl Into<String>, cfg: &ChatConfig) -> Result<ChatResult> {
        self.continue_stream(vec![ChatMessage::user(user)], cfg)?.collect_result()
    }
    /// Append a tool result (marked as an error when `is_error`) and generate the reply.
    pub fn continue_tool(&mut self, tool_call_id: &str, content: impl Into<String>, is_error: bool, cfg: &ChatConfig) -> Result<ChatResult> {
        let m = ChatMessage::tool(tool_call_id, content).with_error(is_error);
        self.continue_stream(vec![m], cfg)?.collect_result()
    }

    /// Streaming [`ChatSession::start`].
    pub fn start_stream(&mut self, messages: Vec<ChatMessage>, cfg: &ChatConfig) -> Result<ChatStream<'_>> {
        self.check_media(&messages)?;
        let opts = cfg.render_options();
        let prompt = self.format.render(&messages, &opts)?;
        let expanded = self.expand(&prompt.ids, &messages, 0)?;
        self.history = messages;
        self.begin_turn(expanded, prompt.starts_in_thinking, if cfg.reuse_cache { usize::MAX } else { 0 }, cfg)
    }

    /// Streaming continuation with any new messages (user turns or tool results).
    pub fn continue_stream(&mut self, new_messages: Vec<ChatMessage>, cfg: &ChatConfig) -> Result<ChatStream<'_>> {
        if self.history.is_empty() {
            return Err(ModelError::InvalidInput("continue: the session has no conversation yet; call start first".into()));
        }
        self.check_media(&new_messages)?;
        let opts = cfg.render_options();
        let plan = if cfg.reuse_cache && !self.cached_ids.is_empty() {
            self.format.plan_continuation(&self.history, &self.cached_ids, &new_messages, &opts)?
        } else {
            let mut all = self.history.clone();
            all.extend(new_messages.iter().cloned());
            PromptPlan::Reprefill { prompt: self.format.render(&all, &opts)?, common_prefix: 0, reason: "cache reuse is off".into() }
        };
        // Expanded before the history grows: a refused turn (media placeholders the template did
        // not write, say) leaves the session as it was.
        match plan {
            PromptPlan::Append { delta, cached_tokens, starts_in_thinking, .. } => {
                // The delta holds the placeholders of the new messages only.
                let e = self.expand(&delta, &new_messages, cached_tokens)?;
                self.history.extend(new_messages);
                let total = cached_tokens + e.ids.len();
                self.cached_media.extend(e.spans);
                ChatStream::new(self, e.ids, e.media, cached_tokens, total, starts_in_thinking, cfg)
            }
            PromptPlan::Reprefill { prompt, .. } => {
                let all: Vec<ChatMessage> = self.history.iter().chain(&new_messages).cloned().collect();
                let e = self.expand(&prompt.ids, &all, 0)?;
                self.history = all;
                self.begin_turn(e, prompt.starts_in_thinking, if cfg.reuse_cache { usize::MAX } else { 0 }, cfg)
            }
        }
    }

    /// Keep the first `keep` cached tokens (at least one prompt token must remain to prefill,
    /// so at most `prompt_len - 1`). Caches that cannot be trimmed (recurrent layers) are reset
    /// unless they already hold exactly the kept prefix. Returns how many tokens are kept.
    fn rewind_to(&mut self, keep: usize, prompt_len: usize) -> Result<usize> {
        let keep = keep.min(prompt_len.saturating_sub(1));
        let have = self.cached_ids.len();
        if keep == have {
            return Ok(keep);
        }
        if keep > 0 && self.cache.trim(have - keep).is_ok() {
            self.cached_ids.truncate(keep);
            return Ok(keep);
        }
        self.cache = self.model.new_cache();
        self.cached_ids.clear();
        Ok(0)
    }
}

/// A streaming assistant turn; iterate it for [`StreamEvent`]s. Dropping it early leaves the
/// session consistent (as if cancelled).
pub struct ChatStream<'a> {
    gen: Option<Generator<'a>>,
    cached_ids: &'a mut Vec<u32>,
    history: &'a mut Vec<ChatMessage>,
    decoder: StreamDecoder<'a>,
    parser: OutputParser,
    budget: Option<ThinkingBudget>,
    queue: std::collections::VecDeque<StreamEvent>,
    generated: Vec<u32>,
    cached_tokens: usize,
    prompt_tokens: usize,
    report_performance: bool,
    cancel: CancelHandle,
    done: bool,
}

impl<'a> ChatStream<'a> {
    /// `media`: the items whose tokens are in `delta`, in order.
    fn new(s: &'a mut ChatSession, delta: Vec<u32>, media: Vec<PreparedMedia>, cached: usize, prompt_tokens: usize, starts_in_thinking: bool, cfg: &ChatConfig) -> Result<Self> {
        let opts = cfg.render_options();
        let sampling = SamplingConfig::resolve(&cfg.sampling, &s.defaults).map_err(|e| ModelError::InvalidInput(e.to_string()))?;
        let mut stop = s.format.stop_token_ids();
        for &e in &s.model.info().eos_token_ids {
            if !stop.contains(&e) {
                stop.push(e);
            }
        }
        let mut gcfg = GenerateConfig { max_new_tokens: cfg.max_new_tokens, sampling, prefill_step_size: cfg.prefill_step_size, stop_tokens: Some(stop), context: Vec::new() };
        let mut popts = s.format.parser_options(&opts, starts_in_thinking, cfg.include_reasoning);
        popts.call_id_prefix = format!("call_{}_{}_", s.call_nonce, s.turns);
        s.turns += 1;
        if s.speculator.is_some() && cfg.thinking_token_budget.is_some() {
            return Err(ModelError::UnsupportedOption("a thinking token budget forces tokens, which speculative decoding does not support".into()));
        }
        // Speculative drafts (MTP heads, draft models) see token positions only: turns of a
        // conversation with media decode plainly.
        let plain = !media.is_empty() || !s.cached_media.is_empty();
        let ChatSession { model, format, cache, cached_ids, history, speculator, .. } = s;
        let format: &'a ChatFormat = format;
        // The prompt delta joins the cached ids now; generated ids follow as they come.
        gcfg.context = cached_ids.clone();
        cached_ids.extend_from_slice(&delta);
        let budget = format.thinking_budget(cfg.thinking_token_budget, starts_in_thinking)?;
        let gen = generate(model, cache, &delta, gcfg)?.with_media(media);
        let gen = match speculator.as_deref_mut() {
            Some(sp) if !plain => gen.with_speculator(sp),
            _ => gen,
        };
        let cancel = gen.cancel_handle();
        Ok(ChatStream {
            gen: Some(gen),
            cached_ids,
            history,
            decoder: format.stream_decoder(),
            parser: crate::chat::OutputParser::new(popts),
            budget,
            queue: Default::default(),
            generated: Vec::new(),
            cached_tokens: cached,
            prompt_tokens,
            report_performance: cfg.report_performance,
            cancel,
            done: false,
        })
    }

    /// Stops the stream (from any thread); the turn ends with finish reason `cancelled`.
    pub fn cancel_handle(&self) -> CancelHandle {
        self.cancel.clone()
    }

    /// Drain the stream, returning the final result.
    pub fn collect_result(mut self) -> Result<ChatResult> {
        loop {
            match self.next() {
                Some(Ok(StreamEvent::Done(r))) => return Ok(r),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => return Err(ModelError::InvalidInput("chat stream ended without a result".into())),
            }
        }
    }

    fn push_events(&mut self, events: Vec<ChatEvent>) {
        for e in events {
            self.queue.push_back(match e {
                ChatEvent::TextDelta(t) => StreamEvent::Text(t),
                ChatEvent::ThinkingDelta(t) => StreamEvent::Thinking(t),
                ChatEvent::ToolCall(c) => StreamEvent::ToolCall(c),
            });
        }
    }

    fn step(&mut self) -> Result<()> {
        let gen = self.gen.as_mut().expect("called while running");
        if let Some(forced) = self.budget.as_ref().and_then(|b| b.forced_token()) {
            gen.force_next(forced);
        }
        match gen.next() {
            Some(t) => {
                let id = t?.id;
                self.generated.push(id);
                if let Some(b) = self.budget.as_mut() {
                    b.observe(id);
                }
                if let Some(text) = self.decoder.step(id)? {
                    let ev = self.parser.push(&text);
                    self.push_events(ev);
                }
            }
            None => self.finish()?,
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        let gen = self.gen.take().expect("finish once");
        let mut reason = gen.finish_reason().unwrap_or(FinishReason::Stop);
        let stop = gen.stop_token();
        let perf = self.report_performance.then(|| gen.performance());
        drop(gen);
        let tail = self.decoder.finish()?;
        let mut ev = self.parser.push(&tail);
        ev.extend(self.parser.finish());
        self.push_events(ev);
        let out: ParsedOutput = self.parser.output();
        if reason == FinishReason::Stop && !out.tool_calls.is_empty() {
            reason = FinishReason::ToolCalls;
        }
        self.cached_ids.extend_from_slice(&self.generated);
        self.cached_ids.extend(stop);
        self.history.push(out.to_assistant_message());
        let result = ChatResult {
            text: out.text,
            thinking: out.thinking,
            tool_calls: out.tool_calls,
            finish_reason: reason,
            raw_text: out.raw_text,
            num_tokens: self.generated.len(),
            prompt_tokens: self.prompt_tokens,
            reasoning_tokens: self.budget.as_ref().map_or(0, |b| b.thinking_tokens()),
            cached_tokens: self.cached_tokens,
            performance: perf,
        };
        self.queue.push_back(StreamEvent::Done(result));
        self.done = true;
        Ok(())
    }
}

impl Iterator for ChatStream<'_> {
    type Item = Result<StreamEvent>;
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(e) = self.queue.pop_front() {
                return Some(Ok(e));
            }
            if self.done {
                return None;
            }
            if let Err(e) = self.step() {
                // The cache may hold a partial step: leave a sentinel id no prompt can match, so
                // the next turn finds no reusable prefix and starts from a fresh cache.
                self.done = true;
                self.gen = None;
                self.cached_ids.clear();
                self.cached_ids.push(u32::MAX);
                return Some(Err(e));
            }
        }
    }
}

impl Drop for ChatStream<'_> {
    fn drop(&mut self) {
        if !self.done && self.gen.is_some() {
            self.cancel.cancel();
            let _ = self.step();
        }
    }
}

#[cfg(test)]
mod call_id_tests {
    #[test]
    fn session_nonces_are_distinct_hex() {
        let a: Vec<String> = (0..64).map(|_| super::session_nonce()).collect();
        let set: std::collections::HashSet<&String> = a.iter().collect();
        assert_eq!(set.len(), a.len());
        assert!(a.iter().all(|n| n.len() == 12 && n.chars().all(|c| c.is_ascii_hexdigit())));
    }
}

/// Load the checkpoint in `dir` as a [`ChatSession`]; embedding models are refused.
pub fn load_session(dir: impl AsRef<Path>, opts: &LoadOptions) -> Result<ChatSession> {
    let dir = dir.as_ref();
    let family = registry::detect_model_type(dir)?;
    if family.kind == FamilyKind::Embedding {
        return Err(ModelError::WrongKind("load_session: embedding models (Harrier) cannot be wrapped in a ChatSession".into()));
    }
    ChatSession::new(load_family(dir, family, opts)?.into_lm()?)
}
