//! Automatic differentiation for training.
use crate::error::{Error, OpExt, Result};
use crate::Array;
use std::cell::RefCell;

/// `a` unchanged, as a constant to gradient transforms: nothing flows back through it. Integer
/// results that index (top-k routing ids) need it before a gather, whose gradient with
/// respect to its indices MLX refuses.
///
/// ```
/// use mlx_array::{grad::{stop_gradient, value_and_grad}, Array};
/// # fn main() -> mlx_array::Result<()> {
/// let x = Array::from_slice(&[1.0f32, 2., 3.], &[3])?;
/// // loss = sum(x * stop_gradient(x)): d loss / dx = x
/// let (_, grads) = value_and_grad(|p| p[0].mul(&stop_gradient(&p[0])?)?.sum(&[], false), &[x])?;
/// assert_eq!(grads[0].to_vec::<f32>()?, vec![1., 2., 3.]);
/// # Ok(()) }
/// ```
pub fn stop_gradient(a: &Array) -> Result<Array> {
    mlx_rs::stop_gradient(&a.inner).op("stop_gradient").map(Array::wrap)
}

/// The value of a scalar loss `f(params)` and its gradient with respect to every parameter
/// (`grads[i]` has `params[i]`'s shape).
///
/// `f` is traced by MLX (it may run once per call); data other than the parameters can be
/// captured by the closure. An error returned by `f` comes back unchanged; a non-scalar loss is
/// an [`Error::Shape`].
///
/// ```
/// use mlx_array::{grad::value_and_grad, Array};
/// # fn main() -> mlx_array::Result<()> {
/// let x = Array::from_slice(&[1.0f32, 2., 3.], &[3])?;
/// // loss = sum(x^2), d loss / dx = 2x
/// let (loss, grads) = value_and_grad(|p| p[0].square()?.sum(&[], false), &[x])?;
/// assert_eq!(loss.item::<f32>()?, 14.0);
/// assert_eq!(grads[0].to_vec::<f32>()?, vec![2., 4., 6.]);
/// # Ok(()) }
/// ```
pub fn value_and_grad<F>(f: F, params: &[Array]) -> Result<(Array, Vec<Array>)>
where
    F: Fn(&[Array]) -> Result<Array>,
{
    if params.is_empty() {
        return Err(Error::arg("value_and_grad", "no parameters to differentiate"));
    }
    let n = i32::try_from(params.len()).map_err(|_| Error::arg("value_and_grad", "too many parameters"))?;
    // Our error, kept aside while MLX only sees a message, returned as it was.
    let failure: RefCell<Option<Error>> = RefCell::new(None);
    let fail = |e: Error| {
        let msg = e.to_string();
        *failure.borrow_mut() = Some(e);
        Err(mlx_rs::error::Exception::custom(msg))
    };
    let closure = |xs: &[mlx_rs::Array]| -> std::result::Result<Vec<mlx_rs::Array>, mlx_rs::error::Exception> {
        let wrapped: Vec<Array> = xs.iter().map(|x| Array::wrap(x.clone())).collect();
        match f(&wrapped) {
            Ok(loss) if loss.size() == 1 => Ok(vec![loss.inner]),
            Ok(loss) => fail(Error::shape("value_and_grad", format!("the loss must be a scalar, got shape {:?}", loss.shape()))),
            Err(e) => fail(e),
        }
    };
    let argnums: Vec<i32> = (0..n).collect();
    let inputs: Vec<mlx_rs::Array> = params.iter().map(|p| p.inner.clone()).collect();
    let result = {
        let mut vg = mlx_rs::transforms::value_and_grad_with_argnums(closure, argnums.as_slice());
        vg(&inputs)
    };
    if let Some(e) = failure.take() {
        return Err(e);
    }
    // a checkpointed function that failed when the backward pass ran it again
    if let (Err(_), Some(e)) = (&result, take_closure_error()) {
        return Err(e);
    }
    let (mut values, grads) = result.op("value_and_grad")?;
    if values.is_empty() || grads.len() != params.len() {
        return Err(Error::Mlx { op: "value_and_grad", msg: format!("MLX returned {} values and {} gradients", values.len(), grads.len()) });
    }
    Ok((Array::wrap(values.swap_remove(0)), grads.into_iter().map(Array::wrap).collect()))
}

thread_local! {
    /// The error a [`checkpoint`]ed function returned when MLX called it (in the forward pass,
    /// or again while a gradient transform recomputes it), until the caller that sees the
    /// failure takes it.
    static CLOSURE_ERROR: RefCell<Option<Error>> = const { RefCell::new(None) };
}

fn take_closure_error() -> Option<Error> {
    CLOSURE_ERROR.with(|e| e.borrow_mut().take())
}

/// `f(inputs)`, with MLX's gradient checkpointing (`mx.checkpoint`): the intermediate arrays of
/// `f` are not kept for a gradient transform's backward pass; `f` runs again there to rebuild
/// them. Outside a gradient transform this is just `f(inputs)`.
///
/// Gradients flow only to `inputs`: an array that `f` captures instead of receiving is a
/// constant to the transform, so every array the result depends on through the differentiated
/// parameters must be passed in `inputs`. `f` owns what it captures because MLX keeps it for
/// the backward pass; it may run several times and must compute the same function each time.
///
/// ```
/// use mlx_array::{grad::{checkpoint, value_and_grad}, Array};
/// # fn main() -> mlx_array::Result<()> {
/// let x = Array::from_slice(&[1.0f32, 2., 3.], &[3])?;
/// // loss = sum((x^2)^2) with the inner square checkpointed: d loss / dx = 4 x^3
/// let (loss, grads) = value_and_grad(|p| checkpoint(|ins| Ok(vec![ins[0].square()?]), p)?[0].square()?.sum(&[], false), &[x])?;
/// assert_eq!(loss.item::<f32>()?, 98.0);
/// assert_eq!(grads[0].to_vec::<f32>()?, vec![4., 32., 108.]);
/// # Ok(()) }
/// ```
pub fn checkpoint<F>(f: F, inputs: &[Array]) -> Result<Vec<Array>>
where
    F: Fn(&[Array]) -> Result<Vec<Array>> + 'static,
{
    let fun = RawClosure::new(f);
    let mut ck = RawClosure(unsafe { mlx_sys::mlx_closure_new() });
    crate::ffi::status("checkpoint", || unsafe { mlx_sys::mlx_checkpoint(&mut ck.0, fun.0) })?;
    ck.apply("checkpoint", inputs)
}

/// An owned mlx-c closure handle.
struct RawClosure(mlx_sys::mlx_closure);

impl RawClosure {
    /// `f` as an mlx-c closure. mlx-c owns `f` from here and drops it (`drop_payload::<F>`)
    /// when the last copy of the closure goes (the checkpointed function and MLX's graph hold
    /// copies).
    fn new<F>(f: F) -> Self
    where
        F: Fn(&[Array]) -> Result<Vec<Array>> + 'static,
    {
        crate::ffi::ensure_handler();
        let payload = Box::into_raw(Box::new(f)) as *mut std::ffi::c_void;
        RawClosure(unsafe { mlx_sys::mlx_closure_new_func_payload(Some(call_payload::<F>), payload, Some(drop_payload::<F>)) })
    }

    /// The closure applied to `inputs`; the error of a Rust function inside, as it returned it.
    fn apply(&self, op: &'static str, inputs: &[Array]) -> Result<Vec<Array>> {
        let ptrs: Vec<mlx_sys::mlx_array> = inputs.iter().map(|a| a.inner.as_ptr()).collect();
        // SAFETY: `ptrs` holds live arrays; mlx-c copies the handles (reference counts).
        let ins = unsafe { mlx_sys::mlx_vector_array_new_data(ptrs.as_ptr(), ptrs.len()) };
        let mut out = unsafe { mlx_sys::mlx_vector_array_new() };
        take_closure_error();
        let applied = crate::ffi::status(op, || unsafe { mlx_sys::mlx_closure_apply(&mut out, self.0, ins) });
        let res = vector_values(out);
        unsafe {
            mlx_sys::mlx_vector_array_free(out);
            mlx_sys::mlx_vector_array_free(ins);
        }
        match applied {
            Ok(()) => Ok(res),
            Err(e) => Err(take_closure_error().unwrap_or(e)),
        }
    }
}

impl Drop for RawClosure {
    fn drop(&mut self) {
        unsafe { mlx_sys::mlx_closure_free(self.0) };
    }
}

/// The arrays of an mlx-c vector (new handles).
fn vector_values(v: mlx_sys::mlx_vector_array) -> Vec<Array> {
    (0..unsafe { mlx_sys::mlx_vector_array_size(v) })
        .map(|i| {
            let mut a = unsafe { mlx_sys::mlx_array_new() };
            unsafe { mlx_sys::mlx_vector_array_get(&mut a, v, i) };
            Array::wrap(unsafe { mlx_rs::Array::from_ptr(a) })
        })
        .collect()
}

extern "C" fn call_payload<F>(ret: *mut mlx_sys::mlx_vector_array, input: mlx_sys::mlx_vector_array, payload: *mut std::ffi::c_void) -> std::ffi::c_int
where
    F: Fn(&[Array]) -> Result<Vec<Array>> + 'static,
{
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `payload` is the `F` boxed by `checkpoint`, alive while mlx-c holds the closure.
        let f = unsafe { &*(payload as *const F) };
        f(&vector_values(input))
    }));
    let outputs = match run {
        Ok(Ok(outputs)) => outputs,
        Ok(Err(e)) => {
            CLOSURE_ERROR.with(|c| *c.borrow_mut() = Some(e));
            return 1;
        }
        Err(_) => {
            CLOSURE_ERROR.with(|c| *c.borrow_mut() = Some(Error::arg("checkpoint", "the checkpointed function panicked")));
            return 1;
        }
    };
    let ptrs: Vec<mlx_sys::mlx_array> = outputs.iter().map(|a| a.inner.as_ptr()).collect();
    // SAFETY: `ret` is the vector mlx-c made for the result; the handles are copied.
    unsafe { mlx_sys::mlx_vector_array_set_data(ret, ptrs.as_ptr(), ptrs.len()) }
}

extern "C" fn drop_payload<F>(payload: *mut std::ffi::c_void) {
    if !payload.is_null() {
        // SAFETY: made by `Box::into_raw` in `checkpoint`; mlx-c calls this once.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(unsafe { Box::from_raw(payload as *mut F) })));
    }
}
