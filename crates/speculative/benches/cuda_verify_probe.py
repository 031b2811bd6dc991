"""Device time of one forward over L new positions (a verify step is L = k + 1) on MLX's CUDA
backend, mlx-lm's model of a checkpoint with attention of a few queries as matrix products (as
`Array::sdpa` runs it there): synchronised per forward, after a 512-position prefill, the cache
trimmed back after each forward.

  python3 cuda_verify_probe.py MODEL_DIR [L...]        # default L: 1 2 4 8
  python3 cuda_verify_probe.py MODEL_DIR --only L      # one warm-up and 3 forwards of L (for ncu)

Run where gpu_spec_bench.sh unpacked the runtime (see prepare_gpu_spec.sh), with
PYTHONPATH=/tmp/mlxrt-spec LD_LIBRARY_PATH=/tmp/mlxrt-spec/mlx/lib.
"""
import pathlib
import statistics
import sys
import time

import mlx.core as mx
import mlx_lm.models.base as base
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cuda_attention_probe import by_products as products  # noqa: E402

fused = base.scaled_dot_product_attention


def by_products(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention call, 2-16 queries as `cuda_attention_probe.by_products` (causal)."""
    if queries.shape[2] == 1 or queries.shape[2] > 16:
        return fused(queries, keys, values, cache, scale, mask, sinks)
    return products(queries, keys, values, scale)


attention_impl = by_products


def routed(*args, **kwargs):
    return attention_impl(*args, **kwargs)


def patch():
    """Every loaded model module's attention goes through `attention_impl` (`by_products`)."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(mod, "scaled_dot_product_attention", None) is fused:
            mod.scaled_dot_product_attention = routed


def forwards(path, rows, only=False):
    """Median synchronised time of a forward over each of `rows` new positions."""
    model, _ = load_model(path)
    patch()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(1000, 1512).reshape(1, -1), cache=cache), [c.state for c in cache])
    for m in rows:
        x = mx.arange(2000, 2000 + m).reshape(1, m)
        times = []
        for i in range(3 if only else 20):
            mx.synchronize()
            t = time.perf_counter()
            out = model(x, cache=cache)
            mx.eval(out, [c.state for c in cache])
            times.append(time.perf_counter() - t)
            for c in cache:
                c.trim(m)
        if not only:
            print(f"{path.name}: {m} positions: {statistics.median(times[2:]) * 1e3:.2f} ms (median of 18)", flush=True)


def main():
    only = sys.argv[2:3] == ["--only"]
    forwards(pathlib.Path(sys.argv[1]), [int(a) for a in sys.argv[3 if only else 2:]] or [1, 2, 4, 8], only)


if __name__ == "__main__":
    main()
