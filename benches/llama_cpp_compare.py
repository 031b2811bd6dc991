"""Decode speed of llama.cpp and ours on the same weights, side by side in one run.

llama.cpp (through llama-cpp-python) decodes a GGUF; ours (`llm_bench --no-mlx-lm`) decodes the
same GGUF converted to MLX affine 4-bit (`convert gguf`, then `convert quantize --bits 4
--group-size 32`: Q4_1's blocks are 32 weights with a scale and a minimum, MLX's affine groups a
scale and a bias), computing in f32 (the loader's CPU default; llama.cpp's activations are f32
too). Both sides: a prompt of --prompt tokens, then --gen greedy tokens one at a time
on --threads threads; runs alternate (llama.cpp, ours) after one warm-up each. Prints each run,
the medians and the ratio ours / llama.cpp of the median decode tok/s.

Build llama-cpp-python with AMX off (its AMX path crashes on CPUs that report AMX without
allowing it), in a venv outside the repository:

    python3 -m venv /work/venvs/llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
      -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF" /work/venvs/llamacpp/bin/pip install llama-cpp-python

Then, with the release builds of `llm_bench` and mlx-convert's `convert` example:

    cargo build --release -p mlx-models-bench --bin llm_bench
    cargo build --release -p mlx-convert --example convert
    /work/venvs/llamacpp/bin/python benches/llama_cpp_compare.py \
        ~/.cache/mlx-models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf --target-dir TARGET_DIR

(the GGUF is the one `scripts/fetch_gguf.sh` and the chat example fetch). `--before-target-dir
DIR` adds a second `llm_bench` (DIR/release/llm_bench, e.g. a build of an earlier commit) to the
alternation, on the same converted weights, for a before/after measured in the same run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from llama_cpp import Llama


def llama_cpp_run(llm, prompt, gen):
    """One request: prefill tok/s and decode tok/s (gen - 1 steps after the first token)."""
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t_first = time.perf_counter()
    for _ in range(gen - 1):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t_last = time.perf_counter()
    return len(prompt) / (t_first - t), (gen - 1) / (t_last - t_first)


def ours_run(llm_bench, model, prompt, gen, threads):
    """One request of llm_bench (it times the same way: decode = (gen - 1) / (t_last - t_first))."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        subprocess.run([llm_bench, "--model", model, "--dtype", "f32", "--no-mlx-lm", "--runs", "1", "--gen", str(gen),
                        "--prompts", str(prompt), "--json", f.name], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        r = json.load(open(f.name))["ours"][0][0]
    return r["prefill_tps"], r["decode_tps"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--target-dir", default=os.environ.get("CARGO_TARGET_DIR", "target"),
                    help="cargo target directory holding release/llm_bench and release/examples/convert")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--before-target-dir", help="a second target directory whose release/llm_bench joins the alternation")
    a = ap.parse_args()
    rel = os.path.join(a.target_dir, "release")
    llm_bench, convert = os.path.join(rel, "llm_bench"), os.path.join(rel, "examples", "convert")
    before = os.path.join(a.before_target_dir, "release", "llm_bench") if a.before_target_dir else None
    for b in (llm_bench, convert) + ((before,) if before else ()):
        if not os.path.isfile(b):
            sys.exit(f"{b} is missing: build it with cargo build --release (see the script's docs)")
    with tempfile.TemporaryDirectory() as work:
        full, q4 = os.path.join(work, "bf16"), os.path.join(work, "q4")
        subprocess.run([convert, "gguf", a.gguf, full, "--dtype", "bf16"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([convert, "quantize", full, q4, "--bits", "4", "--group-size", "32"], check=True,
                       stdout=subprocess.DEVNULL)
        llm = Llama(model_path=a.gguf, n_threads=a.threads, n_threads_batch=a.threads,
                    n_ctx=a.prompt + a.gen + 8, verbose=False)
        vocab = llm.n_vocab()
        prompt = [(i * 7919) % (vocab - 200) + 100 for i in range(a.prompt)]
        llama_cpp_run(llm, prompt, a.gen)  # warm-up
        ours_run(llm_bench, q4, a.prompt, a.gen, a.threads)
        if before:
            ours_run(before, q4, a.prompt, a.gen, a.threads)
        theirs, ours, earlier = [], [], []
        for r in range(a.runs):
            theirs.append(llama_cpp_run(llm, prompt, a.gen))
            ours.append(ours_run(llm_bench, q4, a.prompt, a.gen, a.threads))
            line = (f"run {r + 1}: llama.cpp prefill {theirs[-1][0]:.1f} decode {theirs[-1][1]:.2f} tok/s | "
                    f"ours prefill {ours[-1][0]:.1f} decode {ours[-1][1]:.2f} tok/s")
            if before:
                earlier.append(ours_run(before, q4, a.prompt, a.gen, a.threads))
                line += f" | before prefill {earlier[-1][0]:.1f} decode {earlier[-1][1]:.2f} tok/s"
            print(line, flush=True)
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    print(f"{os.path.basename(a.gguf)}, {a.threads} threads, prompt {a.prompt}, {a.gen} new tokens, "
          f"median of {a.runs} runs (load {os.getloadavg()[0]:.2f}):")
    print(f"  llama.cpp (GGUF): prefill {med(theirs, 0):.1f} tok/s, decode {med(theirs, 1):.2f} tok/s")
    print(f"  ours (MLX 4-bit g32): prefill {med(ours, 0):.1f} tok/s, decode {med(ours, 1):.2f} tok/s")
    print(f"  decode ours / llama.cpp: {med(ours, 1) / med(theirs, 1):.2f}x")
    if before:
        print(f"  before ({a.before_target_dir}): prefill {med(earlier, 0):.1f} tok/s, decode {med(earlier, 1):.2f} tok/s, "
              f"{med(earlier, 1) / med(theirs, 1):.2f}x llama.cpp; ours / before {med(ours, 1) / med(earlier, 1):.2f}x")


if __name__ == "__main__":
    main()
