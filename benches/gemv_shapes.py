"""One-row products (decode projections, unfused as on the CPU) of the Qwen3-0.6B shapes on MLX's CPU, each weight out
of cache (28 copies, one per layer), and its tied LM head: the GB/s behind BENCHMARKS.md's CPU
decode profile.

    python benches/gemv_shapes.py

Run it with the BLAS that llm_bench preloads for mlx-lm (its log prints the LD_PRELOAD line).
"""
import mlx.core as mx, time
def bench(K,N,copies=28,trans=True):
    Ws=[mx.random.normal((N,K)) for _ in range(copies)]; x=mx.random.normal((1,K)); mx.eval(Ws,x)
    for _ in range(2):
        t=time.perf_counter()
        for W in Ws: mx.eval(x@W.T)
        dt=time.perf_counter()-t
    return copies*N*K*4/dt/1e9, dt/copies*1e3
# per layer on the CPU (projections are not fused there): q, k, v, o, gate, up, down
layer = [(1024,2048),(1024,1024),(1024,1024),(2048,1024),(1024,3072),(1024,3072),(3072,1024)]
total = 0.0
for K,N in dict.fromkeys(layer):
    gbs,ms=bench(K,N); print(f"{K}x{N} {N*K*4/1e6:.0f} MB: {gbs:.1f} GB/s, {ms:.2f} ms")
    total += ms * layer.count((K,N))
gbs,ms=bench(1024,151936,copies=2); print(f"lm_head: {gbs:.1f} GB/s {ms:.1f} ms")
print(f"28 layers + LM head, each product alone: {28 * total + ms:.1f} ms a token")
gbs,ms=bench(8192,32768,copies=1); print(f"one 1 GiB product: {gbs:.1f} GB/s")
