//! [`generate_batch`]: several prompts, each sampled `group_size` times, decoded together in
//! `[B, L]` forward passes over one batch cache ([`crate::batch`]).
use crate::engine::{EngineConfig, EngineKv, Scheduler, Seq};
use crate::generate::{CancelHandle, FinishReason, GenerateConfig, Performance};
use crate::model::Model;
use crate::{ModelError, Result};
use std::time::Instant;

/// One generated sequence of a [`BatchGenerationResult`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct BatchSequence {
    /// Index of its prompt in the `prompts` given to [`generate_batch`].
    pub prompt_index: usize,
    /// Generated ids (a stop token that ended the sequence is not included).
    pub tokens: Vec<u32>,
    /// Log-probability of each generated token under the processed sampling distribution
    /// (penalties, temperature and filters applied; plain log-softmax for greedy decoding).
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
    /// Timings of this sequence: `ttft_ms` from the start to its first token (the prefill of
    /// every prompt), `decode_tokens_per_sec` its tokens after the first over the time until
    /// it finished.
    pub performance: Performance,
}

/// What [`generate_batch`] returns: `prompts.len() * group_size` sequences, prompt by prompt
/// (sequence `p * group_size + g` is sample `g` of prompt `p`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct BatchGenerationResult {
    pub group_size: usize,
    pub sequences: Vec<BatchSequence>,
    /// Rows of each forward pass, in order (prefill chunks first, then one per decode step).
    pub rows_per_forward: Vec<usize>,
    /// Start to the last first token (the prefill of all prompts), ms.
    pub prefill_ms: f64,
    /// Decode time (after the prefill until the last sequence finished), ms.
    pub decode_ms: f64,
    /// Generated tokens of all sequences over the decode time.
    pub decode_tokens_per_sec: f64,
}

/// SplitMix64: the per-row seed of row `row` from the configured seed.
pub(crate) fn row_seed(seed: u64, row: usize) -> u64 {
    let mut z = seed ^ (row as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Generate for every prompt `group_size` sequences, all decoded together.
///
/// Arguments: `model` any causal LM ([`Model`]), `prompts` the prompts' token ids (each
/// non-empty), `group_size` sequences per prompt (at least 1), `cfg` as for
/// [`crate::generate()`]: `max_new_tokens`, `sampling`, `prefill_step_size` (columns per
/// prefill pass), `stop_tokens` (default: the model's eos ids); `cfg.context` must be empty (there
/// is no earlier cache here).
///
/// It runs the continuous-batching loop of [`crate::engine`] on the caller's thread with room
/// for every sequence: the distinct prompts are prefilled together, each in chunks at its own
/// pace, in passes that take their tokens packed ([`crate::batch::Ragged`]); each prefilled row
/// is then copied to its `group_size` sequences and decodes beside the prompts still computed,
/// and every decode step is one forward over all sequences still running (finished ones leave
/// the batch). The model's own cache mode does not matter:
/// the batch cache is flat.
///
/// Sampling follows the sampling crate, row by row: each sequence has its own penalty history
/// (its prompt and tokens) and stop guard; with temperature > 0 each has its own random stream,
/// seeded from `cfg.sampling.seed` (the clock when `None`) and the sequence's index, so a
/// seed fixes every sequence. Greedy decoding (temperature 0) gives each sequence what
/// [`crate::generate()`] gives its prompt alone, up to float rounding (exact wherever the
/// lone run's top-1/top-2 logit gap is above about 1e-4 in f32).
pub fn generate_batch(model: &Model, prompts: &[Vec<u32>], group_size: usize, cfg: &GenerateConfig) -> Result<BatchGenerationResult> {
    if prompts.is_empty() || group_size == 0 {
        return Err(ModelError::InvalidInput(format!("generate_batch needs at least one prompt and group_size >= 1 (got {} prompts, group_size {group_size})", prompts.len())));
    }
    let n = prompts.len() * group_size;
    let seed = (!cfg.sampling.is_greedy()).then(|| {
        cfg.sampling.seed.unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0))
    });
    let mut s = Scheduler::new(model.clone(), EngineConfig { max_batch: n, prefill_step_size: cfg.prefill_step_size, mixed_step_size: cfg.prefill_step_size, max_queue: n, kv: EngineKv::Flat, prompt_passes: crate::engine::PromptPasses::Mixed });
    for r in 0..n {
        let p = prompts[r / group_size].clone();
        let seq = Seq::new(model, p, cfg, seed.map(|s| row_seed(s, r)), CancelHandle::default(), None).map_err(|e| match e {
            ModelError::InvalidInput(m) => ModelError::InvalidInput(format!("prompt {}: {m}", r / group_size)),
            e => e,
        })?;
        s.add(seq);
    }
    let started = Instant::now();
    while s.busy() {
        s.step()?;
    }
    let total = started.elapsed();
    let seqs: Vec<Seq> = s.seqs.drain(..).map(|q| q.ok_or_else(|| ModelError::Cache("a sequence left the loop (internal error)".into()))).collect::<Result<_>>()?;
    let prefill = seqs.iter().map(|q| q.first_token.unwrap_or_default()).max().unwrap_or_default();
    let decode = total.saturating_sub(prefill);
    let generated: usize = seqs.iter().map(|q| q.tokens.len()).sum();
    let sequences = seqs
        .into_iter()
        .enumerate()
        .map(|(r, q)| BatchSequence {
            prompt_index: r / group_size,
            performance: q.performance(),
            finish_reason: q.finish.unwrap_or(FinishReason::Length),
            tokens: q.tokens,
            logprobs: q.logprobs,
        })
        .collect();
    Ok(BatchGenerationResult {
        group_size,
        sequences,
        rows_per_forward: s.rows_per_forward,
        prefill_ms: prefill.as_secs_f64() * 1e3,
        decode_ms: decode.as_secs_f64() * 1e3,
        decode_tokens_per_sec: generated as f64 / decode.as_secs_f64().max(1e-9),
    })
}
