"""MLX attention in one call against one call per chunk of queries (the CPU path of mlx-models'
layers::sdpa), on MLX's default device: the CPU with the mlx-cpu wheel, the GPU with the CUDA one.

    python benches/sdpa_chunk.py [f32|bf16]        # figures in BENCHMARKS.md

On the CPU run it with the BLAS that llm_bench preloads for mlx-lm (its log prints the
LD_PRELOAD line), or MLX's products use the wheel's reference BLAS.
"""
import sys
import time

import mlx.core as mx

DT = mx.float32 if (sys.argv[1:] or ["f32"])[0] == "f32" else mx.bfloat16
GPU = mx.default_device() == mx.gpu
print(mx.default_device(), DT)


def full(q, k, v, s):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask="causal")


def chunked(q, k, v, s, c):
    L, outs = q.shape[2], []
    for st in range(0, L, c):
        e = min(L, st + c)
        outs.append(mx.fast.scaled_dot_product_attention(q[:, :, st:e], k[:, :, :e], v[:, :, :e], scale=s, mask="causal"))
    return mx.concatenate(outs, axis=2)


def best_ms(f, n):
    for _ in range(2):
        mx.eval(f())
    best = 1e9
    for _ in range(n):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(f())
        mx.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


shapes = [(16, 8, 128, 2048), (32, 8, 128, 2048), (16, 8, 128, 8192)] if GPU else \
    [(16, 8, 128, 2048), (8, 2, 256, 2048), (16, 8, 128, 512), (16, 8, 128, 256), (16, 8, 128, 128)]
chunks = [64, 256, 1024] if GPU else [32, 64, 128]
n = 20 if GPU else 3
for H, KV, D, L in shapes:
    q, k, v = (mx.random.normal((1, h, L, D)).astype(DT) for h in (H, KV, KV))
    mx.eval(q, k, v)
    s = D ** -0.5
    ref = full(q, k, v, s)
    print(f"{H} heads ({KV} KV) x {D}, L = K = {L}: one call {best_ms(lambda: full(q, k, v, s), n):.3f} ms")
    for c in chunks:
        if c >= L:
            continue
        err = mx.abs(chunked(q, k, v, s, c).astype(mx.float32) - ref.astype(mx.float32)).max().item()
        print(f"  {c}-query chunks {best_ms(lambda: chunked(q, k, v, s, c), n):.3f} ms, max abs diff {err:.1e}")
