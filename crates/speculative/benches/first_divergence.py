#!/usr/bin/env python3
"""Lines of `NAME JSON` (the `generate` example's --json line per run) against the run named
`plain` (or `plain-tf32off` for names ending in `-tf32off`): per run, the first generated token
where it leaves that run's tokens (None: identical over the shorter), decode tok/s and the
speculative counters.

  python3 first_divergence.py GEN_LOG
"""
import json
import sys


def main(path):
    runs = {}
    for line in open(path):
        name, _, js = line.strip().partition(" ")
        if not name:
            continue
        try:
            runs[name] = json.loads(js)
        except json.JSONDecodeError:
            runs[name] = None
            print(f"{name}: no JSON line ({js[:160]!r})")
    for name, d in runs.items():
        if d is None:
            continue
        ref = runs.get("plain-tf32off" if name.endswith("-tf32off") else "plain") or {}
        toks, want = d["token_ids"], ref.get("token_ids", [])
        diff = next((i for i, (a, b) in enumerate(zip(toks, want)) if a != b), None)
        s = d.get("speculative") or {}
        by = [round(a, 2) for a in s.get("acceptance_by_position", [])]
        print(f"{name}: leaves plain at token {diff}, {len(toks)} tokens, "
              f"{d['performance']['decode_tokens_per_sec']:.1f} tok/s, accepted {s.get('accepted_mean')}, "
              f"by position {by} | {d['text'][:60]!r}")


if __name__ == "__main__":
    main(sys.argv[1])
