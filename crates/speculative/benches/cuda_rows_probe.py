"""The few-row kernels of `crates/mlx-sys/src/cudakern/` (rows_matmul.cu: x @ w.T for 2-16 rows
of x, bf16; few_query_attention.cu) against MLX's own ops on the CUDA backend (cuBLAS for a
product of more than one row; attention of a few queries as matrix products):
  0. attention: largest difference from the f32 reference and time a call, kernel and products;
  1. largest difference from the f32 product, and effective GB/s (weight bytes / time) over a
     stack of distinct Qwen3-8B-shaped weights, for each rows-per-warp R;
  2. with mlx.nn.Linear routed through the kernel for 2-16 rows, the synchronised forward times of
     cuda_verify_probe.py for each model directory given.

  python3 cuda_rows_probe.py [--matmul] [MODEL_DIR...]   # --matmul: the product table (1.)

The calls of one evaluation are independent and MLX's CUDA graph overlaps them, so tables 0. and
1. overstate the kernels, which occupy few SMs (in a forward they lose: benches' `verify_probe`).

Run where gpu_spec_bench.sh unpacked the runtime (see prepare_gpu_spec.sh), with
PYTHONPATH=/tmp/mlxrt-spec LD_LIBRARY_PATH=/tmp/mlxrt-spec/mlx/lib.
"""
import pathlib
import struct
import sys

import mlx.core as mx
import mlx.nn as nn

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cuda_matmul_probe import timed  # noqa: E402  (best of 5 synchronised runs)
SOURCE = (HERE.parents[1] / "mlx-sys/src/cudakern/rows_matmul.cu").read_text()
KERNEL = mx.fast.cuda_kernel(name="rows_matmul", input_names=["x", "w"], output_names=["out"], source=SOURCE,
                             ensure_row_contiguous=False)
ATTN = mx.fast.cuda_kernel(name="few_query_attention", input_names=["q", "k", "v"], output_names=["out"],
                           source=(HERE.parents[1] / "mlx-sys/src/cudakern/few_query_attention.cu").read_text(),
                           ensure_row_contiguous=False)


def attention(q, k, v, scale, causal=True, window=0):
    b, h, m, d = q.shape
    bits = struct.unpack("<i", struct.pack("<f", scale))[0]
    return ATTN(inputs=[q, k, v], template=[("T", q.dtype), ("D", d), ("CAUSAL", causal), ("WINDOW", window), ("SCALE", bits)],
                grid=(b * h * m * 32, 1, 1), threadgroup=(128, 1, 1), output_shapes=[q.shape], output_dtypes=[q.dtype])[0]


def rows_matmul(x, w, r):
    m, k = x.shape
    n = w.shape[0]
    warps = (n + r - 1) // r
    return KERNEL(inputs=[x, w], template=[("T", x.dtype), ("MAXM", 8 if m <= 8 else 16), ("R", r)], grid=(warps * 32, 1, 1),
                  threadgroup=(256, 1, 1), output_shapes=[(m, n)], output_dtypes=[x.dtype])[0]


def kernels():
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
              "draft_qkv": (4096, 1024), "draft_down": (1024, 3072)}
    for name, (n, k) in shapes.items():
        layers = max(4, int(2.4e9 / (n * k * 2)))
        ws = [(mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16) for _ in range(layers)]
        mx.eval(ws)
        gb = layers * n * k * 2 / 1e9
        for m in [1, 2, 4, 8, 16]:
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            mx.eval(x)
            ref = x.astype(mx.float32) @ ws[0].astype(mx.float32).T
            row = [f"{name} N={n} K={k} M={m}: matmul {gb / timed(lambda: mx.eval([x @ w.T for w in ws])):6.0f} GB/s"]
            if m > 1:
                for r in [1, 2, 4]:
                    got = rows_matmul(x, ws[0], r).astype(mx.float32)
                    err = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
                    t = timed(lambda: mx.eval([rows_matmul(x, w, r) for w in ws]))
                    row.append(f"R={r} {gb / t:6.0f} GB/s (rel {err:.1e})")
            print(", ".join(row), flush=True)
        del ws


def attentions():
    from cuda_verify_probe import by_products
    for n in [37, 512, 2048, 8192]:
        cap = n + 64
        kb = mx.random.normal((1, 8, cap, 128)).astype(mx.bfloat16)
        vb = mx.random.normal((1, 8, cap, 128)).astype(mx.bfloat16)
        mx.eval(kb, vb)
        k, v = kb[:, :, :n], vb[:, :, :n]
        for m in [2, 8, 16]:
            q = mx.random.normal((1, 32, m, 128)).astype(mx.bfloat16)
            f32 = lambda a: a.astype(mx.float32)
            ref = by_products(f32(q), f32(k), f32(v), None, 0.088, "causal")
            got = attention(q, k, v, 0.088)
            err = (mx.abs(f32(got) - ref).max() / mx.abs(ref).max()).item()
            prod = by_products(q, k, v, None, 0.088, "causal")
            perr = (mx.abs(f32(prod) - ref).max() / mx.abs(ref).max()).item()
            tk = timed(lambda: mx.eval([attention(q, k, v, 0.088) for _ in range(36)])) / 36
            tp = timed(lambda: mx.eval([by_products(q, k, v, None, 0.088, "causal") for _ in range(36)])) / 36
            line = f"attention keys={n} queries={m}: kernel {tk * 1e6:.0f} us (rel {err:.1e}), products {tp * 1e6:.0f} us (rel {perr:.1e})"
            if n > 40:
                w = attention(q, k, v, 0.088, True, 100)
                kpos = mx.arange(n).reshape(1, n)
                qpos = mx.arange(n - m, n).reshape(m, 1)
                vis = (kpos <= qpos) & (kpos > qpos - 100)
                s = (f32(q) * 0.088).reshape(1, 8, 4 * m, 128) @ f32(k).swapaxes(-1, -2)
                s = mx.where(vis, s.reshape(1, 8, 4, m, n), -float("inf"))
                r = (mx.softmax(s, axis=-1).reshape(1, 8, 4 * m, n) @ f32(v)).reshape(1, 32, m, 128)
                nm = attention(q, k, v, 0.088, False)
                rn = (mx.softmax((f32(q) * 0.088).reshape(1, 8, 4 * m, 128) @ f32(k).swapaxes(-1, -2), axis=-1) @ f32(v)).reshape(1, 32, m, 128)
                line += f"; window 100 rel {(mx.abs(f32(w) - r).max() / mx.abs(r).max()).item():.1e}"
                line += f"; no mask rel {(mx.abs(f32(nm) - rn).max() / mx.abs(rn).max()).item():.1e}"
            print(line, flush=True)


def route_attention():
    import cuda_verify_probe as v

    def kernel_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if queries.shape[2] == 1 or queries.shape[2] > 16 or sinks is not None:
            return v.fused(queries, keys, values, cache, scale, mask, sinks)
        return attention(queries, keys, values, scale)

    v.attention_impl = kernel_attention


def route_linear():
    plain = nn.Linear.__call__

    def call(self, x):
        rows = x.size // x.shape[-1]
        w = self["weight"]
        if 2 <= rows <= 16 and x.dtype == mx.bfloat16 and w.dtype == mx.bfloat16 and x.shape[-1] % 8 == 0:
            y = rows_matmul(x.reshape(rows, -1), w, 2 if rows <= 8 else 1).reshape(*x.shape[:-1], -1)
            return y + self["bias"] if "bias" in self else y
        return plain(self, x)

    nn.Linear.__call__ = call


if __name__ == "__main__":
    dirs = [a for a in sys.argv[1:] if a != "--matmul"]
    attentions()
    if "--matmul" in sys.argv:
        kernels()
    if dirs:
        import cuda_verify_probe as v
        for p in dirs:
            v.forwards(pathlib.Path(p), [1, 2, 4, 8])
        route_linear()
        print("nn.Linear through rows_matmul for 2-16 rows:", flush=True)
        for p in dirs:
            v.forwards(pathlib.Path(p), [1, 2, 4, 8])
        route_attention()
        print("and attention through few_query_attention:", flush=True)
        for p in dirs:
            v.forwards(pathlib.Path(p), [1, 2, 4, 8])
