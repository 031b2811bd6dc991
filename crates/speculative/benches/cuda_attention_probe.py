"""Attention of a few queries on MLX's CUDA backend: the fused call against the same attention as
matrix products (what `Array::sdpa_by_products` runs), with the key count fixed and growing by one
each call (a speculative verify step meets a new key count every cycle). Qwen3-8B's heads: 32
query heads over 8 key-value heads of 128, bf16. Run where gpu_spec_bench.sh unpacked the runtime
(see prepare_gpu_spec.sh)."""
import time

import mlx.core as mx


def timed(f, n):
    mx.synchronize()
    t = time.perf_counter()
    for i in range(n):
        mx.eval(f(i))
    mx.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def by_products(q, k, v, scale):
    b, h, m, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    rep = h // hk
    s = ((q * scale).reshape(b, hk, rep * m, d) @ k.swapaxes(-1, -2)).reshape(b, hk, rep, m, n)
    visible = mx.arange(n).reshape(1, n) <= mx.arange(n - m, n).reshape(m, 1)
    s = mx.where(visible, s, mx.array(-float("inf"), s.dtype))
    p = mx.softmax(s, axis=-1, precise=True).reshape(b, hk, rep * m, n)
    return (p @ v).reshape(b, h, m, d)


def main():
    for m in [2, 6, 8]:
        q = mx.random.normal((1, 32, m, 128)).astype(mx.bfloat16)
        kk = mx.random.normal((1, 8, 2048, 128)).astype(mx.bfloat16)
        vv = mx.random.normal((1, 8, 2048, 128)).astype(mx.bfloat16)
        mx.eval(q, kk, vv)
        fused = lambda n: mx.fast.scaled_dot_product_attention(q, kk[:, :, :n], vv[:, :, :n], scale=0.088, mask="causal")
        prod = lambda n: by_products(q, kk[:, :, :n], vv[:, :, :n], 0.088)
        for name, f in [("fused", fused), ("products", prod)]:
            print(f"{m} queries, {name}: keys fixed {timed(lambda i: f(500), 30):.3f} ms, keys growing {timed(lambda i: f(600 + i), 30):.3f} ms", flush=True)
        diff = mx.abs(fused(700).astype(mx.float32) - prod(700).astype(mx.float32)).max().item()
        print(f"{m} queries: largest difference {diff:.2e} (bf16)", flush=True)


if __name__ == "__main__":
    main()
