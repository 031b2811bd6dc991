//! Paged cache sizing and selection as typed options: the automatic budget follows the model's
//! context within `memory_limit_mb` / `memory_floor_mb`; `LoadOptions::force_paged` picks paged
//! or flat per family over config.json.
mod common;
use common::*;
use mlx_models::{load_model, KvCacheMode, LoadOptions, PagedConfig};
use std::collections::BTreeMap;

fn blocks(name: &str, cfg: PagedConfig) -> usize {
    let opts = LoadOptions { kv_cache: KvCacheMode::Paged(cfg), ..test_load_options() };
    let m = load_model(fixture(name), &opts).unwrap().into_lm().unwrap();
    m.paged_stats().unwrap().groups.iter().map(|g| g.total).sum()
}

/// The qwen3 fixture: 3 layers x 2 K/V heads x 16 dims in f32 = 768 bytes a token (12288 a
/// block of 16); context 512 tokens.
#[test]
fn automatic_budget_follows_context_limit_and_floor() {
    if std::env::var("MLX_MODELS_TEST_DTYPE").is_ok() {
        return; // the block counts below are for f32 storage
    }
    let all = |c: PagedConfig| blocks("qwen3", PagedConfig { initial_blocks: None, block_size: 16, ..c });
    // the context: 512 * 768 B * 1.1 = 0.43 MB, + 1 MB slack -> 1.43 MB = 116 blocks
    assert_eq!(all(PagedConfig::default()), 116);
    // a limit below the context's need caps it: 0.2 MB + 1 MB slack -> 97 blocks
    assert_eq!(all(PagedConfig { memory_limit_mb: 0.2, ..Default::default() }), 97);
    // a floor above it raises it: 10 MB -> 813 blocks
    assert_eq!(all(PagedConfig { memory_floor_mb: Some(10.0), ..Default::default() }), 813);
    // an explicit budget wins over both: 4 MB -> 325 blocks
    assert_eq!(all(PagedConfig { memory_mb: Some(4.0), memory_limit_mb: 0.2, memory_floor_mb: Some(10.0), ..Default::default() }), 325);
}

#[test]
fn force_paged_per_family_takes_precedence() {
    let load = |name: &str, force: &[(&str, bool)]| {
        let force_paged: BTreeMap<String, bool> = force.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        load_model(fixture(name), &LoadOptions { force_paged, ..test_load_options() }).map(|m| m.into_lm().unwrap().paged_stats().is_some())
    };
    assert!(load("qwen3", &[]).unwrap(), "qwen3: paged by default");
    assert!(!load("qwen3", &[("qwen3", false)]).unwrap(), "forced flat");
    assert!(load("qwen3", &[("lfm2", false)]).unwrap(), "another family's entry does not apply");
    assert!(load("lfm2", &[]).unwrap(), "lfm2: paged by default, as in mlx-node");
    assert!(load("lfm2_moe", &[]).unwrap(), "lfm2_moe: paged by default");
    assert!(!load("lfm2", &[("lfm2", false)]).unwrap(), "forced flat");
    assert!(!load("qwen3_5", &[]).unwrap(), "qwen3_5: flat by default");
    assert!(load("qwen3_5", &[("qwen3_5", true)]).unwrap());
    assert!(load("qwen3", &[("qwen9", true)]).is_err(), "an unknown family is an error");
    // over config.json: a checkpoint that asks for the flat cache, forced paged
    let dir = std::env::temp_dir().join(format!("mlx-models-force-paged-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture("qwen3")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["use_block_paged_cache"] = serde_json::Value::Bool(false);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let opts = |force: &[(&str, bool)]| LoadOptions { force_paged: force.iter().map(|(k, v)| (k.to_string(), *v)).collect(), ..test_load_options() };
    assert!(load_model(&dir, &opts(&[])).unwrap().into_lm().unwrap().paged_stats().is_none(), "config.json asks for flat");
    assert!(load_model(&dir, &opts(&[("qwen3", true)])).unwrap().into_lm().unwrap().paged_stats().is_some(), "force_paged wins");
    std::fs::remove_dir_all(&dir).unwrap();
}
