//! # sampling
//!
//! Logits processors and seeded samplers for LLM decoding on MLX, batched over `[B, V]`
//! logits and lazy on the device: logit bias, repetition / presence / frequency penalties
//! with their context windows, temperature, top-k, top-p, min-p, greedy decoding, token
//! log-probs (processed and raw) and top-n alternatives; plus opt-in [`StopGuard`]s that end a
//! sequence with finish reason `"repetition"`.
//!
//! Defaults are those of mlx-node 0.0.8 (see [`config`]); the algorithms
//! follow mlx-lm 0.32's `mlx_lm/sample_utils.py`, with the differences noted in [`filters`].
//!
//! ```
//! use mlx_array::Array;
//! use sampling::{SampleOptions, Sampler, SamplingConfig, SamplingOverrides, StopGuard};
//! # fn main() -> sampling::Result<()> {
//! // Model defaults (e.g. from generation_config.json) under the request's explicit values.
//! let model = SamplingOverrides::from_generation_config(&serde_json::json!({"temperature": 1.0, "top_k": 64, "top_p": 0.95}));
//! let request = SamplingOverrides { temperature: Some(0.7), seed: Some(7), ..Default::default() };
//! let cfg = SamplingConfig::resolve(&request, &model)?.with_presence_penalty(0.5).with_max_consecutive_tokens(8);
//!
//! let mut sampler = Sampler::new(cfg.clone())?;
//! let mut guard = StopGuard::new(&cfg)?;
//! // Logits of two sequences over a vocabulary of 4, and each one's tokens so far.
//! let logits = Array::from_slice(&[2.0f32, 1.0, 0.5, -1.0, 0.0, 3.0, 0.0, 0.0], &[2, 4])?;
//! let history: [&[u32]; 2] = [&[0, 0, 1], &[3]];
//! let step = sampler.sample_with(&logits, &history, &SampleOptions { top_logprobs: 2, ..Default::default() })?.to_host()?;
//! assert_eq!(step.tokens.len(), 2);
//! assert!(step.logprobs.iter().all(|&lp| lp <= 0.0));
//! assert_eq!(step.top.as_ref().unwrap()[0].len(), 2);
//! assert!(guard.push(step.tokens[0]).is_none());
//!
//! // Invalid settings are typed errors.
//! assert!(SamplingConfig::default().with_top_p(0.0).validate().is_err());
//! // Temperature 0 is greedy: the argmax.
//! let mut greedy = Sampler::new(SamplingConfig::greedy())?;
//! assert_eq!(greedy.sample(&logits, &[])?.to_host()?.tokens, vec![0, 1]);
//! # Ok(()) }
//! ```
pub mod config;
mod error;
pub mod filters;
mod guard;
mod penalties;
mod sampler;

pub use config::{SamplingConfig, SamplingOverrides};
pub use error::{Result, SamplingError};
pub use guard::{StopGuard, StopReason};
pub use penalties::apply_penalties;
pub use sampler::{HostSample, Sample, SampleOptions, Sampler, TopLogprobs};
