//! [`generate_batch`]: several prompts, each sampled `group_size` times, decoded together in
//! `[B, L]` forward passes over one batch cache ([`crate::batch`]).
use crate::cache::Cache;
use crate::generate::{FinishReason, GenerateConfig, Performance};
use crate::model::Model;
use crate::runtime::Logits;
use crate::{ModelError, Result};
use mlx_array::Array;
use sampling::{Sampler, SamplingConfig, StopGuard};
use std::time::{Duration, Instant};

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
    /// Timings of this sequence: `ttft_ms` is the batch's prefill (every sequence gets its first
    /// token from it), `decode_tokens_per_sec` this sequence's tokens after the first over the
    /// time until it finished.
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
    /// Prefill time (all prompts), ms.
    pub prefill_ms: f64,
    /// Decode time (after the prefill until the last sequence finished), ms.
    pub decode_ms: f64,
    /// Generated tokens of all sequences over the decode time.
    pub decode_tokens_per_sec: f64,
}

/// SplitMix64: the per-row seed of row `row` from the configured seed.
fn row_seed(seed: u64, row: usize) -> u64 {
    let mut z = seed
        ^ (row as u64)
            .wrapping_add(1)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// How rows are sampled: greedy rows share one batched argmax; otherwise each row has its own
/// sampler (its own random stream).
enum Samplers {
    Greedy(Sampler),
    Rows(Vec<Sampler>),
}

impl Samplers {
    fn new(cfg: &SamplingConfig, rows: usize) -> Result<Self> {
        let bad = |e: sampling::SamplingError| ModelError::InvalidInput(e.to_string());
        if cfg.is_greedy() {
            return Ok(Samplers::Greedy(Sampler::new(cfg.clone()).map_err(bad)?));
        }
        let seed = cfg.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let samplers = (0..rows)
            .map(|r| Sampler::new(cfg.clone().with_seed(row_seed(seed, r))).map_err(bad))
            .collect::<Result<Vec<_>>>()?;
        Ok(Samplers::Rows(samplers))
    }

    /// Sample `logits` (`[n, V]`, row `i` being sequence `seqs[i]`): tokens and log-probs `[n]`.
    fn sample(
        &mut self,
        logits: &Array,
        seqs: &[usize],
        history: &[Vec<u32>],
    ) -> Result<(Array, Array)> {
        let bad = |e: sampling::SamplingError| ModelError::InvalidInput(e.to_string());
        let hist: Vec<&[u32]> = seqs.iter().map(|&s| history[s].as_slice()).collect();
        match self {
            Samplers::Greedy(s) => {
                let out = s.sample(logits, &hist).map_err(bad)?;
                Ok((out.tokens, out.logprobs))
            }
            Samplers::Rows(samplers) => {
                let (mut toks, mut lps) = (
                    Vec::with_capacity(seqs.len()),
                    Vec::with_capacity(seqs.len()),
                );
                for (i, &s) in seqs.iter().enumerate() {
                    let out = samplers[s]
                        .sample(&logits.slice_axis(0, i, i + 1)?, &hist[i..i + 1])
                        .map_err(bad)?;
                    toks.push(out.tokens);
                    lps.push(out.logprobs);
                }
                let (t, l): (Vec<&Array>, Vec<&Array>) =
                    (toks.iter().collect(), lps.iter().collect());
                Ok((
                    mlx_array::ops::concatenate(&t, 0)?,
                    mlx_array::ops::concatenate(&l, 0)?,
                ))
            }
        }
    }
}

/// Where one sequence stands.
struct Row {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    guard: StopGuard,
    finish: Option<FinishReason>,
    finished_at: Duration,
}

/// Generate for every prompt `group_size` sequences, all decoded together.
///
/// Arguments: `model` any causal LM ([`Model`]), `prompts` the prompts' token ids (each
/// non-empty), `group_size` sequences per prompt (at least 1), `cfg` as for
/// [`crate::generate()`]: `max_new_tokens`, `sampling`, `prefill_step_size` (columns per
/// prefill pass), `stop_tokens` (default: the model's eos ids); `cfg.context` must be empty (there
/// is no earlier cache here).
///
/// The prompts are prefilled together, left-padded to the longest ([`crate::batch`]), in
/// `[P, L]` passes; each prefilled row is then copied to its `group_size` sequences, and every
/// decode step is one `[B, 1]` forward over all sequences still running (finished ones leave
/// the batch). The model's own cache mode does not matter: the batch cache is flat.
///
/// Sampling follows the sampling crate, row by row: each sequence has its own penalty history
/// (its prompt and tokens) and stop guard; with temperature > 0 each has its own random stream,
/// seeded from `cfg.sampling.seed` (the clock when `None`) and the sequence's index, so a
/// seed fixes every sequence. Greedy decoding (temperature 0) gives each sequence what
/// [`crate::generate()`] gives its prompt alone, up to float rounding (exact wherever the
/// lone run's top-1/top-2 logit gap is above about 1e-4 in f32).
pub fn generate_batch(
    model: &Model,
    prompts: &[Vec<u32>],
    group_size: usize,
    cfg: &GenerateConfig,
) -> Result<BatchGenerationResult> {
    if prompts.is_empty() || group_size == 0 {
        return Err(ModelError::InvalidInput(format!("generate_batch needs at least one prompt and group_size >= 1 (got {} prompts, group_size {group_size})", prompts.len())));
    }
    if !cfg.context.is_empty() {
        return Err(ModelError::InvalidInput(
            "generate_batch starts from empty caches: GenerateConfig::context must be empty".into(),
        ));
    }
    let vocab = model.info().vocab_size;
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(ModelError::InvalidInput(format!(
                "prompt {i} is empty: generation needs at least one prompt token"
            )));
        }
        if let Some(bad) = p.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!(
                "prompt {i}: token id {bad} out of range for vocab size {vocab}"
            )));
        }
    }
    let n = prompts.len() * group_size;
    let mut samplers = Samplers::new(&cfg.sampling, n)?;
    let sc = &cfg.sampling;
    let lazy_feed =
        sc.repetition_penalty == 1.0 && sc.presence_penalty == 0.0 && sc.frequency_penalty == 0.0;
    let stop = cfg
        .stop_tokens
        .clone()
        .unwrap_or_else(|| model.info().eos_token_ids.clone());
    let mut history: Vec<Vec<u32>> = (0..n).map(|s| prompts[s / group_size].clone()).collect();
    let mut rows = (0..n)
        .map(|_| {
            Ok(Row {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                guard: StopGuard::new(sc).map_err(|e| ModelError::InvalidInput(e.to_string()))?,
                finish: None,
                finished_at: Duration::ZERO,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut rows_per_forward = Vec::new();
    let started = Instant::now();

    // Prefill the distinct prompts, left-padded to the longest.
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let pad: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
    let mut cache = Cache::new_batch(&model.with_runtime(|rt| rt.cache_spec()), pad.clone())?;
    let step = if cfg.prefill_step_size == 0 {
        longest
    } else {
        cfg.prefill_step_size
    };
    let mut start = 0;
    let mut logits = None;
    while start < longest {
        let end = (start + step).min(longest);
        let last = end == longest;
        let mut ids = Vec::with_capacity(prompts.len() * (end - start));
        for (p, &pd) in prompts.iter().zip(&pad) {
            ids.extend((start..end).map(|c| if c < pd { 0 } else { p[c - pd] }));
        }
        let t = Array::from_slice(&ids, &[prompts.len(), end - start])?;
        let out = model.with_runtime(|rt| {
            rt.forward(
                &t,
                &mut cache,
                if last { Logits::Last } else { Logits::None },
                false,
            )
        })?;
        rows_per_forward.push(prompts.len());
        if last {
            logits = out.logits;
        } else {
            cache.eval_with(&[])?;
        }
        start = end;
    }
    let logits = logits
        .ok_or_else(|| ModelError::Cache("prefill returned no logits (internal error)".into()))?;
    let logits = logits.reshape(&[prompts.len() as i32, -1])?;
    // Each prompt's row becomes its group.
    let mut alive: Vec<usize> = (0..n).collect();
    let (logits, expand) = if group_size > 1 {
        let expand: Vec<usize> = (0..n).map(|s| s / group_size).collect();
        let idx = Array::from_slice(&expand.iter().map(|&r| r as i32).collect::<Vec<_>>(), &[n])?;
        (logits.take(&idx, 0)?, Some(expand))
    } else {
        (logits, None)
    };
    if let Some(e) = &expand {
        cache.select_rows(e)?;
    }
    let mut pending = Some(samplers.sample(&logits, &alive, &history)?);
    {
        let (t, l) = pending.as_ref().expect("just set");
        cache.eval_with(&[t, l])?;
    }
    let prefill_time = started.elapsed();
    if cfg.max_new_tokens == 0 {
        pending = None;
        for r in &mut rows {
            r.finish = Some(FinishReason::Length);
        }
        alive.clear();
    }

    // Decode: one [B, 1] forward over the running sequences per step.
    let forward = |cache: &mut Cache, input: &Array| -> Result<Array> {
        let out = model.with_runtime(|rt| rt.forward(input, cache, Logits::Last, false))?;
        let l = out.logits.ok_or_else(|| {
            ModelError::Cache("forward returned no logits (internal error)".into())
        })?;
        Ok(l.reshape(&[input.dims()[0], -1])?)
    };
    while let Some((tok, lp)) = pending.take() {
        // Pipelining: queue step n + 1 on the lazy tokens n before reading them back.
        let mut queued = None;
        if lazy_feed {
            let logits = forward(&mut cache, &tok.reshape(&[alive.len() as i32, 1])?)?;
            rows_per_forward.push(alive.len());
            let next = samplers.sample(&logits, &alive, &history)?;
            cache.async_eval_with(&[&next.0, &next.1])?;
            queued = Some(next);
        }
        let (ids, lps) = (tok.to_vec::<u32>()?, lp.to_vec::<f32>()?);
        let now = started.elapsed();
        let mut keep = Vec::with_capacity(alive.len());
        for (b, &s) in alive.iter().enumerate() {
            let (id, lp) = (ids[b], lps[b]);
            if lp.is_nan() || lp == f32::INFINITY {
                let _ = cache.eval_with(&[]);
                return Err(ModelError::NonFiniteLogits {
                    step: rows[s].tokens.len(),
                    logprob: lp,
                });
            }
            let row = &mut rows[s];
            if stop.contains(&id) {
                row.finish = Some(FinishReason::Stop);
            } else {
                row.tokens.push(id);
                row.logprobs.push(lp);
                history[s].push(id);
                if row.guard.push(id).is_some() {
                    row.finish = Some(FinishReason::Repetition);
                } else if row.tokens.len() >= cfg.max_new_tokens {
                    row.finish = Some(FinishReason::Length);
                }
            }
            match row.finish {
                Some(_) => row.finished_at = now,
                None => keep.push(b),
            }
        }
        if keep.is_empty() {
            if let Some((t, l)) = &queued {
                cache.eval_with(&[t, l])?;
            }
            break;
        }
        let all = keep.len() == alive.len();
        if !all {
            cache.select_rows(&keep)?;
        }
        let kept_idx = || {
            Array::from_slice(
                &keep.iter().map(|&b| b as i32).collect::<Vec<_>>(),
                &[keep.len()],
            )
        };
        pending = match queued {
            Some((t, l)) if all => Some((t, l)),
            Some((t, l)) => {
                let idx = kept_idx()?;
                Some((t.take(&idx, 0)?, l.take(&idx, 0)?))
            }
            None => {
                let next_ids: Vec<u32> = keep.iter().map(|&b| ids[b]).collect();
                alive = keep.iter().map(|&b| alive[b]).collect();
                let input = Array::from_slice(&next_ids, &[alive.len(), 1])?;
                let logits = forward(&mut cache, &input)?;
                rows_per_forward.push(alive.len());
                let next = samplers.sample(&logits, &alive, &history)?;
                cache.async_eval_with(&[&next.0, &next.1])?;
                pending = Some(next);
                continue;
            }
        };
        alive = keep.iter().map(|&b| alive[b]).collect();
    }
    let total = started.elapsed();
    let decode = total.saturating_sub(prefill_time);
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let generated: usize = rows.iter().map(|r| r.tokens.len()).sum();
    let sequences = rows
        .into_iter()
        .enumerate()
        .map(|(s, r)| {
            let k = r.tokens.len();
            let own = r.finished_at.saturating_sub(prefill_time);
            BatchSequence {
                prompt_index: s / group_size,
                performance: Performance {
                    prompt_tokens: prompts[s / group_size].len(),
                    generated_tokens: k,
                    ttft_ms: prefill_time.as_secs_f64() * 1e3,
                    prefill_tokens_per_sec: prompt_tokens as f64
                        / prefill_time.as_secs_f64().max(1e-9),
                    decode_tokens_per_sec: if k > 1 {
                        (k - 1) as f64 / own.as_secs_f64().max(1e-9)
                    } else {
                        0.0
                    },
                },
                tokens: r.tokens,
                logprobs: r.logprobs,
                finish_reason: r.finish.unwrap_or(FinishReason::Length),
            }
        })
        .collect();
    Ok(BatchGenerationResult {
        group_size,
        sequences,
        rows_per_forward,
        prefill_ms: prefill_time.as_secs_f64() * 1e3,
        decode_ms: decode.as_secs_f64() * 1e3,
        decode_tokens_per_sec: generated as f64 / decode.as_secs_f64().max(1e-9),
    })
}
