//! `mlx-serve`: an OpenAI-compatible server for one checkpoint directory.
//!
//! ```text
//! cargo run --release -p mlx-server -- --model DIR [--host 127.0.0.1] [--port 8080] [--db PATH]
//! ```
//! Prints `listening on http://HOST:PORT` once ready (with `--port 0`, the port the system chose).
use clap::Parser;
use mlx_server::{default_db_path, load, serve, EngineKind, ServeOptions};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "mlx-serve",
    about = "OpenAI-compatible server (chat, completions, embeddings, responses) for one model"
)]
struct Cli {
    /// Checkpoint directory (config.json, safetensors, tokenizer files).
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 lets the system pick a free port.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// SQLite file of the response store (default: mlx-models/responses.db under the user's cache directory).
    #[arg(long)]
    db: Option<PathBuf>,
    /// Requests that may wait for the engine; more are answered 429.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// batch: every request on one continuous-batching loop; sequential: one request at a time,
    /// continuing kept KV caches (prompt prefix reuse).
    #[arg(long, value_enum, default_value_t = EngineArg::Batch)]
    engine: EngineArg,
    /// Most sequences per forward pass (batch engine).
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Where the batch engine keeps K/V: auto (the paged pool on a GPU, flat batch caches on
    /// the CPU), paged (the model's paged pool: prompt prefixes cached across requests) or flat.
    #[arg(long, value_enum, default_value_t = EngineKvArg::Auto)]
    engine_kv: EngineKvArg,
    /// Finished sequences whose KV caches are kept for prefix reuse (sequential engine).
    #[arg(long, default_value_t = 4)]
    kept_sequences: usize,
    /// Days stored responses are kept.
    #[arg(long, default_value_t = 7.0)]
    retention_days: f64,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum EngineKvArg {
    Auto,
    Paged,
    Flat,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum EngineArg {
    Batch,
    Sequential,
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

fn main() {
    let cli = Cli::parse();
    if cli.retention_days.is_nan() || cli.retention_days <= 0.0 {
        eprintln!("error: --retention-days must be positive");
        std::process::exit(2);
    }
    let opts = ServeOptions {
        model_dir: cli.model.clone(),
        db: cli.db.clone().unwrap_or_else(default_db_path),
        max_queue: cli.max_queue,
        engine: match cli.engine {
            EngineArg::Batch => EngineKind::Batch,
            EngineArg::Sequential => EngineKind::Sequential,
        },
        max_batch: cli.max_batch,
        engine_kv: match cli.engine_kv {
            EngineKvArg::Auto => mlx_models::EngineKv::Auto,
            EngineKvArg::Paged => mlx_models::EngineKv::Paged,
            EngineKvArg::Flat => mlx_models::EngineKv::Flat,
        },
        kept_sequences: cli.kept_sequences,
        retention_secs: (cli.retention_days * 86400.0) as i64,
    };
    if let Some(w) = mlx_array::libmlx::gpu_warning() {
        eprintln!("{w}");
    }
    // The model loads on this thread (MLX binds lazy arrays to the loading thread's stream;
    // loading materializes them, after which the engine thread may run them).
    let state = match load(&opts) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    let r = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((cli.host.as_str(), cli.port)).await?;
        let addr = listener.local_addr()?;
        println!(
            "mlx-serve: model {} (responses in {}); listening on http://{addr}",
            state.model_id,
            opts.db.display()
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        serve(listener, state, shutdown_signal()).await
    });
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
