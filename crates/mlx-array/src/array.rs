//! The [`Array`] handle: creation, properties, readback, evaluation.
use crate::error::{Error, OpExt, Result};
use crate::{DType, Element};

/// An n-dimensional MLX array (lazy: operations build a graph, [`Array::eval`] computes it).
///
/// Cloning is cheap (a reference count). `Array` is `Send`: it can move between threads, but
/// one array must not be used from two threads at once.
#[derive(Clone)]
pub struct Array {
    pub(crate) inner: mlx_rs::Array,
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Array({:?}, {})", self.shape(), self.dtype())
    }
}

pub(crate) fn check_shape(op: &'static str, shape: &[usize]) -> Result<Vec<i32>> {
    shape
        .iter()
        .map(|&d| i32::try_from(d).map_err(|_| Error::shape(op, format!("dimension {d} exceeds i32"))))
        .collect()
}

impl Array {
    pub(crate) fn wrap(inner: mlx_rs::Array) -> Self {
        Array { inner }
    }

    /// Escape hatch to the underlying mlx-rs array.
    pub fn as_mlx(&self) -> &mlx_rs::Array {
        &self.inner
    }

    /// Wrap an mlx-rs array.
    pub fn from_mlx(inner: mlx_rs::Array) -> Self {
        Array { inner }
    }

    /// An array holding a copy of `data` with the given shape (row-major).
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Self> {
        let dims = check_shape("from_slice", shape)?;
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::shape("from_slice", format!("{} elements for shape {shape:?} ({n})", data.len())));
        }
        Ok(Self::wrap(T::make_array(data, &dims)))
    }

    /// A 0-d array.
    pub fn scalar<T: Element>(v: T) -> Self {
        Self::wrap(T::make_array(&[v], &[]))
    }

    /// A 0-d array of `v` converted to `dtype`, on the host for every dtype with an [`Element`]
    /// type (the result is available at once, with no kernel behind it): a lazy
    /// `astype` would be one more kernel launch at every use on the GPU (Gemma 4's bf16 decode
    /// step launched 44 such one-element casts).
    pub fn scalar_as(v: f32, dtype: DType) -> Result<Self> {
        match dtype {
            DType::F32 => Ok(Self::scalar(v)),
            DType::BF16 => Ok(Self::scalar(half::bf16::from_f32(v))),
            DType::F16 => Ok(Self::scalar(half::f16::from_f32(v))),
            // As MLX's cast: toward zero, saturating (NaN reads 0).
            DType::I32 => Ok(Self::scalar(v as i32)),
            DType::U32 => Ok(Self::scalar(v as u32)),
            DType::I64 => Ok(Self::scalar(v as i64)),
            DType::U8 => Ok(Self::scalar(v as u8)),
            DType::I8 => Ok(Self::scalar(v as i8)),
            DType::Bool => Ok(Self::scalar(v != 0.0)),
            _ => Self::scalar(v).astype(dtype),
        }
    }

    /// Zeros.
    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Self> {
        let dims = check_shape("zeros", shape)?;
        mlx_rs::ops::zeros_dtype(&dims, dtype.to_mlx()).op("zeros").map(Self::wrap)
    }

    /// Ones.
    pub fn ones(shape: &[usize], dtype: DType) -> Result<Self> {
        let dims = check_shape("ones", shape)?;
        mlx_rs::ops::ones_dtype(&dims, dtype.to_mlx()).op("ones").map(Self::wrap)
    }

    /// Every element `value`.
    pub fn full(shape: &[usize], value: f32, dtype: DType) -> Result<Self> {
        let dims = check_shape("full", shape)?;
        let v = Self::scalar(value).astype(dtype)?;
        mlx_rs::ops::broadcast_to(&v.inner, &dims).op("full").map(Self::wrap)
    }

    /// `start, start+1, ..., stop-1` as a 1-d array of `dtype`.
    pub fn arange(start: i64, stop: i64, dtype: DType) -> Result<Self> {
        if stop < start {
            return Err(Error::arg("arange", format!("stop {stop} < start {start}")));
        }
        let n = usize::try_from(stop - start).map_err(|_| Error::arg("arange", "range too long"))?;
        let dims = check_shape("arange", &[n])?;
        // Built in i32, then converted: f64 arrays do not exist on the GPU backends.
        let (s32, e32) = (i32::try_from(start), i32::try_from(stop));
        let (Ok(s32), Ok(e32)) = (s32, e32) else { return Err(Error::arg("arange", "bounds exceed i32")) };
        let a = mlx_rs::Array::arange::<_, i32>(s32, e32, None).op("arange")?;
        let a = mlx_rs::ops::reshape(&a, &dims).op("arange")?;
        Self::wrap(a).astype(dtype)
    }

    /// Shape as `usize` dimensions.
    pub fn shape(&self) -> Vec<usize> {
        self.inner.shape().iter().map(|&d| d as usize).collect()
    }

    /// Shape as MLX's `i32` dimensions.
    pub fn dims(&self) -> &[i32] {
        self.inner.shape()
    }

    /// Size of dimension `axis` (negative counts from the end).
    pub fn dim(&self, axis: isize) -> Result<usize> {
        let n = self.ndim() as isize;
        let a = if axis < 0 { axis + n } else { axis };
        if a < 0 || a >= n {
            return Err(Error::shape("dim", format!("axis {axis} out of range for {}-d array", n)));
        }
        Ok(self.inner.shape()[a as usize] as usize)
    }

    pub fn ndim(&self) -> usize {
        self.inner.ndim()
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        self.inner.size()
    }

    /// Bytes of the array's data.
    pub fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    pub fn dtype(&self) -> DType {
        DType::from_mlx(self.inner.dtype())
    }

    /// Convert element type.
    pub fn astype(&self, dtype: DType) -> Result<Self> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        self.inner.as_dtype(dtype.to_mlx()).op("astype").map(Self::wrap)
    }

    /// Compute this array (and what it depends on) and wait for it. An array already queued
    /// by [`async_eval`], on any thread, is only waited for (on its own completion event): unlike
    /// [`eval`] of several arrays this needs no stream of the calling thread.
    pub fn eval(&self) -> Result<()> {
        self.inner.eval().op("eval")
    }

    /// Whether the data is ready to read without waiting: evaluated, or queued by
    /// [`async_eval`] and finished. A lazy array that was never evaluated is not.
    pub fn is_available(&self) -> bool {
        let mut ready = false;
        // SAFETY: `inner` is a live mlx_array; the call only reads its status and event.
        let rc = unsafe { mlx_sys::_mlx_array_is_available(&mut ready, self.inner.as_ptr()) };
        rc == 0 && ready
    }

    /// Evaluate and copy out the elements in row-major order; `T` must match [`Array::dtype`].
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.dtype() != <T as Element>::DTYPE {
            return Err(Error::DType { op: "to_vec", expected: <T as Element>::DTYPE.to_string(), got: self.dtype().to_string() });
        }
        if self.size() == 0 {
            return Ok(Vec::new()); // MLX allocates no buffer for an empty array
        }
        // Evaluated (or already queued by `async_eval`) and row-major: read it in place. This
        // only waits for this array. Building a reshape/copy first would queue new work behind
        // everything already on the stream, so a decode loop that queued step n + 1 before
        // reading token n would wait for step n + 1 as well (no overlap left).
        if let Ok(s) = self.inner.try_as_slice::<T>() {
            return Ok(s.to_vec());
        }
        // A transposed or broadcast view is not laid out row-major: reshape + contiguous copy it
        // (reshape alone may keep a broadcast's zero stride).
        let flat = mlx_rs::ops::reshape(&self.inner, &[-1]).op("to_vec")?.contiguous().op("to_vec")?;
        flat.eval().op("to_vec")?;
        flat.try_as_slice::<T>()
            .map(|s| s.to_vec())
            .map_err(|e| Error::Mlx { op: "to_vec", msg: e.to_string() })
    }

    /// Evaluate, convert to f32 and copy out.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        self.astype(DType::F32)?.to_vec()
    }

    /// The single element of a one-element array.
    pub fn item<T: Element>(&self) -> Result<T> {
        if self.size() != 1 {
            return Err(Error::shape("item", format!("array of shape {:?} has {} elements", self.shape(), self.size())));
        }
        Ok(self.to_vec::<T>()?[0])
    }

    /// The single element, converted to f32.
    pub fn item_f32(&self) -> Result<f32> {
        self.astype(DType::F32)?.item()
    }
}

/// Evaluate several arrays together (one graph traversal).
pub fn eval(arrays: &[&Array]) -> Result<()> {
    mlx_rs::transforms::eval(arrays.iter().map(|a| &a.inner)).op("eval")
}

/// The primitives evaluating `arrays` together would run: the graph's node count and the count
/// per primitive name (most frequent first). Nothing is evaluated. For measuring what a step
/// asks of the backend (each node is host work: an allocation, a kernel launch or a graph node).
pub fn graph_nodes(arrays: &[&Array]) -> Result<(usize, Vec<(String, usize)>)> {
    let raw: Vec<mlx_sys::mlx_array> = arrays.iter().map(|a| a.inner.as_ptr()).collect();
    let count = i32::try_from(raw.len()).map_err(|_| Error::arg("graph_nodes", "too many arrays"))?;
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0;
    crate::ffi::status("graph_nodes", || {
        n = unsafe { mlx_sys::mlx_models_graph_nodes(raw.as_ptr(), count, buf.as_mut_ptr().cast(), buf.len()) };
        i32::from(n < 0)
    })?;
    let text = std::ffi::CStr::from_bytes_until_nul(&buf).map_err(|e| Error::shape("graph_nodes", e.to_string()))?;
    let rows = text
        .to_string_lossy()
        .lines()
        .filter_map(|l| l.rsplit_once(' ').and_then(|(name, c)| Some((name.to_string(), c.parse().ok()?))))
        .collect();
    Ok((n as usize, rows))
}

/// Start evaluating arrays in the background; a later [`eval`] or readback waits for them.
///
/// Work still queued when the process exits is waited for before the shared libraries are torn
/// down (see [`wait_for_queued_work_at_exit`]).
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    wait_for_queued_work_at_exit();
    mlx_rs::transforms::async_eval(arrays.iter().map(|a| &a.inner)).op("async_eval")
}

/// Wait for the work this thread queued on MLX's default stream (of the default device): its
/// arrays are then computed, and arrays that were only queued ([`async_eval`]) can be read or
/// used from another thread. Lazy arrays never queued still belong to this thread.
pub fn synchronize() -> Result<()> {
    crate::ffi::status("synchronize", || unsafe { mlx_sys::mlx_synchronize_default() })
}

/// Waits for the thread's queued MLX work when the thread's locals are destroyed.
struct WaitOnExit;

impl Drop for WaitOnExit {
    fn drop(&mut self) {
        // Nothing can be reported from a thread-local destructor; a failure leaves the exit as
        // it would have been.
        let _ = unsafe { mlx_sys::mlx_synchronize_default() };
    }
}

thread_local! {
    static WAIT_ON_EXIT: WaitOnExit = const { WaitOnExit };
}

/// Make this thread's exit (the process's, on the main thread) wait for the work it queued on
/// MLX's default stream. [`async_eval`] calls it.
///
/// A program that returns from `main` while MLX's stream thread still runs queued work races
/// the exit handlers: OpenBLAS's (`gotoblas_quit`, from `_dl_fini`) joins its worker threads
/// and can wait forever on a worker that the in-flight BLAS call left parked, and MLX's
/// allocator destroyed under a running task corrupts the heap (aborts in `malloc_consolidate`,
/// segfaults). The wait runs as a thread-local destructor: those run at exit before the atexit
/// handlers and `_dl_fini`, in reverse order of registration, so after this thread's first
/// `async_eval` it runs before MLX's own thread-local state is destroyed.
pub fn wait_for_queued_work_at_exit() {
    WAIT_ON_EXIT.with(|_| {});
}
