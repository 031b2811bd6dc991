//! Constrained BIOES decoding: the tag set read from `id2label`, the calibrated transition biases,
//! Viterbi over log-probability emissions, and span extraction from the decoded path.
use super::PrivacyError;

/// One tag of the BIOES scheme; the `usize` indexes [`TagSet::entities`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tag {
    /// Outside any entity (background).
    O,
    /// First token of a multi-token entity.
    B(usize),
    /// Inner token of a multi-token entity.
    I(usize),
    /// Last token of a multi-token entity.
    E(usize),
    /// A single-token entity.
    S(usize),
}

impl Tag {
    /// Whether a path may begin with this tag (`O`, `B`, `S`).
    pub fn can_start(self) -> bool {
        matches!(self, Tag::O | Tag::B(_) | Tag::S(_))
    }
    /// Whether a path may end with this tag (`O`, `E`, `S`).
    pub fn can_end(self) -> bool {
        matches!(self, Tag::O | Tag::E(_) | Tag::S(_))
    }
}

/// The classifier's output classes as BIOES tags, in logit order.
#[derive(Debug, Clone, PartialEq)]
pub struct TagSet {
    /// `tags[i]` is class `i`.
    pub tags: Vec<Tag>,
    /// Entity names (without prefix), in order of first appearance.
    pub entities: Vec<String>,
    /// The labels as written in `id2label`.
    pub labels: Vec<String>,
}

impl TagSet {
    /// Parse `id2label` given as `(id, label)` pairs: ids must be exactly `0..n`, exactly one label
    /// is `O`, every other is `B-`, `I-`, `E-` or `S-` followed by a non-empty name, no label
    /// repeats, and every entity name has all four prefixes.
    pub fn from_id2label(pairs: &[(usize, String)]) -> Result<Self, PrivacyError> {
        let bad = |reason: String| PrivacyError::Labels(reason);
        let n = pairs.len();
        if n == 0 {
            return Err(bad("id2label is empty".into()));
        }
        let mut labels: Vec<Option<String>> = vec![None; n];
        for (id, label) in pairs {
            let slot = labels.get_mut(*id).ok_or_else(|| bad(format!("id {id} is out of range: ids must be 0..{n} (dense)")))?;
            if slot.is_some() {
                return Err(bad(format!("id {id} appears twice")));
            }
            *slot = Some(label.clone());
        }
        let labels: Vec<String> = labels.into_iter().collect::<Option<Vec<_>>>().ok_or_else(|| bad(format!("ids are not dense 0..{n}")))?;
        let mut entities: Vec<String> = Vec::new();
        let mut tags = Vec::with_capacity(n);
        let mut seen = std::collections::HashSet::new();
        for label in &labels {
            if !seen.insert(label.as_str()) {
                return Err(bad(format!("label {label:?} appears twice")));
            }
            if label == "O" {
                tags.push(Tag::O);
                continue;
            }
            let (prefix, name) = match label.split_once('-') {
                Some((p, name)) if !name.is_empty() => (p, name),
                _ => return Err(bad(format!("label {label:?} is neither \"O\" nor PREFIX-NAME with a BIOES prefix"))),
            };
            let k = match entities.iter().position(|e| e == name) {
                Some(k) => k,
                None => {
                    entities.push(name.to_string());
                    entities.len() - 1
                }
            };
            tags.push(match prefix {
                "B" => Tag::B(k),
                "I" => Tag::I(k),
                "E" => Tag::E(k),
                "S" => Tag::S(k),
                other => return Err(bad(format!("label {label:?} has prefix {other:?}: not one of B, I, E, S"))),
            });
        }
        let n_o = tags.iter().filter(|t| **t == Tag::O).count();
        if n_o != 1 {
            return Err(bad(format!("expected exactly one \"O\" label, found {n_o}")));
        }
        for (k, name) in entities.iter().enumerate() {
            for (p, make) in [("B", Tag::B as fn(usize) -> Tag), ("I", Tag::I), ("E", Tag::E), ("S", Tag::S)] {
                if !tags.contains(&make(k)) {
                    return Err(bad(format!("entity {name:?} has no {p}-{name} label (BIOES needs all four)")));
                }
            }
        }
        Ok(TagSet { tags, entities, labels })
    }

    pub fn len(&self) -> usize {
        self.tags.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tags.is_empty()
    }
}

/// One value per transition class of the BIOES decoder: the biases themselves
/// ([`Calibration`]) or per-call overrides of them ([`crate::privacy::CalibrationOverrides`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TransitionBiases<T> {
    /// `O → O`.
    pub background_stay: T,
    /// `O → B-*`, `O → S-*`.
    pub background_to_start: T,
    /// `E-* → O`, `S-* → O`.
    pub end_to_background: T,
    /// `E-* → B-*`, `E-* → S-*`, `S-* → B-*`, `S-* → S-*` (back-to-back entities).
    pub end_to_start: T,
    /// `B-x → I-x`, `I-x → I-x`.
    pub inside_to_continue: T,
    /// `B-x → E-x`, `I-x → E-x`.
    pub inside_to_end: T,
}

/// The six transition biases of the BIOES decoder (`viterbi_calibration.json`'s
/// `operating_points.default.biases`). Each is added to the log-score of the transitions it names;
/// transitions BIOES forbids are never taken.
pub type Calibration = TransitionBiases<f32>;

impl<T: Copy> TransitionBiases<T> {
    /// The six values in [`Calibration::KEYS`] order.
    pub fn values(&self) -> [T; 6] {
        [self.background_stay, self.background_to_start, self.end_to_background, self.end_to_start, self.inside_to_continue, self.inside_to_end]
    }

    pub(crate) fn fields_mut(&mut self) -> [&mut T; 6] {
        [
            &mut self.background_stay,
            &mut self.background_to_start,
            &mut self.end_to_background,
            &mut self.end_to_start,
            &mut self.inside_to_continue,
            &mut self.inside_to_end,
        ]
    }
}

impl Calibration {
    /// The JSON keys of the six biases, in field order.
    pub const KEYS: [&'static str; 6] = [
        "transition_bias_background_stay",
        "transition_bias_background_to_start",
        "transition_bias_end_to_background",
        "transition_bias_end_to_start",
        "transition_bias_inside_to_continue",
        "transition_bias_inside_to_end",
    ];

    /// The bias of `prev → next`, `None` when BIOES forbids it.
    pub fn transition(&self, prev: Tag, next: Tag) -> Option<f32> {
        match (prev, next) {
            (Tag::O, Tag::O) => Some(self.background_stay),
            (Tag::O, Tag::B(_) | Tag::S(_)) => Some(self.background_to_start),
            (Tag::B(a) | Tag::I(a), Tag::I(b)) if a == b => Some(self.inside_to_continue),
            (Tag::B(a) | Tag::I(a), Tag::E(b)) if a == b => Some(self.inside_to_end),
            (Tag::E(_) | Tag::S(_), Tag::O) => Some(self.end_to_background),
            (Tag::E(_) | Tag::S(_), Tag::B(_) | Tag::S(_)) => Some(self.end_to_start),
            _ => None,
        }
    }
}

/// The highest-scoring legal tag path for `emissions` (`T` rows of `n` log-probabilities, row-major):
/// the sum of the emissions of the chosen tags plus the biases of the transitions between them,
/// starting on `O`/`B`/`S` and ending on `O`/`E`/`S`. Ties go to the lowest class index. Returns
/// one class index per row (empty for `T = 0`).
pub fn viterbi(emissions: &[f32], n: usize, tags: &TagSet, cal: &Calibration) -> Result<Vec<usize>, PrivacyError> {
    if n != tags.len() || n == 0 || emissions.len() % n != 0 {
        return Err(PrivacyError::Decode(format!("{} emissions do not form rows of {} classes ({} tags)", emissions.len(), n, tags.len())));
    }
    let t_len = emissions.len() / n;
    if t_len == 0 {
        return Ok(Vec::new());
    }
    if emissions.iter().any(|e| e.is_nan()) {
        return Err(PrivacyError::Decode("NaN emission".into()));
    }
    // allowed transitions as (prev, bias) lists per next tag
    let incoming: Vec<Vec<(usize, f64)>> = (0..n)
        .map(|j| (0..n).filter_map(|i| cal.transition(tags.tags[i], tags.tags[j]).map(|b| (i, b as f64))).collect())
        .collect();
    let ninf = f64::NEG_INFINITY;
    let mut score: Vec<f64> = (0..n).map(|j| if tags.tags[j].can_start() { emissions[j] as f64 } else { ninf }).collect();
    let mut back = vec![0usize; t_len * n];
    let mut next = vec![ninf; n];
    for t in 1..t_len {
        for j in 0..n {
            let (mut best, mut arg) = (ninf, usize::MAX);
            for &(i, b) in &incoming[j] {
                let s = score[i] + b;
                if s > best {
                    (best, arg) = (s, i);
                }
            }
            if arg == usize::MAX {
                next[j] = ninf;
                back[t * n + j] = 0;
            } else {
                next[j] = best + emissions[t * n + j] as f64;
                back[t * n + j] = arg;
            }
        }
        std::mem::swap(&mut score, &mut next);
    }
    let (mut best, mut last) = (ninf, usize::MAX);
    for (j, s) in score.iter().enumerate() {
        if tags.tags[j].can_end() && *s > best {
            (best, last) = (*s, j);
        }
    }
    if last == usize::MAX {
        return Err(PrivacyError::Decode("no legal BIOES path has a finite score (emissions of -inf?)".into()));
    }
    let mut path = vec![0usize; t_len];
    path[t_len - 1] = last;
    for t in (1..t_len).rev() {
        path[t - 1] = back[t * n + path[t]];
    }
    Ok(path)
}

/// A decoded entity as token indices: tokens `start..end` (end exclusive) of entity `entity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenSpan {
    pub entity: usize,
    pub start: usize,
    pub end: usize,
}

/// The entities of a tag path: `B-x I-x* E-x` and `S-x` runs. On a legal path every entity tag
/// belongs to exactly one span; tokens of a run that a legal path could not produce (an `I`/`E`
/// without its `B`, or a run broken by another entity) start no span and are skipped.
pub fn spans(path: &[usize], tags: &TagSet) -> Vec<TokenSpan> {
    let mut out = Vec::new();
    let mut open: Option<(usize, usize)> = None; // (entity, first token)
    for (t, &c) in path.iter().enumerate() {
        let tag = tags.tags[c];
        match tag {
            Tag::O => open = None,
            Tag::S(k) => {
                out.push(TokenSpan { entity: k, start: t, end: t + 1 });
                open = None;
            }
            Tag::B(k) => open = Some((k, t)),
            Tag::I(k) => {
                if open.map(|o| o.0) != Some(k) {
                    open = None;
                }
            }
            Tag::E(k) => {
                if let Some((e, s)) = open.filter(|o| o.0 == k) {
                    out.push(TokenSpan { entity: e, start: s, end: t + 1 });
                }
                open = None;
            }
        }
    }
    out
}
