// RUNPATH to the libmlx the build linked (LD_LIBRARY_PATH still wins: the GPU run swaps in CUDA's).
fn main() {
    if let Ok(d) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{d}");
    }
}
