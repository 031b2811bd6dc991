//! [`SamplingConfig`]: every knob with its default, validation, and the merge of model defaults
//! under request values ([`SamplingOverrides`]).
//!
//! Defaults follow mlx-node 0.0.8's `ChatConfig` / `GenerationConfig` declarations:
//! repetition context 256, presence and frequency context 20, presence and frequency penalty
//! 0 (disabled), and the stop guards `maxConsecutiveTokens`, `maxNgramRepeats`, `ngramSize` all
//! 0 (disabled; "opt in with a positive value"). The diff does not restate the unchanged
//! sampler defaults; those are mlx-node's `SamplingConfig::default()` and `extract_chat_params`
//! (temperature 1.0, top_k 0 = disabled, top_p 1.0 = disabled, min_p 0 = disabled,
//! repetition penalty 1.0 = disabled), which are also the neutral values of mlx-lm's
//! `make_sampler`/`make_logits_processors` apart from the temperature.
use crate::error::{Result, SamplingError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Resolved sampling settings. `Default` is the seed defaults (see the module docs): plain
/// temperature-1 sampling, no penalties, no guards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingConfig {
    /// Softmax temperature; `0` = greedy (argmax). Default 1.0.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; `0` = disabled, `>= vocab` = no-op. Default 0.
    pub top_k: u32,
    /// Nucleus: keep the smallest set of most likely tokens whose mass reaches `top_p`, in
    /// `(0, 1]`; `1` = disabled. Default 1.0.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p * p_max`, in `[0, 1]`; `0` = disabled.
    pub min_p: f32,
    /// Multiplicative penalty on tokens seen in the last `repetition_context_size` tokens
    /// (positive logits divided by it, negative ones multiplied); `1` = disabled.
    pub repetition_penalty: f32,
    /// Window of the repetition penalty, in tokens. Default 256.
    pub repetition_context_size: usize,
    /// OpenAI presence penalty: `logit -= presence_penalty` for tokens seen at least once in the
    /// last `presence_context_size` tokens. Default 0 (disabled).
    pub presence_penalty: f32,
    /// Window of the presence penalty. Default 20.
    pub presence_context_size: usize,
    /// OpenAI frequency penalty: `logit -= frequency_penalty * count` over the last
    /// `frequency_context_size` tokens. Default 0 (disabled).
    pub frequency_penalty: f32,
    /// Window of the frequency penalty. Default 20.
    pub frequency_context_size: usize,
    /// Added to the logits of the given token ids before anything else (`-inf` bans a token).
    pub logit_bias: BTreeMap<u32, f32>,
    /// Stop guard: finish with "repetition" once the same token was produced this many times in
    /// a row; `0` = disabled (default), otherwise `>= 2`.
    pub max_consecutive_tokens: usize,
    /// Stop guard: finish with "repetition" once an n-gram (every size `2..=ngram_size`) was
    /// produced this many times back to back; `0` = disabled (default), otherwise `>= 2`.
    pub max_ngram_repeats: usize,
    /// Largest pattern size the n-gram guard checks; `0` = disabled (default), otherwise `>= 2`.
    pub ngram_size: usize,
    /// Seed of the sampler's key; `None` = seeded from the clock.
    pub seed: Option<u64>,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_context_size: 256,
            presence_penalty: 0.0,
            presence_context_size: 20,
            frequency_penalty: 0.0,
            frequency_context_size: 20,
            logit_bias: BTreeMap::new(),
            max_consecutive_tokens: 0,
            max_ngram_repeats: 0,
            ngram_size: 0,
            seed: None,
        }
    }
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $field:ident: $t:ty;)*) => {$(
        $(#[$doc])*
        #[must_use]
        pub fn $name(mut self, v: $t) -> Self {
            self.$field = v;
            self
        }
    )*};
}

impl SamplingConfig {
    /// Greedy decoding (temperature 0), everything else default.
    pub fn greedy() -> Self {
        SamplingConfig { temperature: 0.0, ..Default::default() }
    }

    setters! {
        with_temperature: temperature: f32;
        with_top_k: top_k: u32;
        with_top_p: top_p: f32;
        with_min_p: min_p: f32;
        with_repetition_penalty: repetition_penalty: f32;
        with_repetition_context_size: repetition_context_size: usize;
        with_presence_penalty: presence_penalty: f32;
        with_presence_context_size: presence_context_size: usize;
        with_frequency_penalty: frequency_penalty: f32;
        with_frequency_context_size: frequency_context_size: usize;
        with_logit_bias: logit_bias: BTreeMap<u32, f32>;
        with_max_consecutive_tokens: max_consecutive_tokens: usize;
        with_max_ngram_repeats: max_ngram_repeats: usize;
        with_ngram_size: ngram_size: usize;
    }

    /// Fix the sampler's seed.
    #[must_use]
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Whether this config decodes greedily (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The seed defaults, overridden by the model's defaults, overridden by the request's
    /// explicit values; then validated.
    ///
    /// ```
    /// use sampling::{SamplingConfig, SamplingOverrides};
    /// // Gemma 4 ships temperature 1.0, top_k 64, top_p 0.95 in generation_config.json.
    /// let model = SamplingOverrides { temperature: Some(1.0), top_k: Some(64), top_p: Some(0.95), ..Default::default() };
    /// let request = SamplingOverrides { temperature: Some(0.3), ..Default::default() };
    /// let cfg = SamplingConfig::resolve(&request, &model).unwrap();
    /// assert_eq!((cfg.temperature, cfg.top_k, cfg.top_p), (0.3, 64, 0.95));
    /// ```
    pub fn resolve(request: &SamplingOverrides, model_defaults: &SamplingOverrides) -> Result<Self> {
        let mut cfg = SamplingConfig::default();
        model_defaults.apply_to(&mut cfg);
        request.apply_to(&mut cfg);
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check every setting; see [`SamplingError`] for the rules.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(SamplingError::Temperature(t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(SamplingError::MinP(self.min_p));
        }
        let rp = self.repetition_penalty;
        if !rp.is_finite() || rp <= 0.0 {
            return Err(SamplingError::RepetitionPenalty(rp));
        }
        for (field, value) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !value.is_finite() {
                return Err(SamplingError::NotFinite { field, value });
            }
        }
        for (&token, &value) in &self.logit_bias {
            if value.is_nan() || value == f32::INFINITY {
                return Err(SamplingError::LogitBias { token, value });
            }
        }
        for (name, v) in [
            ("max_consecutive_tokens", self.max_consecutive_tokens),
            ("max_ngram_repeats", self.max_ngram_repeats),
            ("ngram_size", self.ngram_size),
        ] {
            if v == 1 {
                return Err(SamplingError::StopGuard(format!("{name} must be 0 (disabled) or >= 2, got 1")));
            }
        }
        Ok(())
    }
}

/// Optional values of the sampling knobs: a request's explicit settings, or a model's defaults.
/// `None` leaves the value underneath in place (see [`SamplingConfig::resolve`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[allow(missing_docs)]
pub struct SamplingOverrides {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_context_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_context_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_context_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<u32, f32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_consecutive_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_ngram_repeats: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ngram_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

impl SamplingOverrides {
    /// Write every `Some` field into `cfg`.
    pub fn apply_to(&self, cfg: &mut SamplingConfig) {
        macro_rules! put {
            ($($f:ident),*) => {$( if let Some(v) = &self.$f { cfg.$f = v.clone(); } )*};
        }
        put!(temperature, top_k, top_p, min_p, repetition_penalty, repetition_context_size, presence_penalty,
             presence_context_size, frequency_penalty, frequency_context_size, logit_bias,
             max_consecutive_tokens, max_ngram_repeats, ngram_size);
        if self.seed.is_some() {
            cfg.seed = self.seed;
        }
    }

    /// A model's defaults from a Hugging Face `generation_config.json`: `temperature`, `top_k`,
    /// `top_p`, `min_p`, `repetition_penalty`. `"do_sample": false` means greedy in
    /// transformers, so it becomes temperature 0. Missing or mistyped keys are left `None`
    /// (validation happens in [`SamplingConfig::resolve`]).
    pub fn from_generation_config(json: &serde_json::Value) -> Self {
        let f = |k: &str| json.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);
        let mut o = SamplingOverrides {
            temperature: f("temperature"),
            top_k: json.get("top_k").and_then(|v| v.as_u64()).and_then(|v| u32::try_from(v).ok()),
            top_p: f("top_p"),
            min_p: f("min_p"),
            repetition_penalty: f("repetition_penalty"),
            ..Default::default()
        };
        if json.get("do_sample").and_then(|v| v.as_bool()) == Some(false) {
            o.temperature = Some(0.0);
        }
        o
    }
}
