"""Checks of mlx-serve with the official `openai` Python client (run by check_server_openai.sh).

Starts the server on 127.0.0.1 (a free port) over a chat model and an embedding model and
checks: chat (plain, streaming, tools), completions, embeddings, a responses chain through
previous_response_id (streaming events in order), N concurrent streaming requests at
temperature 0 each equal to the same request alone, and that a killed and restarted server
still returns its stored responses. Prints one line per check; exits 1 on the first failure.
"""
import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request

import openai


ENGINE = []


def start(binary, model, db, extra=()):
    p = subprocess.Popen([binary, "--model", model, "--port", "0", "--db", db, *ENGINE, *extra], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if "listening on http://" not in line:
        p.kill()
        sys.exit(f"server did not start: {line!r}")
    url = line.strip().rsplit("listening on ", 1)[1]
    return p, url + "/v1"


def check(name, cond, detail=""):
    if not cond:
        print(f"FAIL {name} {detail}")
        sys.exit(1)
    print(f"ok   {name} {detail}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--embed-model", required=True)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--engine", default="batch", choices=["batch", "sequential"])
    a = ap.parse_args()
    ENGINE.extend(["--engine", a.engine])
    print(f"engine: {a.engine}")
    tmp = tempfile.mkdtemp()
    db = os.path.join(tmp, "responses.db")
    proc, base = start(a.bin, a.model, db)
    try:
        c = openai.OpenAI(base_url=base, api_key="unused")
        model = c.models.list().data[0].id
        check("models", model == os.path.basename(os.path.realpath(a.model)), model)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=a.max_tokens, temperature=0)
        text = r.choices[0].message.content or ""
        check("chat", r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length"), repr(text[:40]))
        parts = []
        usage = None
        for ch in c.chat.completions.create(model=model, messages=msgs, max_tokens=a.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}):
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
            if ch.usage:
                usage = ch.usage
        check("chat stream equals non-stream", "".join(parts) == text and usage is not None)
        # The sequential engine continues its kept cache; the batching loop computes prompts in full.
        want_cached = usage.prompt_tokens - 1 if a.engine == "sequential" else 0
        check("cached_tokens reported", usage.prompt_tokens_details.cached_tokens == want_cached, f"{usage.prompt_tokens_details.cached_tokens}/{usage.prompt_tokens}")
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        rt = c.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=4, temperature=0)
        check("tools rendered", rt.usage.prompt_tokens > r.usage.prompt_tokens, f"{r.usage.prompt_tokens} -> {rt.usage.prompt_tokens}")
        conv = msgs + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
        ]
        rc = c.chat.completions.create(model=model, messages=conv, tools=tools, max_tokens=4, temperature=0)
        check("tool result turn", rc.usage.prompt_tokens > rt.usage.prompt_tokens)
        try:
            c.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=2)
            check("unknown model refused", False)
        except openai.BadRequestError as e:
            check("unknown model refused", e.code == "model_not_found", str(e.code))
        cp = c.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
        check("completions", cp.usage.completion_tokens > 0, repr(cp.choices[0].text[:40]))

        r1 = c.responses.create(model=model, input="Hello, who are you?", instructions="Be brief.", max_output_tokens=a.max_tokens, temperature=0)
        r2 = c.responses.create(model=model, input="And what can you do?", instructions="Be brief.", previous_response_id=r1.id, max_output_tokens=a.max_tokens, temperature=0)
        cached = r2.usage.input_tokens_details.cached_tokens
        live = r1.usage.input_tokens + r1.usage.output_tokens
        check("responses chain" + (" reuses the live sequence" if a.engine == "sequential" else ""),
              cached == (live if a.engine == "sequential" else 0) and r2.usage.input_tokens > live,
              f"cached {cached}, first turn {r1.usage.input_tokens}+{r1.usage.output_tokens}")
        events = list(c.responses.create(model=model, input="Stream please", previous_response_id=r2.id, max_output_tokens=8, temperature=0, stream=True))
        kinds = [e.type for e in events]
        seqs = [e.sequence_number for e in events]
        head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
        ordered = kinds[:4] == head and kinds[-4:-1] == tail and kinds[-1] in ("response.completed", "response.incomplete") \
            and all(k == "response.output_text.delta" for k in kinds[4:-4])
        check("responses stream events in order", ordered and seqs == list(range(len(events))), f"{len(events)} events")
        r3_id = events[-1].response.id
        got = c.responses.retrieve(r2.id)
        check("responses retrieve", got.output_text == r2.output_text)

        async def many():
            ac = openai.AsyncOpenAI(base_url=base, api_key="unused")

            async def one(i):
                out = []
                stream = await ac.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=a.max_tokens, temperature=0, stream=True)
                async for ch in stream:
                    if ch.choices and ch.choices[0].delta.content:
                        out.append(ch.choices[0].delta.content)
                return "".join(out)

            alone = [await one(i) for i in range(a.concurrency)]
            together = await asyncio.gather(*[one(i) for i in range(a.concurrency)])
            return alone, together

        alone, together = asyncio.run(many())
        same = sum(x == y for x, y in zip(alone, together))
        check(f"{a.concurrency} concurrent T=0 streams equal lone requests", same == a.concurrency, f"{same}/{a.concurrency}")
        metrics = urllib.request.urlopen(base[:-3] + "/metrics").read().decode()
        rows = float(next(l.split()[1] for l in metrics.splitlines() if l.startswith("mlx_serve_max_sequences_per_step ")))
        check("sequences per forward pass", rows > 1 if a.engine == "batch" else rows == 1, f"max {rows:.0f}")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc, base = start(a.bin, a.model, db)
    try:
        c = openai.OpenAI(base_url=base, api_key="unused")
        got = c.responses.retrieve(r3_id)
        check("restart keeps stored responses", got.id == r3_id and got.previous_response_id == r2.id)
        r4 = c.responses.create(model=model, input="Continue", previous_response_id=r3_id, max_output_tokens=4, temperature=0)
        check("chain replayed from the store after restart", r4.usage.input_tokens > r2.usage.input_tokens)
        d = c.responses.delete(r4.id)
        try:
            c.responses.retrieve(r4.id)
            check("delete", False)
        except openai.NotFoundError:
            check("delete", True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
    proc, base = start(a.bin, a.embed_model, os.path.join(tmp, "e.db"))
    try:
        c = openai.OpenAI(base_url=base, api_key="unused")
        e = c.embeddings.create(model=c.models.list().data[0].id, input=["a cat", "a dog"])
        norms = [sum(x * x for x in d.embedding) ** 0.5 for d in e.data]
        check("embeddings", len(e.data) == 2 and all(abs(n - 1) < 1e-4 for n in norms), f"dim {len(e.data[0].embedding)}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
    print("all checks passed")


if __name__ == "__main__":
    main()
