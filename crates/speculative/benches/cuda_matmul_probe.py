"""Products of a few rows against Qwen3-8B's bf16 weights on MLX's CUDA backend, the part of a
verify step (k + 1 rows) that costs more than a decode step (1 row). For each row count M it times
one pass over a layer stack's worth of distinct weights (far beyond the L2, as in a forward):
  * `plain`: x @ w.T, what a Linear runs;
  * `splitS`: the same product split along the inner dimension into S slices, the weight held as
    [S, N, K/S] (rearranged once, as a loader could), one batched product and a sum over S;
and torch's F.linear on the same shapes as the peer. Effective GB/s = weight bytes / time. The
products of one pass are independent, so MLX's CUDA graph may overlap them: a kernel that occupies
few SMs looks faster here than in a forward (benches' `verify_probe` chains its calls).
Run where gpu_spec_bench.sh unpacked the runtime (see prepare_gpu_spec.sh):
  PYTHONPATH=/tmp/mlxrt-spec LD_LIBRARY_PATH=/tmp/mlxrt-spec/mlx/lib python3 cuda_matmul_probe.py
"""
import time

import mlx.core as mx

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LAYERS = 12  # distinct weights per shape: 12 x 4096 x 24576 x 2 bytes = 2.4 GB for gate_up
ROWS = [1, 2, 4, 8, 16]
SPLITS = [2, 4, 8]


def timed(fn, n=5):
    fn()
    mx.synchronize()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    for name, (n, k) in SHAPES.items():
        ws = [mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02 for _ in range(LAYERS)]
        mx.eval(ws)
        split = {s: [w.reshape(n, s, k // s).transpose(1, 0, 2) for w in ws] for s in SPLITS}
        for s in SPLITS:
            split[s] = [mx.contiguous(w) for w in split[s]]
            mx.eval(split[s])
        gb = LAYERS * n * k * 2 / 1e9
        for m in ROWS:
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            mx.eval(x)
            plain = lambda: mx.eval([x @ w.T for w in ws])
            row = [f"{name} N={n} K={k} M={m}: plain {gb / timed(plain):7.0f} GB/s"]
            ref = (x @ ws[0].T).astype(mx.float32)
            for s in SPLITS:
                xs = x.reshape(m, s, k // s).transpose(1, 0, 2)
                f = lambda: mx.eval([(xs @ w.swapaxes(-1, -2)).sum(0) for w in split[s]])
                got = (xs @ split[s][0].swapaxes(-1, -2)).astype(mx.float32).sum(0)
                err = mx.abs(got - ref).max().item()
                row.append(f"split{s} {gb / timed(f):7.0f} GB/s (max diff {err:.1e})")
            print(", ".join(row), flush=True)
        del ws, split
    try:
        import torch
    except ImportError:
        return
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        gb = LAYERS * n * k * 2 / 1e9
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            def f():
                for w in ws:
                    torch.nn.functional.linear(x, w)
            f()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                f()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            print(f"torch {name} N={n} K={k} M={m}: {gb / best:7.0f} GB/s", flush=True)
        del ws


if __name__ == "__main__":
    main()
