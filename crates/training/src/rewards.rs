//! Reward functions for GRPO: the built-in [`ToolUseReward`], [`XmlFormatReward`],
//! [`LengthReward`] and [`JsonSchemaReward`] (mlx-node's scoring rules) and user closures,
//! weighted in a [`RewardSet`].
//!
//! A function scores one completion of a prompt; `None` means it does not apply (the completion
//! is not scored by it; see [`crate::grpo::GrpoBatch::total_rewards`]). The step's reward of a
//! completion is the weighted sum of its scores (TRL's combination; mlx-node's registry divides
//! that sum by the weights' sum, which group-scaled advantages do not see).
use crate::error::{Result, TrainError};

/// A reward function: scores a completion (text) of a prompt (text).
pub trait RewardFunction: Send {
    fn name(&self) -> &str;
    /// The score, or `None` when the function does not apply to this completion.
    fn score(&self, prompt: &str, completion: &str) -> Option<f64>;
}

/// Tool-call format: the first `<tool_call>...</tool_call>` span holds either
/// `<name>N</name>` (and `<arguments>...</arguments>`) or Qwen's JSON
/// `{"name": N, "arguments": {...}}`. Scores: 1.0 for an allowed tool with arguments, 0.7
/// without them, -0.5 for an unknown tool, a malformed or unbalanced call; with no call, 0.0 when
/// a call is required and 0.5 when not. Defaults: tools `search`, `calculate`, `code`; required.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolUseReward {
    pub allowed_tools: Vec<String>,
    pub required: bool,
}

impl Default for ToolUseReward {
    fn default() -> Self {
        ToolUseReward {
            allowed_tools: ["search", "calculate", "code"].map(String::from).to_vec(),
            required: true,
        }
    }
}

const INVALID_TOOL_CALL: f64 = -0.5;

fn between<'a>(text: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let s = text.find(open)? + open.len();
    let e = text[s..].find(close)? + s;
    Some(&text[s..e])
}

impl RewardFunction for ToolUseReward {
    fn name(&self) -> &str {
        "tool_use"
    }

    fn score(&self, _prompt: &str, completion: &str) -> Option<f64> {
        let (open, close) = (
            completion.find("<tool_call>"),
            completion.find("</tool_call>"),
        );
        let body = match (open, close) {
            (None, None) => return Some(if self.required { 0.0 } else { 0.5 }),
            (Some(s), Some(e)) if e >= s + "<tool_call>".len() => {
                &completion[s + "<tool_call>".len()..e]
            }
            _ => return Some(INVALID_TOOL_CALL),
        };
        let (name, has_args) = if let Some(n) = between(body, "<name>", "</name>") {
            (
                n.trim().to_string(),
                between(body, "<arguments>", "</arguments>").is_some(),
            )
        } else {
            match serde_json::from_str::<serde_json::Value>(body.trim()) {
                Ok(v) => match v.get("name").and_then(|n| n.as_str()) {
                    Some(n) => (
                        n.to_string(),
                        v.get("arguments").is_some_and(|a| !a.is_null()),
                    ),
                    None => return Some(INVALID_TOOL_CALL),
                },
                Err(_) => return Some(INVALID_TOOL_CALL),
            }
        };
        if !self.allowed_tools.contains(&name) {
            return Some(INVALID_TOOL_CALL);
        }
        Some(if has_args { 1.0 } else { 0.7 })
    }
}

/// Required XML tags: the fraction of required tags whose `<t>` and `</t>` counts are equal and
/// non-zero, minus 0.3 per tag whose counts differ, clamped to [0, 1] (1.0 when no tag is
/// required). Default tags: `thinking`, `answer`.
#[derive(Debug, Clone, PartialEq)]
pub struct XmlFormatReward {
    pub required_tags: Vec<String>,
}

impl Default for XmlFormatReward {
    fn default() -> Self {
        XmlFormatReward {
            required_tags: vec!["thinking".into(), "answer".into()],
        }
    }
}

impl RewardFunction for XmlFormatReward {
    fn name(&self) -> &str {
        "xml_format"
    }

    fn score(&self, _prompt: &str, completion: &str) -> Option<f64> {
        if self.required_tags.is_empty() {
            return Some(1.0);
        }
        let (mut balanced, mut unbalanced) = (0usize, 0usize);
        for tag in &self.required_tags {
            let opens = completion.matches(&format!("<{tag}>")).count();
            let closes = completion.matches(&format!("</{tag}>")).count();
            if opens == closes && opens > 0 {
                balanced += 1;
            } else if opens != closes {
                unbalanced += 1;
            }
        }
        Some(
            (balanced as f64 / self.required_tags.len() as f64 - 0.3 * unbalanced as f64)
                .clamp(0.0, 1.0),
        )
    }
}

/// Completion length in characters (or whitespace-separated words): 1.0 within
/// `[min_length, max_length]`, `length / min_length` below, and above
/// `1 - 0.5 min(1, (length - max_length) / max_length)`. Defaults: 50 to 500 characters.
#[derive(Debug, Clone, PartialEq)]
pub struct LengthReward {
    pub min_length: usize,
    pub max_length: usize,
    pub use_chars: bool,
}

impl Default for LengthReward {
    fn default() -> Self {
        LengthReward {
            min_length: 50,
            max_length: 500,
            use_chars: true,
        }
    }
}

impl LengthReward {
    /// A length reward; `max_length` must be >= 1 and >= `min_length`.
    pub fn new(min_length: usize, max_length: usize, use_chars: bool) -> Result<Self> {
        if max_length == 0 || max_length < min_length {
            return Err(TrainError::Config(format!("length reward: need 1 <= max_length and min_length <= max_length, got {min_length}..{max_length}")));
        }
        Ok(LengthReward {
            min_length,
            max_length,
            use_chars,
        })
    }
}

impl RewardFunction for LengthReward {
    fn name(&self) -> &str {
        "length"
    }

    fn score(&self, _prompt: &str, completion: &str) -> Option<f64> {
        let n = if self.use_chars {
            completion.chars().count()
        } else {
            completion.split_whitespace().count()
        };
        Some(if n < self.min_length {
            n as f64 / self.min_length as f64
        } else if n > self.max_length {
            1.0 - 0.5 * ((n - self.max_length) as f64 / self.max_length.max(1) as f64).min(1.0)
        } else {
            1.0
        })
    }
}

/// JSON with required top-level fields: the span from the first `{` or `[` to the last matching
/// closing bracket is parsed; no such span scores 0.0, one that does not parse 0.2, otherwise
/// the fraction of `required_fields` that are keys of the top-level object (1.0 when none are
/// required). Default: no required field.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct JsonSchemaReward {
    pub required_fields: Vec<String>,
}

impl RewardFunction for JsonSchemaReward {
    fn name(&self) -> &str {
        "json_schema"
    }

    fn score(&self, _prompt: &str, completion: &str) -> Option<f64> {
        let start = match (completion.find('{'), completion.find('[')) {
            (Some(o), Some(a)) => o.min(a),
            (Some(o), None) => o,
            (None, Some(a)) => a,
            (None, None) => return Some(0.0),
        };
        let close = if completion[start..].starts_with('{') {
            '}'
        } else {
            ']'
        };
        let Some(end) = completion[start..].rfind(close) else {
            return Some(0.0);
        };
        let value: serde_json::Value = match serde_json::from_str(&completion[start..=start + end])
        {
            Ok(v) => v,
            Err(_) => return Some(0.2),
        };
        if self.required_fields.is_empty() {
            return Some(1.0);
        }
        let found = self
            .required_fields
            .iter()
            .filter(|f| value.get(f.as_str()).is_some())
            .count();
        Some(found as f64 / self.required_fields.len() as f64)
    }
}

/// A user reward closure: `f(prompt, completion)`, `None` when it does not apply.
pub type RewardFn = Box<dyn Fn(&str, &str) -> Option<f64> + Send>;

/// A user reward: a named closure.
pub struct FnReward {
    name: String,
    f: RewardFn,
}

impl FnReward {
    pub fn new(
        name: impl Into<String>,
        f: impl Fn(&str, &str) -> Option<f64> + Send + 'static,
    ) -> Self {
        FnReward {
            name: name.into(),
            f: Box::new(f),
        }
    }
}

impl RewardFunction for FnReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, prompt: &str, completion: &str) -> Option<f64> {
        (self.f)(prompt, completion)
    }
}

/// Weighted reward functions.
#[derive(Default)]
pub struct RewardSet {
    functions: Vec<(Box<dyn RewardFunction>, f64)>,
}

impl RewardSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add `f` with `weight` (finite). Names must be unique.
    pub fn add(&mut self, f: impl RewardFunction + 'static, weight: f64) -> Result<&mut Self> {
        if !weight.is_finite() {
            return Err(TrainError::Config(format!(
                "reward {}: weight {weight}",
                f.name()
            )));
        }
        if self.functions.iter().any(|(g, _)| g.name() == f.name()) {
            return Err(TrainError::Config(format!(
                "reward {} added twice",
                f.name()
            )));
        }
        self.functions.push((Box::new(f), weight));
        Ok(self)
    }

    /// Add a closure `f(prompt, completion)` named `name` with `weight`.
    pub fn add_fn(
        &mut self,
        name: &str,
        weight: f64,
        f: impl Fn(&str, &str) -> Option<f64> + Send + 'static,
    ) -> Result<&mut Self> {
        self.add(FnReward::new(name, f), weight)
    }

    pub fn is_empty(&self) -> bool {
        self.functions.is_empty()
    }

    pub fn names(&self) -> Vec<String> {
        self.functions
            .iter()
            .map(|(f, _)| f.name().to_string())
            .collect()
    }

    pub fn weights(&self) -> Vec<f64> {
        self.functions.iter().map(|(_, w)| *w).collect()
    }

    /// Every function's score of `completion` (NaN where one does not apply or returns a
    /// non-finite value).
    pub fn score(&self, prompt: &str, completion: &str) -> Vec<f64> {
        self.functions
            .iter()
            .map(|(f, _)| {
                f.score(prompt, completion)
                    .filter(|s| s.is_finite())
                    .unwrap_or(f64::NAN)
            })
            .collect()
    }

    /// The weighted sum of `scores` (as [`RewardSet::score`] returns them), NaN ones left out;
    /// NaN when all are.
    pub fn combine(&self, scores: &[f64]) -> f64 {
        if scores.iter().all(|s| s.is_nan()) {
            return f64::NAN;
        }
        scores
            .iter()
            .zip(self.weights())
            .filter(|(s, _)| !s.is_nan())
            .map(|(s, w)| s * w)
            .sum()
    }
}
