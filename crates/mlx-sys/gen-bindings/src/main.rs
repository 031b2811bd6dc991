//! Same options as the crates.io mlx-sys 0.7.0 `bindgen_config.rs`, minus layout tests.
fn main() {
    let root = std::path::PathBuf::from(std::env::var("MLXC_DIR").expect("set MLXC_DIR to the patched mlx-c dir"));
    let mut hs: Vec<_> = std::fs::read_dir(root.join("mlx/c"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "h"))
        .collect();
    hs.sort();
    let b = hs.iter().fold(
        bindgen::Builder::default()
            .rust_target("1.73.0".parse().unwrap())
            .clang_arg(format!("-I{}", root.display()))
            .blocklist_function("malloc")
            .blocklist_function("realloc")
            .layout_tests(false),
        |b, h| b.header(h.to_string_lossy()),
    );
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../src/bindings.rs");
    b.generate().unwrap().write_to_file(out).unwrap();
}
