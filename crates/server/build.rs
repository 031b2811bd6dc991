// Give this package's binaries (examples, tests, benches) a RUNPATH to libmlx, so they also run
// outside `cargo run` (LD_LIBRARY_PATH still wins, which is how the CUDA libmlx is swapped in).
fn main() {
    if let Ok(d) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{d}");
    }
}
