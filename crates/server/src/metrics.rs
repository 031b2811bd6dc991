//! Server counters, rendered as Prometheus text by `GET /metrics`.
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
pub const TTFT_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The window over which `mlx_serve_generation_tokens_per_second` is measured.
pub const RATE_WINDOW: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Inner {
    /// (endpoint, HTTP status) -> count.
    requests: BTreeMap<(String, u16), u64>,
    prompt_tokens: u64,
    cached_prompt_tokens: u64,
    generated_tokens: u64,
    ttft_counts: [u64; TTFT_BUCKETS.len()],
    ttft_count: u64,
    ttft_sum: f64,
    /// (time, tokens) of recent generated tokens, for the rate.
    recent: std::collections::VecDeque<(Instant, u64)>,
    cancelled: u64,
}

/// Thread-safe counters.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

/// Gauges read at render time: the engine's counters and MLX's memory.
#[derive(Default)]
pub struct Gauges {
    pub engine: crate::engine::EngineStats,
    pub memory: Option<mlx_models::observe::MemoryStats>,
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn request(&self, endpoint: &str, status: u16) {
        *self
            .lock()
            .requests
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    pub fn ttft(&self, d: Duration) {
        let s = d.as_secs_f64();
        let mut m = self.lock();
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            if s <= *b {
                m.ttft_counts[i] += 1;
            }
        }
        m.ttft_count += 1;
        m.ttft_sum += s;
    }

    pub fn tokens(&self, n: u64) {
        let now = Instant::now();
        let mut m = self.lock();
        m.generated_tokens += n;
        m.recent.push_back((now, n));
        while m
            .recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
        {
            m.recent.pop_front();
        }
    }

    pub fn prompt(&self, prompt_tokens: usize, cached: usize) {
        let mut m = self.lock();
        m.prompt_tokens += prompt_tokens as u64;
        m.cached_prompt_tokens += cached as u64;
    }

    pub fn cancelled(&self) {
        self.lock().cancelled += 1;
    }

    /// The Prometheus text exposition.
    pub fn render(&self, g: &Gauges) -> String {
        let now = Instant::now();
        let m = self.lock();
        let mut o = String::new();
        let head = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        head(
            &mut o,
            "mlx_serve_requests_total",
            "counter",
            "HTTP requests by endpoint and status.",
        );
        for ((ep, st), n) in &m.requests {
            let _ = writeln!(
                o,
                "mlx_serve_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}"
            );
        }
        head(
            &mut o,
            "mlx_serve_requests_cancelled_total",
            "counter",
            "Generations stopped because the client went away.",
        );
        let _ = writeln!(o, "mlx_serve_requests_cancelled_total {}", m.cancelled);
        head(
            &mut o,
            "mlx_serve_queue_depth",
            "gauge",
            "Requests waiting for the engine.",
        );
        let _ = writeln!(o, "mlx_serve_queue_depth {}", g.engine.queued);
        head(
            &mut o,
            "mlx_serve_queue_capacity",
            "gauge",
            "Requests that may wait before new ones are refused with 429.",
        );
        let _ = writeln!(o, "mlx_serve_queue_capacity {}", g.engine.queue_capacity);
        head(
            &mut o,
            "mlx_serve_running_requests",
            "gauge",
            "Requests generating now.",
        );
        let _ = writeln!(o, "mlx_serve_running_requests {}", g.engine.running);
        head(
            &mut o,
            "mlx_serve_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished generations.",
        );
        let _ = writeln!(o, "mlx_serve_prompt_tokens_total {}", m.prompt_tokens);
        head(
            &mut o,
            "mlx_serve_max_sequences_per_step",
            "gauge",
            "Most sequences one forward pass of the engine has carried.",
        );
        let _ = writeln!(
            o,
            "mlx_serve_max_sequences_per_step {}",
            g.engine.max_sequences_per_step
        );
        head(
            &mut o,
            "mlx_serve_cached_prompt_tokens_total",
            "counter",
            "Prompt tokens served from cached KV state.",
        );
        let _ = writeln!(
            o,
            "mlx_serve_cached_prompt_tokens_total {}",
            m.cached_prompt_tokens
        );
        head(
            &mut o,
            "mlx_serve_generation_tokens_total",
            "counter",
            "Generated tokens.",
        );
        let _ = writeln!(
            o,
            "mlx_serve_generation_tokens_total {}",
            m.generated_tokens
        );
        let recent: u64 = m
            .recent
            .iter()
            .filter(|(t, _)| now.duration_since(*t) <= RATE_WINDOW)
            .map(|(_, n)| n)
            .sum();
        head(
            &mut o,
            "mlx_serve_generation_tokens_per_second",
            "gauge",
            "Generated tokens per second over the last 10 s.",
        );
        let _ = writeln!(
            o,
            "mlx_serve_generation_tokens_per_second {}",
            recent as f64 / RATE_WINDOW.as_secs_f64()
        );
        head(
            &mut o,
            "mlx_serve_time_to_first_token_seconds",
            "histogram",
            "From request arrival to the first generated token.",
        );
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            let _ = writeln!(
                o,
                "mlx_serve_time_to_first_token_seconds_bucket{{le=\"{b}\"}} {}",
                m.ttft_counts[i]
            );
        }
        let _ = writeln!(
            o,
            "mlx_serve_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {}",
            m.ttft_count
        );
        let _ = writeln!(
            o,
            "mlx_serve_time_to_first_token_seconds_sum {}",
            m.ttft_sum
        );
        let _ = writeln!(
            o,
            "mlx_serve_time_to_first_token_seconds_count {}",
            m.ttft_count
        );
        if let (Some(used), Some(cached), Some(total)) = (
            g.engine.kv_blocks_used,
            g.engine.kv_blocks_cached,
            g.engine.kv_blocks_total,
        ) {
            head(
                &mut o,
                "mlx_serve_kv_blocks_used",
                "gauge",
                "Paged KV blocks held by sequences.",
            );
            let _ = writeln!(o, "mlx_serve_kv_blocks_used {used}");
            head(
                &mut o,
                "mlx_serve_kv_blocks_cached",
                "gauge",
                "Paged KV blocks whose content can be found by prefix lookup.",
            );
            let _ = writeln!(o, "mlx_serve_kv_blocks_cached {cached}");
            head(
                &mut o,
                "mlx_serve_kv_blocks_total",
                "gauge",
                "Paged KV blocks in the pool.",
            );
            let _ = writeln!(o, "mlx_serve_kv_blocks_total {total}");
        }
        if let Some(mem) = g.memory {
            head(
                &mut o,
                "mlx_serve_memory_bytes",
                "gauge",
                "MLX allocator memory by kind.",
            );
            for (k, v) in [
                ("active", mem.active),
                ("peak", mem.peak),
                ("cache", mem.cache),
                ("wired_limit", mem.wired_limit),
                ("limit", mem.memory_limit),
            ] {
                let _ = writeln!(o, "mlx_serve_memory_bytes{{kind=\"{k}\"}} {v}");
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_rendered() {
        let m = Metrics::default();
        m.ttft(Duration::from_millis(30));
        m.ttft(Duration::from_millis(700));
        m.tokens(5);
        m.request("/v1/chat/completions", 200);
        m.request("/v1/chat/completions", 200);
        let g = Gauges {
            engine: crate::engine::EngineStats {
                queued: 3,
                running: 1,
                queue_capacity: 64,
                kv_blocks_used: Some(4),
                kv_blocks_cached: Some(2),
                kv_blocks_total: Some(10),
                max_sequences_per_step: 1,
            },
            memory: None,
        };
        let t = m.render(&g);
        assert!(
            t.contains("mlx_serve_time_to_first_token_seconds_bucket{le=\"0.025\"} 0\n"),
            "{t}"
        );
        assert!(t.contains("mlx_serve_time_to_first_token_seconds_bucket{le=\"0.05\"} 1\n"));
        assert!(t.contains("mlx_serve_time_to_first_token_seconds_bucket{le=\"1\"} 2\n"));
        assert!(t.contains("mlx_serve_time_to_first_token_seconds_count 2\n"));
        assert!(t.contains(
            "mlx_serve_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2\n"
        ));
        assert!(t.contains("mlx_serve_queue_depth 3\n"));
        assert!(t.contains("mlx_serve_kv_blocks_used 4\n"));
        assert!(t.contains("mlx_serve_generation_tokens_per_second 0.5\n"));
    }
}
