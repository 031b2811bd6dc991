#!/usr/bin/env python3
"""Speculative decoding with a draft/target pair, ours against mlx-lm's, in one run.

Greedy (temperature 0) decoding of the same prompt ids:
  * ours: the `generate` example (release build) without `--draft-model`, and with it at a fixed
    depth K and adaptive up to K (`--draft-depth`), read from its `--json` line (decode tok/s and
    the "speculative" counters);
  * mlx-lm: `generate_step` and `speculative_generate_step` (`num_draft_tokens` = K), timed over
    the decode after the first token; acceptance from the `from_draft` flags.

Timings are wall-clock on whatever else the machine is running: run it on an idle machine.
Usage (the SmolLM2 pair: the f32 checkpoint the chat example converts, and its 4-bit
quantization by `convert quantize`):
  python3 crates/speculative/benches/draft_pair.py --target ~/.cache/mlx-models/SmolLM2-135M-Instruct \
      --draft /tmp/smollm2-q4 --tokens 128 --draft-tokens 3
Needs mlx-lm (pip install mlx-lm "mlx[cpu]") for the comparison; --no-mlx-lm skips it.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def ours(exe, target, draft, prompt, n, k, depth="fixed"):
    cmd = [exe, "--model", target, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(n),
           "--temperature", "0", "--kv", "flat", "--json"]
    if draft:
        cmd += ["--draft-model", draft, "--draft-tokens", str(k), "--draft-depth", depth]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def mlx_lm_run(target, draft, prompt, n, k, runs=1):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    model, _ = load(target)
    dmodel, _ = load(draft)
    sampler = make_sampler(temp=0.0)
    res = {}
    for name in ["plain", "speculative"] * runs:
        p = mx.array(prompt)
        toks, flags = [], []
        t0 = None
        if name == "plain":
            it = generate_step(p, model, max_tokens=n, sampler=sampler)
        else:
            it = speculative_generate_step(p, model, dmodel, num_draft_tokens=k, max_tokens=n, sampler=sampler)
        for item in it:
            tok = item[0]
            toks.append(int(tok))
            if name == "speculative":
                flags.append(bool(item[2]))
            if t0 is None:
                t0 = time.perf_counter()
        dt = time.perf_counter() - t0
        r = res.setdefault(name, {"tokens": toks, "rates": []})
        r["rates"].append((len(toks) - 1) / dt)
        r["decode_tokens_per_sec"] = median(r["rates"])
        print(f"mlx-lm {name}: {r['rates'][-1]:.1f} tok/s", file=sys.stderr, flush=True)
        if flags:
            r["from_draft_fraction"] = sum(flags) / len(flags)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--prompt", default="Write a short story about a robot who learns to paint. Once upon a time,")
    ap.add_argument("--prompt-ids", help="comma-separated ids instead of --prompt (needed with --no-mlx-lm)")
    ap.add_argument("--exe", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "examples", "generate"))
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--runs", type=int, default=3, help="interleaved repetitions (medians reported)")
    a = ap.parse_args()
    if a.prompt_ids:
        prompt = [int(x) for x in a.prompt_ids.split(",")]
    else:
        from mlx_lm import load
        _, tok = load(a.target)
        prompt = tok.encode(a.prompt)
    # interleaved repetitions; medians of the decode rates
    runs = {"plain": [], "fixed": [], "adaptive": []}
    outs = {}
    for _ in range(a.runs):
        for mode in runs:
            o = ours(a.exe, a.target, None if mode == "plain" else a.draft, prompt, a.tokens, a.draft_tokens, mode)
            runs[mode].append(o["performance"]["decode_tokens_per_sec"])
            outs[mode] = o
            print(f"ours {mode}: {runs[mode][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    plain = median(runs["plain"])
    report = {"load_before": os.getloadavg(), "ours": {"plain_tok_s": plain, "runs": a.runs}}
    for mode in ["fixed", "adaptive"]:
        r = median(runs[mode])
        report["ours"][mode] = {
            "tok_s": r,
            "speedup": r / plain,
            "speculative": outs[mode].get("speculative"),
            "identical_tokens": outs[mode]["token_ids"] == outs["plain"]["token_ids"],
        }
    if not a.no_mlx_lm:
        m = mlx_lm_run(a.target, a.draft, prompt, a.tokens, a.draft_tokens, a.runs)
        report["mlx_lm"] = {
            "plain_tok_s": m["plain"]["decode_tokens_per_sec"],
            "speculative_tok_s": m["speculative"]["decode_tokens_per_sec"],
            "speedup": m["speculative"]["decode_tokens_per_sec"] / m["plain"]["decode_tokens_per_sec"],
            "from_draft_fraction": m["speculative"].get("from_draft_fraction"),
            "identical_to_ours": m["plain"]["tokens"][: len(outs["plain"]["token_ids"])] == outs["plain"]["token_ids"],
        }
        report["ours_over_mlx_lm"] = {
            "plain": plain / report["mlx_lm"]["plain_tok_s"],
            "fixed": report["ours"]["fixed"]["tok_s"] / report["mlx_lm"]["speculative_tok_s"],
        }
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
