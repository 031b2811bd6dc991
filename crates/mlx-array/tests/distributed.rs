//! MLX distributed over the ring backend: this binary starts copies of itself as the ranks of
//! a group on 127.0.0.1 (a hostfile with free ports, `MLX_RANK` / `MLX_HOSTFILE` in each
//! child's environment) and checks every collective's result on every rank.
//!
//! `harness = false`: `main` is the test. With `DIST_TEST_RANKS` set it is a rank.
use mlx_array::distributed::{depends, run_local_ring, Backend, Group};
use mlx_array::{Array, DType, Error};
use std::time::{Duration, Instant};

fn main() {
    if std::env::var_os("DIST_TEST_RANKS").is_some() {
        rank_main();
        return;
    }
    errors_without_a_group();
    for n in [2, 4] {
        let t = Instant::now();
        run_group(n);
        println!("test distributed::ring_collectives_{n}_ranks ... ok ({:.2} s)", t.elapsed().as_secs_f64());
    }
}

/// Without a hostfile a strict ring init is a typed error, as is a backend this build lacks.
fn errors_without_a_group() {
    assert!(Backend::Ring.is_available(), "the PyPI mlx-cpu build has the ring backend");
    assert!(!Backend::Nccl.is_available(), "a CPU build has no NCCL");
    // This process has no MLX_HOSTFILE (the ranks get theirs through their own environment).
    assert!(std::env::var_os("MLX_HOSTFILE").is_none());
    match Group::init(Backend::Nccl) {
        Err(Error::Distributed { op: "init", msg }) => assert!(msg.contains("nccl"), "{msg}"),
        other => panic!("nccl init on a CPU build: {other:?}"),
    }
    // Non-strict: a group of one, whose collectives are identities.
    let g = Group::init_with(Backend::Ring, false).unwrap();
    assert_eq!((g.rank(), g.size()), (0, 1));
    let x = Array::from_slice(&[1.5f32, -2.0], &[2]).unwrap();
    assert_eq!(g.all_sum(&x).unwrap().to_vec::<f32>().unwrap(), vec![1.5, -2.0]);
    assert!(g.send(&x, 1).is_err(), "rank 1 does not exist in a group of one");
    assert!(Backend::parse("gloo").is_none());
    println!("test distributed::errors_without_a_group ... ok");
}

/// Start `n` ranks of this binary and require all of them to exit 0 within a minute.
fn run_group(n: usize) {
    let exe = std::env::current_exe().unwrap();
    let outputs = run_local_ring(n, &exe, Duration::from_secs(60), |c| {
        c.env("DIST_TEST_RANKS", n.to_string());
    })
    .unwrap();
    for (r, out) in outputs.into_iter().enumerate() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "rank {r} of {n} failed ({}):\n{}\n{}", out.status, stdout, String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains(&format!("rank {r} of {n} ok")), "rank {r}: {stdout}");
    }
}

fn rank_main() {
    let n: usize = std::env::var("DIST_TEST_RANKS").unwrap().parse().unwrap();
    let want_rank: usize = std::env::var("MLX_RANK").unwrap().parse().unwrap();
    let g = Group::init(Backend::Ring).unwrap();
    assert_eq!((g.rank(), g.size(), g.backend()), (want_rank, n, Backend::Ring));
    let r = g.rank();
    let rf = r as f32;

    // all_sum, f32 and u32 (token ids travel as u32)
    let x = Array::from_slice(&[rf + 1.0, 2.0 * (rf + 1.0), -rf], &[3]).unwrap();
    let tri = (n * (n + 1) / 2) as f32;
    assert_eq!(g.all_sum(&x).unwrap().to_vec::<f32>().unwrap(), vec![tri, 2.0 * tri, -(tri - n as f32)]);
    let u = Array::from_slice(&[r as u32 * 7], &[1]).unwrap();
    assert_eq!(g.all_sum(&u).unwrap().to_vec::<u32>().unwrap(), vec![7 * (n * (n - 1) / 2) as u32]);

    // all_gather: rows in rank order
    let row = Array::from_slice(&[rf, rf * 10.0], &[1, 2]).unwrap();
    let all = g.all_gather(&row).unwrap();
    assert_eq!(all.shape(), vec![n, 2]);
    let want: Vec<f32> = (0..n).flat_map(|i| [i as f32, i as f32 * 10.0]).collect();
    assert_eq!(all.to_vec::<f32>().unwrap(), want);
    assert!(g.all_gather(&Array::scalar(1.0f32)).is_err(), "0-d all_gather is refused");

    // all_max / all_min
    let m = Array::from_slice(&[rf, -rf], &[2]).unwrap();
    assert_eq!(g.all_max(&m).unwrap().to_vec::<f32>().unwrap(), vec![(n - 1) as f32, 0.0]);
    assert_eq!(g.all_min(&m).unwrap().to_vec::<f32>().unwrap(), vec![0.0, -((n - 1) as f32)]);

    // sum_scatter: MLX's ring backend does not implement it; the failure is an error value
    let s = Array::from_slice(&(0..n).map(|i| (i * 100 + r) as f32).collect::<Vec<_>>(), &[n]).unwrap();
    match g.sum_scatter(&s).and_then(|a| a.to_vec::<f32>()) {
        Err(Error::Mlx { msg, .. }) => assert!(msg.contains("not supported"), "{msg}"),
        other => panic!("ring sum_scatter: {other:?}"),
    }

    // broadcast from the last rank, bit-exact (a float that sums would round)
    let v = Array::from_slice(&[rf + 0.1234567, f32::MIN_POSITIVE], &[2]).unwrap();
    let b = g.broadcast(&v, n - 1).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(b, vec![(n - 1) as f32 + 0.1234567, f32::MIN_POSITIVE]);
    assert!(g.broadcast(&v, n).is_err(), "root out of range");

    // send / recv: rank 0 -> rank 1
    if r == 0 {
        let payload = Array::from_slice(&[3.25f32, 4.5, 5.75, 6.0], &[2, 2]).unwrap();
        g.send(&payload, 1).unwrap().eval().unwrap();
    } else if r == 1 {
        let got = g.recv(&[2, 2], DType::F32, 0).unwrap();
        assert_eq!(got.to_vec::<f32>().unwrap(), vec![3.25, 4.5, 5.75, 6.0]);
    }

    // split: MLX's ring backend does not implement it; a typed error
    match g.split((r % 2) as u32, None) {
        Err(Error::Distributed { op: "split", msg }) => assert!(msg.contains("not supported"), "{msg}"),
        other => panic!("ring split: {other:?}"),
    }

    // depends: the value is unchanged, the dependency is computed as well
    let a = Array::from_slice(&[1.0f32], &[1]).unwrap();
    let dep = g.all_sum(&a).unwrap();
    let out = depends(&[&a], &[&dep]).unwrap();
    assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![1.0]);

    println!("rank {r} of {n} ok");
}
