#!/usr/bin/env python3
"""mlx_lm_batch_bench.py - the mlx-lm side of `batch_bench` (benches/src/bin/batch_bench.rs).

Loads a local checkpoint with `mlx_lm.load` and runs `mlx_lm.generate.batch_generate` (mlx-lm's
BatchGenerator: continuous batching, greedy) over `--batch` prompts of `--prompt` ids each,
`--gen` tokens per prompt, with completion_batch_size = prefill_batch_size = batch. Prints one
JSON object: aggregate decode tok/s (BatchStats.generation_tps: generated tokens over the
generation time, prefill excluded), prompt tok/s, wall seconds and the token ids.

    python mlx_lm_batch_bench.py MODEL_DIR --batch 8 --prompt 128 --gen 64 [--dtype f32] [--seed 0]
"""
import argparse
import json
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import batch_generate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    model, tok = mlx_lm.load(a.model)
    dt = {"f32": mx.float32, "bf16": mx.bfloat16, "f16": mx.float16}[a.dtype]
    model.set_dtype(dt)
    vocab = model.args.vocab_size
    # The same ids as batch_bench.rs: prompt b, position i -> (i * 7919 + b * 104729 + seed) % vocab
    prompts = [[(i * 7919 + b * 104729 + a.seed) % vocab for i in range(a.prompt)] for b in range(a.batch)]
    # warm-up (kernels, allocator)
    batch_generate(model, tok, prompts[:1], max_tokens=2, completion_batch_size=1, prefill_batch_size=1)
    t0 = time.perf_counter()
    r = batch_generate(model, tok, prompts, max_tokens=a.gen, completion_batch_size=a.batch, prefill_batch_size=a.batch, return_token_ids=True)
    mx.synchronize()
    wall = time.perf_counter() - t0
    s = r.stats
    print(json.dumps({
        "decode_tps": s.generation_tps, "prompt_tps": s.prompt_tokens / max(s.prompt_time, 1e-9), "generation_tokens": s.generation_tokens,
        "wall_s": wall, "tokens": [list(map(int, t)) for t in (r.token_ids or [])],
    }))


if __name__ == "__main__":
    main()
