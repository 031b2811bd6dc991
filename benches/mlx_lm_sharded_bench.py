#!/usr/bin/env python3
"""mlx_lm_sharded_bench.py - mlx-lm's tensor-parallel generation, timed as mlx_lm_bench.py times
a single process, for the multi-GPU comparison of benches/tp_gpu_bench.sh.

Run as every rank of an MLX distributed group (MLX reads the group from the environment: for
NCCL MLX_RANK, MLX_WORLD_SIZE, NCCL_HOST_IP, NCCL_PORT, one GPU per rank through
CUDA_VISIBLE_DEVICES, as `mlx.launch --backend nccl` sets them):

    python mlx_lm_sharded_bench.py MODEL_DIR [--backend nccl] [--prompt 128 --gen 128 --runs 3]

Loads with mlx_lm.utils.sharded_load(tensor_group=group) (mlx-lm's shard_linear layers; the
model's `shard` method), generates greedily with generate_step (a fresh cache per run, prefill
step 2048), and rank 0 prints one JSON line: the median run's ttft_ms / prefill_tps / decode_tps
(TTFT = first token on the host, prefill tok/s = prompt / TTFT, decode tok/s = (n - 1) /
(t_last - t_first)), the tokens, and every rank's weight bytes.
"""
import argparse
import json
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import sharded_load
from mlx.utils import tree_flatten


def run(model, prompt, gen):
    mx.synchronize()
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    toks, t_first, t_last = [], None, None
    for tok, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=gen, prompt_cache=cache, prefill_step_size=2048):
        now = time.perf_counter()
        t_first = t_first or now
        t_last = now
        toks.append(int(tok))
    mx.synchronize()
    ttft = t_first - t0
    n = len(toks)
    return {"ttft_ms": ttft * 1e3, "prefill_tps": len(prompt) / ttft,
            "decode_tps": (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else 0.0, "tokens": toks}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    group = mx.distributed.init(strict=True, backend=a.backend)
    t = time.perf_counter()
    model, tokenizer = sharded_load(a.model, tensor_group=group)
    mx.eval(model.parameters())
    load_s = time.perf_counter() - t
    wbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    per_rank = mx.distributed.all_gather(mx.array([wbytes // 1024], dtype=mx.uint32), group=group)
    # The same prompt ids as llm_bench / the generate runs of tp_gpu_bench.sh.
    prompt = [(i * 7919 + 13) % 30000 + 10 for i in range(a.prompt)]
    run(model, prompt[:16], 4)  # warm-up (kernel compilation)
    runs = sorted((run(model, prompt, a.gen) for _ in range(a.runs)), key=lambda r: r["decode_tps"])
    if group.rank() == 0:
        best = runs[len(runs) // 2]
        print(json.dumps({"ranks": group.size(), "load_s": load_s, "weight_kib_per_rank": per_rank.tolist(),
                          "mlx": mx.__version__, **best}), flush=True)


if __name__ == "__main__":
    main()
