#[cfg(test)]
mod t {
    #[test]
    fn smoke() {
        let a = mlx_rs::Array::from_slice(&[1.0f32, 2., 3., 4., 5., 6.], &[2, 3]);
        let b = mlx_rs::Array::from_slice(&[1.0f32, 0., 0., 1., 1., 1.], &[3, 2]);
        let c = mlx_rs::ops::matmul(&a, &b).unwrap();
        assert_eq!(c.as_slice::<f32>(), &[4., 5., 10., 11.]);
        let bad = mlx_rs::ops::matmul(&a, &a);
        println!("{:?}", bad.err());
    }
}
