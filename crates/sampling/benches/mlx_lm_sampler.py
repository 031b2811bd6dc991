"""Time mlx-lm's sampler on the logits, history and settings of benches/sample.rs.

One step = mlx-lm's generate_step work after the model: the logits processors, the
log-softmax, the sampler, and an eval of the token and the log-probs. Each step gets a fresh,
already evaluated logits array (as a model step would; the repetition processor writes into
its input). Prints the median and mean per step.

    /tmp/mlxlm/bin/python crates/sampling/benches/mlx_lm_sampler.py [steps]
"""
import statistics
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors, make_sampler

V = 151936


def logits_np():
    s, out, mask = 0x5EED, np.empty(V, dtype=np.float32), (1 << 64) - 1
    for i in range(V):
        s = (s * 6364136223846793005 + 1442695040888963407) & mask
        out[i] = (s >> 40) / float(1 << 24) * 8.0 - 4.0
    return out.reshape(1, V)


def run(name, sampler, processors, base, tokens, steps):
    fresh = [mx.array(base) for _ in range(steps + 20)]
    mx.eval(fresh)
    times = []
    for i, logits in enumerate(fresh):
        t0 = time.perf_counter()
        for p in processors:
            logits = p(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = sampler(logprobs)
        mx.eval(y, logprobs)
        if i >= 20:  # warm-up (compilation of the mx.compile'd filters)
            times.append(time.perf_counter() - t0)
    med, mean = statistics.median(times) * 1e6, statistics.mean(times) * 1e6
    print(f"{name}: median {med:.1f} us, mean {mean:.1f} us over {len(times)} steps")


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    mx.random.seed(0)
    base = logits_np()
    tokens = mx.array([(i * 7919) % V for i in range(256)])
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    run("greedy", make_sampler(temp=0.0), [], base, tokens, steps)
    run(
        "top_p_penalties",
        make_sampler(temp=0.7, top_p=0.9),
        make_logits_processors(
            repetition_penalty=1.1,
            repetition_context_size=256,
            presence_penalty=0.5,
            presence_context_size=20,
            frequency_penalty=0.3,
            frequency_context_size=20,
        ),
        base,
        tokens,
        steps,
    )


if __name__ == "__main__":
    main()
