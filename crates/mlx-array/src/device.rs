//! Devices, streams and MLX's memory counters.
use crate::error::{OpExt, Result};

/// Where operations run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// Metal on macOS, CUDA on Linux with the CUDA build of libmlx.
    Gpu,
}

impl Device {
    fn to_mlx(self) -> mlx_rs::Device {
        match self {
            Device::Cpu => mlx_rs::Device::cpu(),
            Device::Gpu => mlx_rs::Device::gpu(),
        }
    }
}

/// Whether the loaded libmlx has a usable GPU backend (CUDA or Metal) and a device for it.
pub fn gpu_available() -> bool {
    let mut ok = false;
    let dev = unsafe { mlx_sys::mlx_device_new_type(mlx_sys::mlx_device_type__MLX_GPU, 0) };
    let st = unsafe { mlx_sys::mlx_device_is_available(&mut ok, dev) };
    unsafe { mlx_sys::mlx_device_free(dev) };
    st == 0 && ok
}

/// Make `device` the process-wide default for new operations.
pub fn set_default_device(device: Device) {
    mlx_rs::Device::set_default(&device.to_mlx());
}

/// The process-wide default device.
pub fn default_device() -> Result<Device> {
    let d = mlx_rs::Device::try_default().op("default_device")?;
    Ok(match d.get_type().op("default_device")? {
        mlx_rs::DeviceType::Gpu => Device::Gpu,
        _ => Device::Cpu,
    })
}

/// An MLX stream: an ordered queue of work on one device.
#[derive(Clone)]
pub struct Stream(mlx_rs::Stream);

impl Stream {
    /// A new stream on `device`.
    pub fn new(device: Device) -> Self {
        Stream(mlx_rs::Stream::new_with_device(&device.to_mlx()))
    }
    /// Wait for all work queued on this stream.
    pub fn synchronize(&self) -> Result<()> {
        crate::ffi::status("synchronize", || unsafe { mlx_sys::mlx_synchronize(self.0.as_ptr()) })
    }
}

/// Run `f` with operations it builds on this thread placed on `stream`.
pub fn with_stream<R>(stream: &Stream, f: impl FnOnce() -> R) -> R {
    mlx_rs::with_stream(&stream.0, f)
}

/// Run `f` with operations it builds on this thread placed on `device`'s default stream.
pub fn with_device<R>(device: Device, f: impl FnOnce() -> R) -> R {
    mlx_rs::with_device(device.to_mlx(), f)
}

/// MLX's allocator counters, in bytes.
pub mod memory {
    use super::*;
    /// Bytes held by live arrays.
    pub fn active() -> Result<usize> {
        mlx_rs::memory::active_memory().op("active_memory")
    }
    /// Highest `active()` since start or the last [`reset_peak`].
    pub fn peak() -> Result<usize> {
        mlx_rs::memory::peak_memory().op("peak_memory")
    }
    /// Bytes kept in MLX's buffer cache for reuse.
    pub fn cache() -> Result<usize> {
        mlx_rs::memory::cache_memory().op("cache_memory")
    }
    pub fn reset_peak() -> Result<()> {
        mlx_rs::memory::reset_peak_memory().op("reset_peak_memory")
    }
    /// Free the buffer cache.
    pub fn clear_cache() -> Result<()> {
        mlx_rs::memory::clear_cache().op("clear_cache")
    }
    /// Cap the buffer cache; returns the previous limit.
    pub fn set_cache_limit(bytes: usize) -> Result<usize> {
        mlx_rs::memory::set_cache_limit(bytes).op("set_cache_limit")
    }
    /// Cap total memory; returns the previous limit.
    pub fn set_memory_limit(bytes: usize) -> Result<usize> {
        mlx_rs::memory::set_memory_limit(bytes).op("set_memory_limit")
    }
}
