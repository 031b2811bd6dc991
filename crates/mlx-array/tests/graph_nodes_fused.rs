//! `graph_nodes` over compiled functions (its own test binary: CPU fusion is process-wide and
//! needs a C++ compiler at run time, as on the GPU MLX compiles fused kernels itself).
use mlx_array::ops::{set_cpu_fusion, CpuFusion};
use mlx_array::Array;

/// A fused function applied twice gives two nodes, though both replays of its trace hold the
/// primitive the trace made (counting by primitive saw one, and missed the inputs of the
/// second: a decoder's MLP below its fused SwiGLU in every layer but one).
#[test]
fn graph_nodes_counts_each_replay_of_a_fused_function() {
    set_cpu_fusion(CpuFusion::On);
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let (g, u) = (a.add_scalar(1.0).unwrap(), a.add_scalar(2.0).unwrap());
    let (s1, s2) = (g.swiglu(&u).unwrap(), u.swiglu(&g.exp().unwrap()).unwrap());
    let out = s1.add(&s2).unwrap();
    let (n, by) = mlx_array::graph_nodes(&[&out]).unwrap();
    let fused: usize = by.iter().filter(|(name, _)| name.starts_with("Compiled")).map(|(_, c)| c).sum();
    assert_eq!(fused, 2, "{by:?}");
    // the two scalar adds (each broadcasting its scalar), the exp, the two fused calls, the sum
    let adds = by.iter().find(|(name, _)| name == "Add").map_or(0, |(_, c)| *c);
    assert_eq!(adds, 3, "{by:?}");
    assert!(by.iter().any(|(name, c)| name == "Exp" && *c == 1), "the second call's input: {by:?}");
    assert_eq!(n, 8, "{by:?}");
    out.eval().unwrap();
}
