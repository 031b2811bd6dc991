"""Serving benchmark: mlx-serve against mlx_lm.server on the same model, prompts and max tokens.

    python3 benches/serve_bench.py --model DIR --ours BIN [--mlx-lm-python /tmp/mlxlm/bin/python]
        [--concurrency 1,8,32,64] [--max-tokens 64] [--which ours,mlx_lm] [--json OUT]
        [--warmup C] [--warmup-tokens N] [--server-log FILE]
    python3 benches/serve_bench.py --table A.json [B.json ...]    # the table of saved results

Each server is started on 127.0.0.1 (its own free port) and warmed up once: `--warmup` C
streaming requests at once of `--warmup-tokens` tokens each (default 1 request of 8; C = the
largest level has a GPU backend build the kernels of every batch shape before the timed levels).
Then for each concurrency level C, C streaming chat requests (distinct prompts, temperature 0,
`max_tokens`) are sent at once. Per level: aggregate tok/s = completion tokens of all C
requests / wall time from sending the first to finishing the last; TTFT = request sent to the
first streamed token (a chunk with answer or reasoning text), p50 and p99 over the C requests. Completion tokens
come from the final usage chunk (`stream_options.include_usage`), else from the number of
chunks with text. `--json` is rewritten after every level, so a run stopped by a time limit
keeps the levels it finished; SIGTERM stops the server before exiting. Standard library only
(any python3).

On the CPU give both sides the same BLAS and dtype: `--mlx-lm-preload "ROUTER OPENBLAS"` (mlx-sys's
`libmlx-models-blas-route-*.so` under ~/.cache/mlx-sys/mlx-cpu-0.32.2/mlx_cpu.libs and
/usr/lib/x86_64-linux-gnu/libopenblas.so.0) and an f32 checkpoint (ours computes in f32 on the CPU;
mlx_lm.server computes in the checkpoint's dtype).
"""
import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

TOPICS = ["the sea", "a robot", "mountains", "a city at night", "an old library", "the moon", "a garden", "a train journey"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_ready(port, proc, timeout=600):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                raw = r.read()
        except urllib.error.HTTPError:
            return None  # answering: ready
        except Exception:
            time.sleep(0.5)
            continue
        try:  # mlx_lm.server lists only hub-cache models
            data = json.loads(raw).get("data") or []
        except ValueError:
            data = []
        return data[0]["id"] if data else None
    sys.exit("server did not become ready")


async def stream_one(port, body):
    """(ttft seconds or None, completion tokens, total seconds)."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split()[1])
    chunked = b"transfer-encoding: chunked" in head.lower()
    ttft, chunks, usage = None, 0, None
    buf = b""

    async def raw_pieces():
        if not chunked:
            while True:
                b = await reader.read(65536)
                if not b:
                    return
                yield b
        while True:
            line = await reader.readline()
            if not line:
                return
            n = int(line.strip() or b"0", 16)
            if n == 0:
                return
            b = await reader.readexactly(n)
            await reader.readexactly(2)
            yield b

    done = False
    async for piece in raw_pieces():
        if done:
            break
        buf += piece
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            for line in ev.split(b"\n"):
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    done = True  # mlx_lm.server may keep the connection open after it
                    continue
                obj = json.loads(payload)
                if status != 200 or "error" in obj:
                    raise RuntimeError(f"server error: {obj}")
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    d = ch.get("delta") or {}
                    # answer or reasoning text (a thinking template streams the latter first)
                    if d.get("content") or d.get("reasoning_content") or d.get("reasoning"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
    writer.close()
    if status != 200:
        raise RuntimeError(f"HTTP {status}")
    tokens = usage["completion_tokens"] if usage else chunks
    return ttft, tokens, time.perf_counter() - t0


def request_body(model, i, max_tokens):
    topic = TOPICS[i % len(TOPICS)]
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Request {i}: write a long, detailed story about {topic}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def level(port, model, c, max_tokens, offset):
    t0 = time.perf_counter()
    res = await asyncio.gather(*[stream_one(port, request_body(model, offset + i, max_tokens)) for i in range(c)])
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in res if r[0] is not None)
    tokens = sum(r[1] for r in res)

    def pct(p):
        if not ttfts:
            return None
        k = min(len(ttfts) - 1, max(0, int(round(p / 100 * (len(ttfts) - 1)))))
        return ttfts[k]

    return {"concurrency": c, "tokens": tokens, "wall_s": wall, "agg_tok_s": tokens / wall, "ttft_p50_s": pct(50), "ttft_p99_s": pct(99),
            "ttft_mean_s": statistics.mean(ttfts) if ttfts else None}


def run_server(kind, a, results):
    """Start `kind`, warm it up, run the levels; each level's result is appended to `results`
    and saved (`--json`) as soon as it is measured."""
    port = free_port()
    if kind == "ours":
        db = os.path.join(tempfile.mkdtemp(), "r.db")
        cmd = [a.ours, "--model", a.model, "--port", str(port), "--db", db, "--max-queue", "1024"]
        if a.max_batch:
            cmd += ["--max-batch", str(a.max_batch)]
    else:
        cmd = [a.mlx_lm_python, "-m", "mlx_lm.server", "--model", a.model, "--port", str(port)]
        if a.max_batch:
            cmd += ["--decode-concurrency", str(a.max_batch)]
    env = dict(os.environ)
    if kind == "mlx_lm" and a.mlx_lm_preload:
        env["LD_PRELOAD"] = a.mlx_lm_preload
    log = open(f"{a.server_log}.{kind}", "w") if a.server_log else None
    err = log if log else (None if a.verbose else subprocess.DEVNULL)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        t0 = time.perf_counter()
        listed = wait_ready(port, proc)
        # mlx_lm.server loads whatever `model` names (a hub id or a path): name the served path.
        model = listed if kind == "ours" else a.model
        print(f"{kind:7s} ready in {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        w = asyncio.run(level(port, model, a.warmup, a.warmup_tokens, 999))
        print(f"{kind:7s} warm-up: {a.warmup} streams of {a.warmup_tokens} tokens in {time.perf_counter() - t0:.1f} s "
              f"(TTFT p50 {fmt(w['ttft_p50_s'])})", flush=True)
        for i, c in enumerate(a.concurrency):
            r = asyncio.run(level(port, model, c, a.max_tokens, 1000 * (i + 1)))
            r["server"] = kind
            print(f"{kind:7s} C={c:3d}: {r['agg_tok_s']:8.1f} tok/s aggregate ({r['tokens']} tokens in {r['wall_s']:.2f} s), "
                  f"TTFT p50 {fmt(r['ttft_p50_s'])} p99 {fmt(r['ttft_p99_s'])}", flush=True)
            results.append(r)
            save(a, results)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log:
            log.close()


def save(a, results):
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"model": a.model, "max_tokens": a.max_tokens, "results": results}, f, indent=1)
        os.replace(tmp, a.json)


def fmt(s):
    return "n/a" if s is None else f"{s * 1e3:.0f} ms"


def table(results, levels):
    by = {(r["server"], r["concurrency"]): r for r in results}
    print("\n| streams | ours tok/s | mlx_lm tok/s | ratio | ours TTFT p50 / p99 | mlx_lm TTFT p50 / p99 |\n|---|---|---|---|---|---|")
    for c in levels:
        o, m = by.get(("ours", c)), by.get(("mlx_lm", c))
        ratio = f"{o['agg_tok_s'] / m['agg_tok_s']:.2f}x" if o and m else "-"
        cell = lambda r: f"{r['agg_tok_s']:.1f}" if r else "-"
        tt = lambda r: f"{fmt(r['ttft_p50_s'])} / {fmt(r['ttft_p99_s'])}" if r else "-"
        print(f"| {c} | {cell(o)} | {cell(m)} | {ratio} | {tt(o)} | {tt(m)} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--ours", help="mlx-serve binary")
    ap.add_argument("--mlx-lm-python", default="/tmp/mlxlm/bin/python")
    ap.add_argument("--concurrency", default="1,8,32,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1, help="streams of the one warm-up pass")
    ap.add_argument("--warmup-tokens", type=int, default=8, help="max tokens of each warm-up stream")
    ap.add_argument("--max-batch", type=int, help="sequences decoded together: mlx-serve --max-batch, mlx_lm.server --decode-concurrency (default: each server's, 32 both)")
    ap.add_argument("--which", default="ours,mlx_lm")
    ap.add_argument("--mlx-lm-preload", default="",
                    help="LD_PRELOAD for mlx_lm.server (on the CPU: mlx-sys's BLAS router and the system OpenBLAS, the BLAS ours uses; "
                         "the mlx-cpu wheel alone runs reference BLAS)")
    ap.add_argument("--json")
    ap.add_argument("--server-log", help="each server's stderr goes to FILE.ours / FILE.mlx_lm")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the table of saved results and exit")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    if a.table:
        results = []
        for p in a.table:
            with open(p) as f:
                results += json.load(f)["results"]
        table(results, sorted({r["concurrency"] for r in results}))
        return
    if not a.model:
        sys.exit("--model DIR is required")
    # `timeout` and the run tool stop a run with SIGTERM: unwind, so each server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = []
    for kind in a.which.split(","):
        if kind == "ours" and not a.ours:
            sys.exit("--ours BIN is required")
        run_server(kind, a, results)
    table(results, a.concurrency)


if __name__ == "__main__":
    main()
