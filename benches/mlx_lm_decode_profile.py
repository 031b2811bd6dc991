#!/usr/bin/env python3
"""The mlx-lm twin of `decode_profile` (benches/src/bin/decode_profile.rs): the host's time per
decode step in mlx-lm's pipelined greedy loop, split into graph build (the model call and the
sampler), queue (mx.async_eval) and wait (reading token n back), as in mlx_lm.generate's
generate_step (argmax sampler, logprobs = logits - logsumexp).

    python mlx_lm_decode_profile.py MODEL_DIR [--dtype bf16] [--prompt 128] [--gen 128]
"""
import argparse
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--dtype", default="bf16")
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--gen", type=int, default=128)
a = p.parse_args()
model, _ = mlx_lm.load(a.model)
dt = {"bf16": mx.bfloat16, "f32": mx.float32, "f16": mx.float16}[a.dtype]
model.set_dtype(dt)
vocab = model.args.vocab_size if hasattr(model, "args") else 32768
ids = [(i * 7919 + 13) % vocab for i in range(a.prompt)]


def step(y, cache):
    t0 = time.perf_counter()
    logits = model(y[None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    tok = mx.argmax(logprobs, axis=-1)
    t1 = time.perf_counter()
    mx.async_eval(tok, logprobs)
    return tok, t1 - t0, time.perf_counter() - t1


for rnd in range(3):
    cache = make_prompt_cache(model)
    tok, _, _ = step(mx.array(ids, dtype=mx.uint32), cache)
    mx.eval(tok)
    build = queue = wait = 0.0
    t = time.perf_counter()
    for _ in range(a.gen):
        nxt, b, q = step(tok, cache)
        tw = time.perf_counter()
        tok.item()
        wait += time.perf_counter() - tw
        build += b
        queue += q
        tok = nxt
    mx.eval(tok)
    wall = time.perf_counter() - t
    ms = lambda s: s * 1e3 / a.gen
    print(f"mlx-lm round {rnd}: pipelined {ms(wall):.3f} ms/token (build {ms(build):.3f}, queue {ms(queue):.3f}, wait {ms(wait):.3f})", flush=True)
