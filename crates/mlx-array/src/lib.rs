//! # mlx-array
//!
//! A narrow, safe array API over [mlx-rs](https://crates.io/crates/mlx-rs): the operations that
//! LLM inference and training need, each returning [`Result`] with MLX's message on failure
//! (never an abort), plus safetensors weights I/O.
//!
//! Modules: [`ops`] (free functions over several arrays; most ops are methods on [`Array`]),
//! [`io`] (safetensors), [`distributed`] (multi-process collectives), [`random`] (seeded keys), [`grad`] (`value_and_grad`), [`memory`].
//!
//! ```
//! use mlx_array::{Array, DType};
//! # fn main() -> mlx_array::Result<()> {
//! let a = Array::from_slice(&[1.0f32, 2., 3., 4., 5., 6.], &[2, 3])?;
//! let b = Array::from_slice(&[1.0f32, 0., 0., 1., 1., 1.], &[3, 2])?;
//! let c = Array::full(&[2, 2], 1.0, DType::F32)?;
//! // addmm is computed explicitly: alpha * (a @ b) + beta * c
//! let y = a.addmm(&b, &c, 1.0, 2.0)?;
//! assert_eq!(y.to_vec::<f32>()?, vec![6., 7., 12., 13.]);
//! // Errors are values, with MLX's explanation:
//! assert!(a.matmul(&a).is_err());
//! # Ok(()) }
//! ```
mod array;
mod device;
pub mod distributed;
mod dtype;
mod error;
mod ffi;
pub mod grad;
pub mod io;
pub mod libmlx;
pub mod ops;
pub mod random;

pub use array::{async_eval, eval, graph_nodes, synchronize, wait_for_queued_work_at_exit, Array};
pub use device::{default_device, gpu_available, memory, set_default_device, with_device, with_stream, Device, Stream};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use ops::{AttentionMask, QuantMode, Quantized, RopeConfig};
