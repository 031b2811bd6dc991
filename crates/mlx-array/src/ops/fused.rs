//! Chains of elementwise ops run as one kernel: functions compiled with MLX's `compile`, once
//! per thread and function (MLX's compile cache is per thread), as mlx-lm's `@mx.compile`d
//! helpers (`swiglu`, `gelu_approx`, the gated-delta step).
//!
//! On the GPU MLX generates the fused kernels itself. On the CPU it writes C++ and builds it
//! with `g++` at run time; whether the CPU backend fuses is the process-wide [`CpuFusion`]
//! setting ([`set_cpu_fusion`]), off by default. With it off [`fused`] runs the plain ops, so
//! results are the same either way (up to the rounding of fused arithmetic).
use crate::error::{OpExt, Result};
use crate::Array;
use mlx_rs::error::Exception;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

/// A function to fuse: array ops only, no captured state (it is traced once per input
/// shapes and dtypes, then replayed).
pub type FusedFn = fn(&[Array]) -> Result<Vec<Array>>;

type Compiled = Box<dyn for<'a> FnMut(&'a [mlx_rs::Array]) -> std::result::Result<Vec<mlx_rs::Array>, Exception>>;

thread_local! {
    static COMPILED: RefCell<HashMap<(usize, bool), Compiled>> = RefCell::new(HashMap::new());
}

/// Whether the CPU backend runs [`fused`] functions as compiled kernels.
///
/// `Off` (the default) runs their ops one by one. `On` compiles them through MLX, which on the
/// CPU needs a C++ compiler (`g++`) on the `PATH` when a kernel is first built: without one the
/// first fused call returns MLX's compile error. Off by default, so that running needs no C++
/// compiler; `llm_bench --cpu-fusion on|off` measures the difference on a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuFusion {
    #[default]
    Off,
    On,
}

static CPU_FUSION_ON: AtomicBool = AtomicBool::new(false);

/// Set whether the CPU backend fuses (process-wide; the GPU always fuses).
pub fn set_cpu_fusion(mode: CpuFusion) {
    CPU_FUSION_ON.store(mode == CpuFusion::On, Ordering::Relaxed);
}

/// The current [`CpuFusion`] setting.
pub fn cpu_fusion() -> CpuFusion {
    if CPU_FUSION_ON.load(Ordering::Relaxed) {
        CpuFusion::On
    } else {
        CpuFusion::Off
    }
}

/// `f(inputs)`, compiled (`shapeless`: one compilation for every input shape, only for
/// functions without reshapes) on the GPU and, with [`CpuFusion::On`], on the CPU; else run op
/// by op.
pub fn fused(f: FusedFn, shapeless: bool, inputs: &[&Array]) -> Result<Vec<Array>> {
    let xs: Vec<mlx_rs::Array> = inputs.iter().map(|a| a.inner.clone()).collect();
    let can = match crate::default_device()? {
        crate::Device::Gpu => true,
        crate::Device::Cpu => cpu_fusion() == CpuFusion::On,
    };
    let out = if can {
        COMPILED.with(|c| {
            let mut c = c.borrow_mut();
            let g = c.entry((f as usize, shapeless)).or_insert_with(|| {
                let traced = move |xs: &[mlx_rs::Array]| -> std::result::Result<Vec<mlx_rs::Array>, Exception> {
                    let wrapped: Vec<Array> = xs.iter().map(|x| Array::wrap(x.clone())).collect();
                    match f(&wrapped) {
                        Ok(v) => Ok(v.into_iter().map(|a| a.inner).collect()),
                        Err(e) => Err(Exception::custom(e.to_string())),
                    }
                };
                Box::new(mlx_rs::transforms::compile::compile(traced, shapeless))
            });
            g(&xs).op("fused").map(|v| v.into_iter().map(Array::wrap).collect())
        })
    } else {
        let wrapped: Vec<Array> = xs.into_iter().map(Array::wrap).collect();
        f(&wrapped)
    };
    out
}

fn swiglu_fn(x: &[Array]) -> Result<Vec<Array>> {
    Ok(vec![x[0].silu()?.mul(&x[1])?])
}

fn geglu_tanh_fn(x: &[Array]) -> Result<Vec<Array>> {
    Ok(vec![x[0].gelu_tanh()?.mul(&x[1])?])
}

impl Array {
    /// `silu(self) * up` (SwiGLU), one fused kernel where [`fused`] can compile.
    pub fn swiglu(&self, up: &Array) -> Result<Array> {
        Ok(fused(swiglu_fn, true, &[self, up])?.swap_remove(0))
    }
    /// `gelu_tanh(self) * up` (GeGLU with the tanh-approximated GELU), fused likewise.
    pub fn geglu_tanh(&self, up: &Array) -> Result<Array> {
        Ok(fused(geglu_tanh_fn, true, &[self, up])?.swap_remove(0))
    }
}
