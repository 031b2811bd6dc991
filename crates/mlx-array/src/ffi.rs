//! Calling mlx-c directly (for what mlx-rs 0.33 does not wrap), with MLX's error message.
//!
//! mlx-c reports failures through one process-wide error handler whose default prints and calls
//! `exit(-1)`. mlx-rs installs its own handler lazily, on its first fallible call, and keeps the
//! message in a thread-local that only mlx-rs can read. Here we install a handler once, after
//! mlx-rs's (so mlx-rs cannot replace it later), that records the message for us and passes it
//! on to mlx-rs's handler, so both kinds of call report MLX's text and neither can abort.
use crate::error::{Error, Result};
use crate::Array;
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr};
use std::sync::Once;

thread_local! {
    static LAST_ERROR: RefCell<Option<String>> = const { RefCell::new(None) };
}

extern "C" {
    // mlx-rs 0.33's handler (`#[no_mangle]` in mlx_rs::error): stores the message for mlx-rs.
    fn default_mlx_error_handler(msg: *const c_char, data: *mut c_void);
}

extern "C" fn handler(msg: *const c_char, data: *mut c_void) {
    let text = if msg.is_null() { String::new() } else { unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned() };
    LAST_ERROR.with(|l| *l.borrow_mut() = Some(text));
    unsafe { default_mlx_error_handler(msg, data) };
}

static INIT: Once = Once::new();

/// Install the error handler (idempotent, cheap after the first call).
pub(crate) fn ensure_handler() {
    INIT.call_once(|| {
        // Any fallible mlx-rs call makes mlx-rs register its handler (once per process) ...
        let _ = mlx_rs::random::key(0);
        // ... which ours then replaces for good.
        unsafe { mlx_sys::mlx_set_error_handler(Some(handler), std::ptr::null_mut(), None) };
    });
}

/// The message MLX reported on this thread since the last call, cleaned of mlx-c's source location.
pub(crate) fn take_error(op: &'static str, status: i32) -> Error {
    let msg = LAST_ERROR.with(|l| l.borrow_mut().take()).unwrap_or_else(|| format!("failed with status {status}"));
    Error::mlx(op, mlx_rs::error::Exception::custom(msg))
}

/// The thread's current stream (set by [`crate::with_stream`] / [`crate::with_device`]).
pub(crate) fn stream() -> mlx_rs::Stream {
    mlx_rs::Stream::thread_local_or_default()
}

/// Run an mlx-c op that writes one array; a non-zero status becomes [`Error::Mlx`] with MLX's message.
pub(crate) fn call(op: &'static str, f: impl FnOnce(*mut mlx_sys::mlx_array) -> i32) -> Result<Array> {
    ensure_handler();
    LAST_ERROR.with(|l| l.borrow_mut().take());
    let mut res = unsafe { mlx_sys::mlx_array_new() };
    let st = f(&mut res);
    let out = unsafe { mlx_rs::Array::from_ptr(res) }; // frees `res` on every path
    if st != 0 {
        return Err(take_error(op, st));
    }
    Ok(Array::wrap(out))
}

/// Run an mlx-c op that writes `N` arrays (all of them set on success).
pub(crate) fn call_n<const N: usize>(op: &'static str, f: impl FnOnce(&mut [mlx_sys::mlx_array; N]) -> i32) -> Result<[Array; N]> {
    ensure_handler();
    LAST_ERROR.with(|l| l.borrow_mut().take());
    let mut res: [mlx_sys::mlx_array; N] = std::array::from_fn(|_| unsafe { mlx_sys::mlx_array_new() });
    let st = f(&mut res);
    let out = res.map(|r| Array::wrap(unsafe { mlx_rs::Array::from_ptr(r) })); // frees every handle
    if st != 0 {
        return Err(take_error(op, st));
    }
    Ok(out)
}

/// Run an mlx-c call that only returns a status.
pub(crate) fn status(op: &'static str, f: impl FnOnce() -> i32) -> Result<()> {
    ensure_handler();
    LAST_ERROR.with(|l| l.borrow_mut().take());
    match f() {
        0 => Ok(()),
        st => Err(take_error(op, st)),
    }
}
