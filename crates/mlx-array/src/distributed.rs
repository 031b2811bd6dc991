//! Multi-process collectives through MLX's distributed layer (mlx-c's `mlx_distributed_*`).
//!
//! MLX ships the communication: the `ring` backend (TCP between processes, on one machine or
//! several), MPI, and NCCL in CUDA builds. [`Group::init`] joins the group the process was
//! started in; MLX itself reads how (for `ring`: `MLX_RANK`, this process's rank, and
//! `MLX_HOSTFILE`, a JSON file listing one `["ip:port", ...]` array per rank, as `mlx.launch`
//! writes it). This module reads no environment variable and sets none.
//!
//! The collectives are lazy array operations like any other: they run when their result is
//! evaluated, and every rank must evaluate the same collectives in the same order (a rank that
//! skips one leaves the others waiting).
//!
//! ```no_run
//! use mlx_array::distributed::{Backend, Group};
//! use mlx_array::Array;
//! # fn main() -> mlx_array::Result<()> {
//! let g = Group::init(Backend::Ring)?; // strict: an error when not started as a ring
//! let x = Array::from_slice(&[g.rank() as f32], &[1])?;
//! let total = g.all_sum(&x)?; // 0 + 1 + ... + (size - 1) on every rank
//! assert_eq!(total.item::<f32>()?, (g.size() * (g.size() - 1) / 2) as f32);
//! # Ok(()) }
//! ```
use crate::error::{Error, Result};
use crate::ffi::{call, ensure_handler, status, stream};
use crate::{Array, DType};
use std::ffi::CString;
use std::sync::Arc;

/// A communication backend of MLX's distributed layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// TCP sockets between the ranks a hostfile lists (`MLX_HOSTFILE`, `MLX_RANK`).
    Ring,
    /// MPI (needs an MPI library at run time; the ranks come from `mpirun`).
    Mpi,
    /// NCCL between CUDA devices (CUDA builds of MLX only).
    Nccl,
    /// Whichever backend MLX finds available first.
    Any,
}

impl Backend {
    /// MLX's name of the backend.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Ring => "ring",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
            Backend::Any => "any",
        }
    }

    /// Parse MLX's name (`ring`, `mpi`, `nccl`, `any`).
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "ring" => Backend::Ring,
            "mpi" => Backend::Mpi,
            "nccl" => Backend::Nccl,
            "any" => Backend::Any,
            _ => return None,
        })
    }

    /// Whether this build of MLX has the backend compiled in (for `Nccl`, also whether a CUDA
    /// device is usable; for `Mpi`, whether an MPI library could be loaded).
    pub fn is_available(self) -> bool {
        ensure_handler();
        let name = CString::new(self.name()).expect("backend names have no NUL");
        // SAFETY: a valid C string; the call only reads it.
        unsafe { mlx_sys::mlx_distributed_is_available(name.as_ptr()) }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The mlx-c handle, freed once when the last [`Group`] clone goes.
struct RawGroup(mlx_sys::mlx_distributed_group);

impl Drop for RawGroup {
    fn drop(&mut self) {
        // SAFETY: the handle was returned by mlx-c and is freed exactly once.
        unsafe { mlx_sys::mlx_distributed_group_free(self.0) };
    }
}

// SAFETY: an MLX group is immutable after creation (rank, size and the backend's connections
// are fixed); MLX's collectives are issued from its stream threads whichever thread built them.
unsafe impl Send for RawGroup {}
unsafe impl Sync for RawGroup {}

/// A group of processes (ranks) that run collectives together. Cheap to clone.
#[derive(Clone)]
pub struct Group {
    raw: Arc<RawGroup>,
    rank: usize,
    size: usize,
    backend: Backend,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group(rank {} of {}, {})", self.rank, self.size, self.backend)
    }
}

impl PartialEq for Group {
    /// The same group (clones of one handle), not merely the same rank and size.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.raw, &other.raw)
    }
}

impl Group {
    /// Join the group this process was started in over `backend`, strictly: a backend missing
    /// from this build, or an environment that does not describe a group (no hostfile for
    /// `ring`), is an error ([`Error::Distributed`]). MLX initialises a backend once per
    /// process; later calls return the same group.
    pub fn init(backend: Backend) -> Result<Self> {
        Self::init_with(backend, true)
    }

    /// [`Group::init`], or with `strict = false` a group of one rank (this process alone) when
    /// the backend is missing or the environment describes no group.
    pub fn init_with(backend: Backend, strict: bool) -> Result<Self> {
        if strict && !backend.is_available() {
            return Err(Error::Distributed { op: "init", msg: format!("the {backend} backend is not available in this build of MLX") });
        }
        let name = CString::new(backend.name()).expect("backend names have no NUL");
        // SAFETY: `res` starts as an empty group that mlx-c replaces (or leaves empty on error).
        let mut res = unsafe { mlx_sys::mlx_distributed_group_new() };
        let st = status("distributed_init", || unsafe { mlx_sys::mlx_distributed_init(&mut res, strict, name.as_ptr()) });
        let raw = RawGroup(res);
        if let Err(e) = st {
            return Err(Error::Distributed { op: "init", msg: format!("{backend}: {}", mlx_message(e)) });
        }
        if raw.0.ctx.is_null() {
            return Err(Error::Distributed { op: "init", msg: format!("{backend}: MLX returned no group") });
        }
        Self::wrap(raw, backend)
    }

    fn wrap(raw: RawGroup, backend: Backend) -> Result<Self> {
        // SAFETY: a live group handle.
        let (rank, size) = unsafe { (mlx_sys::mlx_distributed_group_rank(raw.0), mlx_sys::mlx_distributed_group_size(raw.0)) };
        if rank < 0 || size < 1 || rank >= size {
            return Err(Error::Distributed { op: "init", msg: format!("MLX reported rank {rank} of size {size}") });
        }
        Ok(Group { raw: Arc::new(raw), rank: rank as usize, size: size as usize, backend })
    }

    /// This process's rank, `0..size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The backend the group was initialised with.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Split into subgroups: ranks passing the same `color` form one group, ordered by `key`
    /// (`None`: by their rank here). Every rank must call it. MLX 0.32's `ring` backend does
    /// not implement splitting (an [`Error::Distributed`]); MPI and NCCL do.
    pub fn split(&self, color: u32, key: Option<u32>) -> Result<Group> {
        let to_c = |v: u32, what: &str| i32::try_from(v).map_err(|_| Error::arg("distributed_split", format!("{what} {v} exceeds i32")));
        let color = to_c(color, "color")?;
        let key = match key {
            Some(k) => to_c(k, "key")?,
            None => -1, // MLX: a negative key keeps the current rank order
        };
        // SAFETY: as in init_with.
        let mut res = unsafe { mlx_sys::mlx_distributed_group_new() };
        let st = status("distributed_split", || unsafe { mlx_sys::mlx_distributed_group_split(&mut res, self.raw.0, color, key) });
        let raw = RawGroup(res);
        if let Err(e) = st {
            return Err(Error::Distributed { op: "split", msg: mlx_message(e) });
        }
        Self::wrap(raw, self.backend)
    }

    /// Elementwise sum of `x` over the ranks; every rank gets the sum.
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        let s = stream();
        call("all_sum", |res| unsafe { mlx_sys::mlx_distributed_all_sum(res, x.inner.as_ptr(), self.raw.0, s.as_ptr()) })
    }

    /// Elementwise maximum over the ranks.
    pub fn all_max(&self, x: &Array) -> Result<Array> {
        let s = stream();
        call("all_max", |res| unsafe { mlx_sys::mlx_distributed_all_max(res, x.inner.as_ptr(), self.raw.0, s.as_ptr()) })
    }

    /// Elementwise minimum over the ranks.
    pub fn all_min(&self, x: &Array) -> Result<Array> {
        let s = stream();
        call("all_min", |res| unsafe { mlx_sys::mlx_distributed_all_min(res, x.inner.as_ptr(), self.raw.0, s.as_ptr()) })
    }

    /// Every rank's `x` concatenated along axis 0, in rank order (`[size * n, ...]` from `[n, ...]`).
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        if x.ndim() == 0 {
            return Err(Error::shape("all_gather", "a 0-d array has no axis 0 to concatenate along"));
        }
        let s = stream();
        call("all_gather", |res| unsafe { mlx_sys::mlx_distributed_all_gather(res, x.inner.as_ptr(), self.raw.0, s.as_ptr()) })
    }

    /// Sum over the ranks, then rank `r` keeps the `r`-th of `size` equal slices along axis 0.
    /// MLX 0.32's `ring` backend does not implement it: evaluating the result is then an error.
    pub fn sum_scatter(&self, x: &Array) -> Result<Array> {
        let n = x.dims().first().copied().unwrap_or(0) as usize;
        if x.ndim() == 0 || n % self.size != 0 {
            return Err(Error::shape("sum_scatter", format!("axis 0 of {:?} does not split into {} equal slices", x.shape(), self.size)));
        }
        let s = stream();
        call("sum_scatter", |res| unsafe { mlx_sys::mlx_distributed_sum_scatter(res, x.inner.as_ptr(), self.raw.0, s.as_ptr()) })
    }

    /// Send `x` to rank `dst`. The returned array must be evaluated for the send to happen; the
    /// receiver calls [`Group::recv`] with the same shape and dtype.
    pub fn send(&self, x: &Array, dst: usize) -> Result<Array> {
        let dst = self.peer("send", dst)?;
        let s = stream();
        call("send", |res| unsafe { mlx_sys::mlx_distributed_send(res, x.inner.as_ptr(), dst, self.raw.0, s.as_ptr()) })
    }

    /// Receive an array of `shape` and `dtype` from rank `src`.
    pub fn recv(&self, shape: &[usize], dtype: DType, src: usize) -> Result<Array> {
        let src = self.peer("recv", src)?;
        let dims = crate::array::check_shape("recv", shape)?;
        let s = stream();
        call("recv", |res| unsafe {
            mlx_sys::mlx_distributed_recv(res, dims.as_ptr(), dims.len(), dtype.to_mlx() as mlx_sys::mlx_dtype, src, self.raw.0, s.as_ptr())
        })
    }

    /// Receive an array shaped like `like` from rank `src`.
    pub fn recv_like(&self, like: &Array, src: usize) -> Result<Array> {
        let src = self.peer("recv", src)?;
        let s = stream();
        call("recv", |res| unsafe { mlx_sys::mlx_distributed_recv_like(res, like.inner.as_ptr(), src, self.raw.0, s.as_ptr()) })
    }

    /// Rank `root`'s `x` on every rank (`x` must have the same shape and dtype everywhere; the
    /// other ranks' values are ignored). A sum in which every rank but `root` contributes
    /// zeros, so the result equals `root`'s values exactly (`-0.0` reads as `0.0`).
    pub fn broadcast(&self, x: &Array, root: usize) -> Result<Array> {
        self.peer("broadcast", root)?;
        if self.size == 1 {
            return Ok(x.clone());
        }
        let mine = if self.rank == root { x.clone() } else { Array::zeros(&x.shape(), x.dtype())? };
        self.all_sum(&mine)
    }

    fn peer(&self, op: &'static str, r: usize) -> Result<i32> {
        if r >= self.size {
            return Err(Error::arg(op, format!("rank {r} out of range for a group of {}", self.size)));
        }
        Ok(r as i32)
    }
}

/// `inputs`, unchanged, but computed only after `dependencies` (MLX's `depends`): orders work
/// that has no data dependency, such as a collective that every rank must reach in the same
/// order.
pub fn depends(inputs: &[&Array], dependencies: &[&Array]) -> Result<Vec<Array>> {
    ensure_handler();
    let vec_of = |arrays: &[&Array]| {
        let ptrs: Vec<mlx_sys::mlx_array> = arrays.iter().map(|a| a.inner.as_ptr()).collect();
        // SAFETY: `ptrs` holds live arrays; mlx-c copies the handles (reference counts).
        unsafe { mlx_sys::mlx_vector_array_new_data(ptrs.as_ptr(), ptrs.len()) }
    };
    let (ins, deps) = (vec_of(inputs), vec_of(dependencies));
    let mut out = unsafe { mlx_sys::mlx_vector_array_new() };
    let st = status("depends", || unsafe { mlx_sys::mlx_depends(&mut out, ins, deps) });
    let mut res = Vec::new();
    if st.is_ok() {
        for i in 0..unsafe { mlx_sys::mlx_vector_array_size(out) } {
            let mut a = unsafe { mlx_sys::mlx_array_new() };
            unsafe { mlx_sys::mlx_vector_array_get(&mut a, out, i) };
            res.push(Array::wrap(unsafe { mlx_rs::Array::from_ptr(a) }));
        }
    }
    unsafe {
        mlx_sys::mlx_vector_array_free(out);
        mlx_sys::mlx_vector_array_free(ins);
        mlx_sys::mlx_vector_array_free(deps);
    }
    st?;
    Ok(res)
}

fn mlx_message(e: Error) -> String {
    match e {
        Error::Mlx { msg, .. } => msg,
        e => e.to_string(),
    }
}

/// A ring hostfile (the JSON MLX's `ring` backend reads from the file `MLX_HOSTFILE` names) for
/// `n` ranks on this machine: one `"127.0.0.1:port"` per rank, each port free when chosen
/// (bound and released here, so another program may still take it before the ranks start).
pub fn local_ring_hostfile(n: usize) -> Result<String> {
    if n == 0 {
        return Err(Error::arg("local_ring_hostfile", "at least one rank"));
    }
    let io = |source| Error::Io { path: "127.0.0.1:0".into(), source };
    // All listeners stay open until every port is chosen, so no port is chosen twice.
    let listeners = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").map_err(io)).collect::<Result<Vec<_>>>()?;
    let hosts = listeners.iter().map(|l| Ok(vec![l.local_addr().map_err(io)?.to_string()])).collect::<Result<Vec<Vec<String>>>>()?;
    Ok(serde_json::to_string(&hosts).expect("strings serialize"))
}

/// Run `n` processes of `program` as the ranks of a ring group on this machine (what the tests of
/// collective code need): a hostfile from [`local_ring_hostfile`] in a temporary file,
/// `MLX_RANK` and `MLX_HOSTFILE` set for each rank, `configure` for the rest (arguments, other
/// variables), stdout and stderr captured. Each rank's output, by rank; if any rank is still
/// running after `timeout`, all are killed and the call fails.
pub fn run_local_ring(n: usize, program: &std::path::Path, timeout: std::time::Duration, configure: impl Fn(&mut std::process::Command)) -> Result<Vec<std::process::Output>> {
    let hostfile = std::env::temp_dir().join(format!("mlx-ring-{}-{:x}.json", std::process::id(), std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())));
    let io = |path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    std::fs::write(&hostfile, local_ring_hostfile(n)?).map_err(io(&hostfile))?;
    let result = run_ranks(n, program, &hostfile, timeout, configure);
    let _ = std::fs::remove_file(&hostfile);
    result
}

fn run_ranks(n: usize, program: &std::path::Path, hostfile: &std::path::Path, timeout: std::time::Duration, configure: impl Fn(&mut std::process::Command)) -> Result<Vec<std::process::Output>> {
    let io = |source| Error::Io { path: program.to_path_buf(), source };
    let mut children = Vec::with_capacity(n);
    for r in 0..n {
        let mut cmd = std::process::Command::new(program);
        configure(&mut cmd);
        cmd.env("MLX_RANK", r.to_string()).env("MLX_HOSTFILE", hostfile).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in children.iter_mut() {
                    let _ = c.kill();
                }
                return Err(io(e));
            }
        }
    }
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let mut running = false;
        for c in children.iter_mut() {
            running |= c.try_wait().map_err(io)?.is_none();
        }
        if !running {
            break;
        }
        if std::time::Instant::now() > deadline {
            for c in children.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            return Err(Error::Distributed { op: "run_local_ring", msg: format!("{n} ranks did not finish within {} s", timeout.as_secs_f64()) });
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    children.into_iter().map(|c| c.wait_with_output().map_err(io)).collect()
}
