"""llama.cpp decode speed on a GGUF, through llama-cpp-python, for the packed-kernel rows of
BENCHMARKS.md: a prompt of N tokens (prefill timed), then G greedy tokens one at a time (decode
timed), best of R runs. Build llama-cpp-python with AMX off (its AMX path crashes on this CPU):

    python3 -m venv /work/venvs/llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
      -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF" /work/venvs/llamacpp/bin/pip install llama-cpp-python
    /work/venvs/llamacpp/bin/python benches/llama_cpp_decode.py MODEL.gguf --threads 2
"""
import argparse
import time

import numpy as np
from llama_cpp import Llama


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    llm = Llama(model_path=a.gguf, n_threads=a.threads, n_threads_batch=a.threads, n_ctx=a.prompt + a.gen + 8,
                logits_all=False, verbose=False)
    prompt = [(i * 7919) % 20000 + 100 for i in range(a.prompt)]
    best_pf, best_dec = 0.0, 0.0
    for _ in range(a.runs):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        pf = a.prompt / (time.perf_counter() - t)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(a.gen):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        dec = a.gen / (time.perf_counter() - t)
        best_pf, best_dec = max(best_pf, pf), max(best_dec, dec)
        print(f"run: prefill {pf:.1f} tok/s, decode {dec:.2f} tok/s", flush=True)
    print(f"llama.cpp best of {a.runs}: prefill {best_pf:.1f} tok/s, decode {best_dec:.2f} tok/s ({a.threads} threads)")


if __name__ == "__main__":
    main()
