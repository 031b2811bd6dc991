#!/usr/bin/env python3
"""Real checkpoints against mlx-lm, in f32 on the CPU: chat prompt ids and greedy tokens.

    scripts/fetch_gguf.sh
    cargo build --release -p mlx-convert --example convert -p mlx-models --example generate
    python3 scripts/check_real_models.py [--tokens 32] [--work DIR]

Needs: pip install mlx-lm 'mlx[cpu]' (Linux: the mlx[cpu] extra carries the CPU backend).

For SmolLM2-135M-Instruct and Gemma 3 270M (the GGUFs of scripts/fetch_gguf.sh) it converts the
GGUF to an f32 Hugging Face directory with our `convert` example, renders one fixed chat prompt
with our `generate --chat` and with mlx-lm's tokenizer (the ids must agree), decodes `--tokens`
greedy tokens with both on the same directory, and prints both token lists and whether they agree.
Exit status 1 when a prompt or a token differs. Speed against mlx-lm (with the same BLAS on both
sides) is `llm_bench --model DIR`: BENCHMARKS.md, "Real checkpoints".
"""
import argparse
import json
import os
import subprocess
import sys
import time

MODELS = [
    ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", "Write a short story about a lighthouse keeper."),
    ("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf", "Write one sentence about the sea."),
]


def ours(gen, d, prompt, n):
    out = subprocess.run([gen, "--model", d, "--chat", "--prompt", prompt, "--max-new-tokens", str(n), "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def mlx_lm_run(d, prompt, prompt_ids, n):
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.set_default_device(mx.cpu)
    model, tok = load(d)
    rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = []
    for r in stream_generate(model, tok, mx.array(prompt_ids), max_tokens=n, sampler=make_sampler(temp=0.0)):
        ids.append(int(r.token))
    # stream_generate yields the stop token too and then ends; ours stops without returning it
    return list(rendered), ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cache", default=os.environ.get("MLX_MODELS_CACHE", os.path.expanduser("~/.cache/mlx-models")))
    ap.add_argument("--work", default="/tmp/mlx-models-real")
    ap.add_argument("--bin", default="target/release/examples")
    a = ap.parse_args()
    conv, gen = os.path.join(a.bin, "convert"), os.path.join(a.bin, "generate")
    ok = True
    for name, gguf, prompt in MODELS:
        src = os.path.join(a.cache, "gguf", gguf)
        d = os.path.join(a.work, name + "-f32")
        if not os.path.exists(os.path.join(d, "model.safetensors")):
            subprocess.run([conv, "gguf", src, d, "--dtype", "f32"], check=True)
        t0 = time.time()
        o = ours(gen, d, prompt, a.tokens)
        rendered, m_ids = mlx_lm_run(d, prompt, o["prompt_token_ids"], a.tokens)
        same_prompt = rendered == o["prompt_token_ids"]
        ids = o["token_ids"]
        # equal up to where one stopped; a stop must be at the same place (mlx-lm yields the stop id)
        n = min(len(ids), len(m_ids))
        agree = ids[:n] == m_ids[:n] and (len(ids) == len(m_ids) or len(m_ids) == len(ids) + 1)
        ok &= same_prompt and agree
        print(json.dumps({"model": name, "prompt": prompt, "prompt_ids_equal": same_prompt, "tokens_equal": agree,
                          "compared_tokens": n, "ours": ids, "mlx_lm": m_ids, "text": o["text"],
                          "seconds": round(time.time() - t0, 1)}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
