//! Observability: MLX's allocator counters and per-phase timings of generation.
//!
//! Memory ([`memory_stats`], [`memory_snapshot`], [`reset_peak_memory`], [`set_cache_limit`],
//! [`clear_cache`]) reads MLX's allocator, process-wide, in bytes. Profiling is off by default;
//! [`set_profiling_enabled`] turns it on, after which [`crate::generate()`] records the `prefill`
//! (prompt forward passes up to the first sampled token) and `decode` (one generated token)
//! phases, and callers may add their own with [`record_phase`]. [`profiling_data`] summarizes
//! the phases since the last [`reset_profiling_data`].
//!
//! ```
//! use mlx_models::observe;
//! observe::reset_peak_memory()?;
//! let m = observe::memory_stats()?;
//! assert!(m.peak >= m.active);
//! observe::set_profiling_enabled(true);
//! observe::record_phase("tokenize", std::time::Duration::from_micros(250));
//! let p = observe::profiling_data();
//! assert_eq!(p.phases.iter().find(|x| x.name == "tokenize").unwrap().count, 1);
//! observe::set_profiling_enabled(false);
//! observe::reset_profiling_data();
//! # Ok::<(), mlx_models::ModelError>(())
//! ```
use crate::Result;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// MLX's allocator state, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryStats {
    /// Held by live arrays (excludes the buffer cache).
    pub active: usize,
    /// Highest `active` since start or the last [`reset_peak_memory`].
    pub peak: usize,
    /// Free buffers MLX keeps for reuse (released by [`clear_cache`]).
    pub cache: usize,
    /// Metal's `max_recommended_working_set_size`, the ceiling of wired memory (0 on the CPU
    /// and CUDA backends, which have no wired limit).
    pub wired_limit: usize,
    /// MLX's memory limit (allocations beyond it wait for memory to be freed or fail).
    pub memory_limit: usize,
}

/// The three counters that change while running, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemorySnapshot {
    pub active: usize,
    pub peak: usize,
    pub cache: usize,
}

fn status(what: &str, rc: std::os::raw::c_int) -> Result<()> {
    if rc != 0 {
        return Err(crate::ModelError::InvalidInput(format!(
            "MLX {what} failed (status {rc})"
        )));
    }
    Ok(())
}

/// Metal's recommended working-set size; 0 without Metal.
fn metal_working_set() -> usize {
    let mut metal = false;
    // SAFETY: plain out-parameter calls into mlx-c; the device and info objects are freed here.
    unsafe {
        if mlx_sys::mlx_metal_is_available(&mut metal) != 0 || !metal {
            return 0;
        }
        let dev = mlx_sys::mlx_device_new_type(mlx_sys::mlx_device_type__MLX_GPU, 0);
        let mut info = mlx_sys::mlx_device_info_new();
        let mut v = 0usize;
        if mlx_sys::mlx_device_info_get(&mut info, dev) == 0 {
            let key = c"max_recommended_working_set_size";
            if mlx_sys::mlx_device_info_get_size(&mut v, info, key.as_ptr()) != 0 {
                v = 0;
            }
        }
        mlx_sys::mlx_device_info_free(info);
        mlx_sys::mlx_device_free(dev);
        v
    }
}

/// The allocator's counters and limits.
pub fn memory_stats() -> Result<MemoryStats> {
    let s = memory_snapshot()?;
    let mut limit = 0usize;
    // SAFETY: out-parameter call into mlx-c.
    status("get_memory_limit", unsafe {
        mlx_sys::mlx_get_memory_limit(&mut limit)
    })?;
    Ok(MemoryStats {
        active: s.active,
        peak: s.peak,
        cache: s.cache,
        wired_limit: metal_working_set(),
        memory_limit: limit,
    })
}

/// Active, peak and cache bytes now.
pub fn memory_snapshot() -> Result<MemorySnapshot> {
    use mlx_array::memory;
    Ok(MemorySnapshot {
        active: memory::active()?,
        peak: memory::peak()?,
        cache: memory::cache()?,
    })
}

/// Reset the peak counter to the current active bytes (measure one request's peak: reset
/// before it, read [`memory_snapshot`]`().peak` after).
pub fn reset_peak_memory() -> Result<()> {
    Ok(mlx_array::memory::reset_peak()?)
}

/// Cap the buffer cache at `bytes`; returns the previous cap.
pub fn set_cache_limit(bytes: usize) -> Result<usize> {
    Ok(mlx_array::memory::set_cache_limit(bytes)?)
}

/// Release the buffer cache.
pub fn clear_cache() -> Result<()> {
    Ok(mlx_array::memory::clear_cache()?)
}

/// Set the wired-memory limit (Metal; a no-op returning 0 on other backends); returns the
/// previous limit.
pub fn set_wired_limit(bytes: usize) -> Result<usize> {
    let mut prev = 0usize;
    // SAFETY: out-parameter call into mlx-c.
    status("set_wired_limit", unsafe {
        mlx_sys::mlx_set_wired_limit(&mut prev, bytes)
    })?;
    Ok(prev)
}

/// Timings of one phase.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PhaseProfile {
    pub name: String,
    pub count: u64,
    pub total_ms: f64,
    pub mean_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
}

/// Every phase recorded since the last reset.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ProfilingData {
    pub enabled: bool,
    /// Seconds since the last [`reset_profiling_data`] (or the first recording).
    pub elapsed_secs: f64,
    /// By name.
    pub phases: Vec<PhaseProfile>,
}

static ENABLED: AtomicBool = AtomicBool::new(false);

struct Phases {
    since: Option<Instant>,
    by_name: BTreeMap<String, PhaseProfile>,
}

static PHASES: Mutex<Phases> = Mutex::new(Phases {
    since: None,
    by_name: BTreeMap::new(),
});

pub fn set_profiling_enabled(on: bool) {
    ENABLED.store(on, Ordering::SeqCst);
}

pub fn is_profiling_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Add one occurrence of phase `name` lasting `d` (ignored while profiling is off).
pub fn record_phase(name: &str, d: Duration) {
    if !is_profiling_enabled() {
        return;
    }
    let ms = d.as_secs_f64() * 1e3;
    let mut p = PHASES.lock().unwrap_or_else(|e| e.into_inner());
    p.since.get_or_insert_with(Instant::now);
    let e = p
        .by_name
        .entry(name.to_string())
        .or_insert_with(|| PhaseProfile {
            name: name.to_string(),
            min_ms: f64::INFINITY,
            ..Default::default()
        });
    e.count += 1;
    e.total_ms += ms;
    e.mean_ms = e.total_ms / e.count as f64;
    e.min_ms = e.min_ms.min(ms);
    e.max_ms = e.max_ms.max(ms);
}

/// The recorded phases.
pub fn profiling_data() -> ProfilingData {
    let p = PHASES.lock().unwrap_or_else(|e| e.into_inner());
    ProfilingData {
        enabled: is_profiling_enabled(),
        elapsed_secs: p.since.map_or(0.0, |s| s.elapsed().as_secs_f64()),
        phases: p.by_name.values().cloned().collect(),
    }
}

/// Forget every recorded phase.
pub fn reset_profiling_data() {
    let mut p = PHASES.lock().unwrap_or_else(|e| e.into_inner());
    p.by_name.clear();
    p.since = Some(Instant::now());
}
