#!/usr/bin/env python3
"""mlx_lm_bench.py - the mlx-lm side of `llm_bench` (benches/src/main.rs).

Loads a local HF-format checkpoint with `mlx_lm.load` (model and tokenizer, as a user would; the
random checkpoints of `llm_bench --create-random` bundle a 512-id tokenizer, prompts are ids), then
serves timing requests, one JSON object per line on stdin, one JSON result per line on stdout:

    {"prompt": [ids...], "gen": 128}
 -> {"ttft_ms": .., "prefill_tps": .., "decode_tps": .., "peak_bytes": .., "tokens": [...], ...}

Timing follows the Rust side exactly: t0 just before the generator is created, TTFT = first token
id on the host, prefill tok/s = prompt / TTFT, decode tok/s = (n - 1) / (t_last - t_first).
Generation is mlx_lm.generate.generate_step, greedy (sampler=None = argmax), prefill_step_size 2048,
a fresh KV cache per request, and mx.synchronize() after the last token (generate_step queues the
step after it) so no work spills into the next measurement.

    python mlx_lm_bench.py MODEL_DIR [--dtype f32|bf16|f16] [--prompt 128 --gen 128]  # one-off
    python mlx_lm_bench.py MODEL_DIR --dtype f32 --serve                               # for llm_bench
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_config

# model_type aliases our loader accepts but mlx-lm 0.32.2 has no module for: the text-only
# Qwen3.5 layout is read by mlx-lm's qwen3_5 / qwen3_5_moe modules (a flat config = text config).
# Checkpoints made by `llm_bench --create-random` already say qwen3_5 / qwen3_5_moe.
MODEL_TYPE_REMAP = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}

DTYPES = {"bf16": mx.bfloat16, "f32": mx.float32, "f16": mx.float16}


def blas_router_loaded():
    """Whether mlx-sys's BLAS router (llm_bench --peer-blas same) is in this process."""
    import ctypes
    try:
        return hasattr(ctypes.CDLL(None), "mlx_models_blas_routed_products")
    except OSError:
        return False


def run(model, prompt, gen):
    mx.synchronize()
    mx.reset_peak_memory()
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    toks, t_first, t_last = [], None, None
    for tok, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=gen,
                                prompt_cache=cache, prefill_step_size=2048):
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        t_last = now
        toks.append(int(tok))
    mx.synchronize()
    n = len(toks)
    ttft = t_first - t0
    return {
        "prompt_tokens": len(prompt),
        "generated_tokens": n,
        "ttft_ms": ttft * 1e3,
        "prefill_tps": len(prompt) / ttft,
        "decode_tps": (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else 0.0,
        "peak_bytes": mx.get_peak_memory(),
        "tokens": toks,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="f32", choices=list(DTYPES))
    ap.add_argument("--serve", action="store_true", help="read JSON requests from stdin")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--logits", help="write the prompt's last-position f32 logits (little-endian) here and exit")
    ap.add_argument("--time", type=int, default=0, help="with --logits: also time this many forward passes (caches only)")
    a = ap.parse_args()
    t = time.perf_counter()
    raw = load_config(Path(a.model))
    remap = MODEL_TYPE_REMAP.get(raw.get("model_type"))
    model, tokenizer, config = mlx_lm.load(a.model, model_config={"model_type": remap} if remap else None,
                                           return_config=True)
    model.set_dtype(DTYPES[a.dtype])
    mx.eval(model.parameters())
    info = {"ready": True, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "device": str(mx.default_device()), "load_s": time.perf_counter() - t,
            "model_type": config.get("model_type"), "model_type_remapped_from": raw.get("model_type") if remap else None,
            "tokenizer_vocab": len(tokenizer.get_vocab()),
            "weights_bytes": sum(v.nbytes for _, v in __import__("mlx.utils", fromlist=["x"]).tree_flatten(model.parameters())),
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "blas_router": blas_router_loaded(),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            "openblas_l2_size": os.environ.get("OPENBLAS_L2_SIZE")}
    if not a.serve:
        vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 32000)
        prompt = [(i * 7919 + 13) % min(vocab - 100, 30000) + 10 for i in range(a.prompt)]
        if a.logits:
            from mlx_lm.models.cache import make_prompt_cache
            out = model(mx.array([prompt], dtype=mx.uint32), cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
            mx.eval(out)
            Path(a.logits).write_bytes(bytes(memoryview(out)))
            if a.time:
                ms = []
                for _ in range(a.time):
                    t0 = time.perf_counter()
                    c = make_prompt_cache(model)
                    model(mx.array([prompt], dtype=mx.uint32), cache=c)
                    mx.eval([x.state for x in c])
                    ms.append((time.perf_counter() - t0) * 1e3)
                ms.sort()
                print(f"forward of {len(prompt)} tokens: median {ms[len(ms) // 2]:.1f} ms (min {ms[0]:.1f}, max {ms[-1]:.1f}, {a.time} runs)")
            top = mx.argsort(-out)[:5].tolist()
            print(a.dtype, "top5", " ".join(f"{i}:{out[i].item():.4f}" for i in top))
            return
        r = run(model, prompt, a.gen)
        r.pop("tokens")
        print(json.dumps({**info, **r}))
        return
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        if req.get("quit"):
            break
        try:
            out = run(model, req["prompt"], req["gen"])
        except Exception as e:  # report, keep serving
            out = {"error": repr(e)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
