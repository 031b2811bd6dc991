//! Returns from `main` while MLX still computes work queued with `async_eval` (a chain of f32
//! matmuls that runs through OpenBLAS), to exercise the process exit with work in flight.
//!
//! ```text
//! exit_race            # mlx_array::async_eval: the thread's exit waits for the queued work
//! exit_race --no-wait  # mlx-rs's async_eval directly: nothing waits (the race)
//! ```
//! `scripts/exit_race.sh` runs both many times and counts clean exits, hangs and crashes.
use clap::Parser;
use mlx_array::random::{self, Key};
use mlx_array::DType;

#[derive(Parser)]
struct Args {
    /// Queue with mlx-rs's async_eval, bypassing the exit wait of mlx_array::async_eval.
    #[arg(long)]
    no_wait: bool,
}

fn main() -> mlx_array::Result<()> {
    let no_wait = Args::parse().no_wait;
    let a = random::normal(&[512, 512], DType::F32, &Key::new(1)?)?;
    let mut x = a.clone();
    for _ in 0..40 {
        x = x.matmul(&a)?.tanh()?;
    }
    if no_wait {
        mlx_rs::transforms::async_eval([x.as_mlx()]).map_err(|e| mlx_array::Error::Mlx { op: "async_eval", msg: e.what().to_string() })?;
    } else {
        mlx_array::async_eval(&[&x])?;
    }
    println!("queued");
    Ok(())
}
