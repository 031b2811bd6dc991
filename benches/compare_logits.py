"""Compare last-position logits files (f32 little-endian, from logits_probe or
mlx_lm_bench.py --logits) against a reference file:

    python benches/compare_logits.py REF.f32 A.f32 [B.f32 ...]

For each file: max and mean |logit - ref|, the top-1 id and whether it equals the reference's,
and the reference's top-1 margin (logit gap to its second id): a reduced-precision run whose
error exceeds that margin can pick another greedy token without being wrong.
"""
import struct
import sys


def load(p):
    b = open(p, "rb").read()
    return list(struct.unpack(f"<{len(b) // 4}f", b))


ref = load(sys.argv[1])
order = sorted(range(len(ref)), key=lambda i: -ref[i])
print(f"{sys.argv[1]}: top1 {order[0]} margin to 2nd {ref[order[0]] - ref[order[1]]:.5f}, logit std {(sum(x * x for x in ref) / len(ref) - (sum(ref) / len(ref)) ** 2) ** 0.5:.4f}")
for p in sys.argv[2:]:
    x = load(p)
    d = [abs(a - b) for a, b in zip(x, ref)]
    top = max(range(len(x)), key=lambda i: x[i])
    print(f"{p}: max|d| {max(d):.5f} mean|d| {sum(d) / len(d):.5f} top1 {top} {'==' if top == order[0] else '!='} ref")
