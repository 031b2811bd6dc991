"""One MoE block of the small benchmark shapes (H 1024, 4 of 16 experts, I 256) on MLX's CPU:
GatherMM over rows sorted by expert (what mlx-lm and the GPU path run) against one product per
expert over its rows (mlx-models' SwitchGlu::forward_segments on the CPU, from 1024 rows).

    python benches/moe_block.py T        # T tokens (T * 4 rows); figures in BENCHMARKS.md

Run it with the BLAS that llm_bench preloads for mlx-lm (its log prints the LD_PRELOAD line).
"""
import mlx.core as mx
import time
import sys
T=int(sys.argv[1]); H,E,k,I=1024,16,4,256
x=mx.random.normal((T,H)); gu=mx.random.normal((E,2*I,H))*0.03; dn=mx.random.normal((E,H,I))*0.03
idx=mx.random.randint(0,E,(T,k)).astype(mx.uint32)
mx.eval(x,gu,dn,idx)
def sorted_gm():
    flat=idx.reshape(-1); order=mx.argsort(flat); inv=mx.argsort(order); si=flat[order]
    xs=x[order//k].reshape(T*k,1,H)
    h=mx.gather_mm(xs, gu.swapaxes(1,2), rhs_indices=si, sorted_indices=True)
    a,b=mx.split(h,[I],axis=-1); m=mx.sigmoid(a)*a*b
    o=mx.gather_mm(m, dn.swapaxes(1,2), rhs_indices=si, sorted_indices=True)
    return o[inv].reshape(T,k,H)
def segmented():
    flat=idx.reshape(-1); order=mx.argsort(flat); inv=mx.argsort(order); si=flat[order]
    counts=mx.sum(flat[None,:]==mx.arange(E)[:,None],axis=1); mx.eval(counts,order,inv)
    cs=[0]
    for c in counts.tolist(): cs.append(cs[-1]+c)
    xs=x[order//k]
    outs=[]
    for e in range(E):
        if cs[e+1]==cs[e]: continue
        xe=xs[cs[e]:cs[e+1]]
        h=xe@gu[e].T; a,b=mx.split(h,[I],axis=-1); m=mx.sigmoid(a)*a*b
        outs.append(m@dn[e].T)
    o=mx.concatenate(outs,0)
    return o[inv].reshape(T,k,H)
r1=sorted_gm(); r2=segmented(); mx.eval(r1,r2); print("maxdiff", mx.abs(r1-r2).max().item())
for f in [sorted_gm, segmented, sorted_gm, segmented]:
    mx.eval(f()); t=time.perf_counter(); 
    for _ in range(3): mx.eval(f())
    print(f.__name__, "%.1f ms"%((time.perf_counter()-t)/3*1e3))
