//! Thinking token budget: count the tokens generated inside a think block and say when the
//! think-end token must be forced.

/// Tracks thinking over generated token ids.
///
/// Session loop, per decode step:
/// ```text
/// let token = match budget.forced_token() { Some(t) => t, None => sample(logits) };
/// budget.observe(token);
/// ```
/// With a budget of N, once N tokens were generated inside the think block the next token is the
/// think-end id. `None` as budget never forces but still counts (`thinking_tokens` gives the
/// reasoning token count of the result).
#[derive(Debug, Clone)]
pub struct ThinkingBudget {
    budget: Option<usize>,
    start_id: Option<u32>,
    end_id: u32,
    in_thinking: bool,
    /// Tokens generated inside think blocks (markers excluded), over the whole output.
    total: usize,
    /// Tokens of the current think block.
    current: usize,
    forced: usize,
}

impl ThinkingBudget {
    /// `start_id`/`end_id`: the think markers' token ids (`start_id` None when the model never
    /// emits it); `starts_in_thinking`: the prompt opened the think block.
    pub fn new(budget: Option<usize>, start_id: Option<u32>, end_id: u32, starts_in_thinking: bool) -> Self {
        ThinkingBudget { budget, start_id, end_id, in_thinking: starts_in_thinking, total: 0, current: 0, forced: 0 }
    }

    /// The id to emit instead of sampling, when the budget is spent.
    pub fn forced_token(&self) -> Option<u32> {
        match self.budget {
            Some(n) if self.in_thinking && self.current >= n => Some(self.end_id),
            _ => None,
        }
    }

    /// Record the token that was emitted (sampled or forced).
    pub fn observe(&mut self, token: u32) {
        if self.in_thinking {
            if token == self.end_id {
                if self.budget.is_some_and(|n| self.current >= n) {
                    self.forced += 1;
                }
                self.in_thinking = false;
                self.current = 0;
            } else {
                self.current += 1;
                self.total += 1;
            }
        } else if Some(token) == self.start_id {
            self.in_thinking = true;
            self.current = 0;
        }
    }

    pub fn in_thinking(&self) -> bool {
        self.in_thinking
    }

    /// Thinking tokens generated so far (think markers not counted).
    pub fn thinking_tokens(&self) -> usize {
        self.total
    }

    /// How many times the end marker came from the budget.
    pub fn times_forced(&self) -> usize {
        self.forced
    }

    pub fn end_id(&self) -> u32 {
        self.end_id
    }
}
