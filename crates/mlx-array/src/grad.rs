//! Automatic differentiation for training.
use crate::error::{Error, OpExt, Result};
use crate::Array;
use std::cell::RefCell;

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
    let (mut values, grads) = result.op("value_and_grad")?;
    if values.is_empty() || grads.len() != params.len() {
        return Err(Error::Mlx { op: "value_and_grad", msg: format!("MLX returned {} values and {} gradients", values.len(), grads.len()) });
    }
    Ok((Array::wrap(values.swap_remove(0)), grads.into_iter().map(Array::wrap).collect()))
}
