//! An OpenAI-compatible HTTP server over `mlx-models` (binary `mlx-serve`).
//!
//! Endpoints: `GET /health`, `GET /metrics` (Prometheus text), `GET /v1/models`,
//! `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/embeddings` (embedding
//! models), `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`. Errors are OpenAI-style
//! JSON bodies. [`load`] builds the state for a checkpoint directory, [`http::router`] the
//! routes; [`serve`] runs them on a listener.
pub mod engine;
pub mod error;
pub mod http;
pub mod metrics;
pub mod pipeline;
pub mod responses;
pub mod store;

use crate::engine::SequentialEngine;
use crate::http::{AppState, Backend, EmbedBackend, LmBackend, Shared};
use axum::serve::ListenerExt;
use mlx_models::chat::{ChatFormat, Tokenizer};
use mlx_models::{load_model, LoadOptions, LoadedModel};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Errors of starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("loading {}: {source}", path.display())]
    Load {
        path: PathBuf,
        #[source]
        source: mlx_models::ModelError,
    },
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// How to serve a checkpoint.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub model_dir: PathBuf,
    /// The SQLite file of the response store.
    pub db: PathBuf,
    /// Requests that may wait for the engine; more are refused with 429.
    pub max_queue: usize,
    /// Which engine runs the model.
    pub engine: EngineKind,
    /// Most sequences per forward pass of the batching engine.
    pub max_batch: usize,
    /// Where the batching engine keeps K/V (the paged pool, flat batch caches, or the paged pool
    /// on a GPU only).
    pub engine_kv: mlx_models::EngineKv,
    /// Finished sequences whose KV caches the sequential engine keeps for prefix reuse.
    pub kept_sequences: usize,
    /// How long stored responses are kept, in seconds.
    pub retention_secs: i64,
}

/// The engine behind the endpoints (see [`engine`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// [`engine::BatchEngine`]: all requests on one continuous-batching loop.
    Batch,
    /// [`engine::SequentialEngine`]: one request at a time, reusing kept KV caches.
    Sequential,
}

/// The response store's default file: `$XDG_CACHE_HOME/mlx-models/responses.db`, else
/// `~/.cache/mlx-models/responses.db` (`~/Library/Caches/mlx-models/responses.db` on macOS).
pub fn default_db_path() -> PathBuf {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("."));
            if cfg!(target_os = "macos") {
                home.join("Library/Caches")
            } else {
                home.join(".cache")
            }
        }
    };
    base.join("mlx-models").join("responses.db")
}

/// The name clients give as `model`: the checkpoint directory's name.
pub fn model_id(dir: &Path) -> String {
    dir.canonicalize()
        .ok()
        .as_deref()
        .unwrap_or(dir)
        .file_name()
        .map_or_else(
            || dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
}

/// Load the model, start its engine and open the store.
pub fn load(opts: &ServeOptions) -> Result<Shared, ServerError> {
    let dir = &opts.model_dir;
    let lerr = |source| ServerError::Load {
        path: dir.clone(),
        source,
    };
    let store = Arc::new(store::ResponseStore::open(&opts.db)?);
    store.cleanup_expired()?;
    let backend = match load_model(dir, &LoadOptions::default()).map_err(lerr)? {
        LoadedModel::Lm(model) => {
            let format = Arc::new(ChatFormat::from_dir(dir).map_err(|e| lerr(e.into()))?);
            let defaults = std::fs::read_to_string(dir.join("generation_config.json"))
                .ok()
                .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
                .map(|v| sampling::SamplingOverrides::from_generation_config(&v))
                .unwrap_or_default();
            let info = model.info().clone();
            let engine: Arc<dyn engine::Engine> = match opts.engine {
                EngineKind::Batch => Arc::new(
                    engine::BatchEngine::start(
                        model,
                        opts.max_batch,
                        opts.max_queue,
                        opts.engine_kv,
                    )
                    .map_err(lerr)?,
                ),
                EngineKind::Sequential => Arc::new(SequentialEngine::start(
                    model,
                    opts.max_queue,
                    opts.kept_sequences,
                )?),
            };
            Backend::Lm(LmBackend {
                engine,
                format,
                defaults,
                info,
            })
        }
        LoadedModel::Embedding(model) => {
            let tokenizer = Arc::new(Tokenizer::from_dir(dir).map_err(|e| lerr(e.into()))?);
            Backend::Embedding(EmbedBackend {
                model,
                tokenizer,
                slots: Arc::new(tokio::sync::Semaphore::new(opts.max_queue.max(1))),
            })
        }
    };
    Ok(Arc::new(AppState {
        model_id: model_id(dir),
        created: store::now_secs(),
        backend,
        store,
        metrics: Arc::new(metrics::Metrics::default()),
        retention_secs: opts.retention_secs,
        live: Default::default(),
    }))
}

/// Serve `state` on `listener` until `shutdown` resolves; expired stored responses are
/// deleted hourly.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Shared,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let store = state.store.clone();
    let sweeper = tokio::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(3600));
        loop {
            every.tick().await;
            let s = store.clone();
            let _ = tokio::task::spawn_blocking(move || s.cleanup_expired()).await;
        }
    });
    // TCP_NODELAY on every connection: a streamed token is one small write, which Nagle's
    // algorithm would hold back until the client acknowledges the previous one (a delayed ACK,
    // 40 ms or more on Linux) — a floor under every token's latency of a lone stream. A socket
    // that refuses the option still works, only with that delay.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let r = axum::serve(listener, http::router(state))
        .with_graceful_shutdown(shutdown)
        .await;
    sweeper.abort();
    r
}
