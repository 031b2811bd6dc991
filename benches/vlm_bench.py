#!/usr/bin/env python3
"""Image prefill on the CPU: ours (the `generate` example, release build) against mlx-vlm on the
same random checkpoint, the same image and the same prompt, alternating run by run.

  # 1. checkpoints (transformers + torch: the venv of scripts/make_tiny_qwen35_vl.py)
  python benches/vlm_bench.py make --out ~/.cache/mlx-models/vlm-bench
  # 2. timings (mlx-vlm: `pip install mlx-vlm` in a venv; our side needs no Python)
  python benches/vlm_bench.py run --out ~/.cache/mlx-models/vlm-bench --runs 3

`make` scales each committed tiny fixture's hub-style config (tests/fixtures/tiny/<family>) to a
benchmark size (a 1024-wide, 8-layer language model and a 12-layer vision tower of width 768 for
every family), keeps the fixture's tokenizer and processor
files, and saves random f32 weights (f32: both sides run the CPU's f32 products; bf16 products
are slow on x86 for both). `run` reports, per family, the expanded prompt length and prefill
tok/s (expanded prompt tokens over the time from the start of the forward to the first token,
vision tower included, image decoding and preprocessing excluded on both sides: mlx-vlm's
`prompt_tps`, our `performance.prefill_tokens_per_sec`), medians over the runs, and the ratio.
mlx-vlm must sit on the same mlx as ours (0.32.2: mlx-vlm 0.7.6 is the newest that allows it), and
on the CPU it gets the BLAS ours uses (`--peer-blas same`, the default: mlx-sys's BLAS router and
the system OpenBLAS through LD_PRELOAD; the stock mlx-cpu wheel's reference BLAS is ~15x slower;
`openblas`: OpenBLAS alone; `none`: the wheel as installed).
"""
import glob
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TINY = os.path.join(ROOT, "crates", "models", "tests", "fixtures", "tiny")
PROMPT = "Describe the image."

# family -> (fixture dir, scaled config edits)
FAMILIES = {
    "qwen3_5_vl": (
        "qwen3_5_vl_image",
        {
            "text_config": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128,
                                linear_num_key_heads=8, linear_num_value_heads=16,
                                layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]),
            "vision_config": dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024,
                                  num_position_embeddings=2304),
            "preprocessor": {"size": {"shortest_edge": 65536, "longest_edge": 16777216}},  # Qwen's real pixel bounds
        },
    ),
    "gemma4_vlm": (
        "gemma4_media",
        {
            "text_config": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=128, hidden_size_per_layer_input=128, num_kv_shared_layers=2,
                                layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
                                per_layer_config={"3": {"head_dim": 256}, "7": {"head_dim": 256}}, sliding_window=512),
            "vision_config": dict(num_hidden_layers=12, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                  num_key_value_heads=12, head_dim=64, patch_size=16, position_embedding_size=1024),
            "drop": ["audio_config"],
            # the hub's spelling of the full layers' head size (transformers 5 saves per_layer_config;
            # mlx-vlm reads only global_head_dim; ours reads both)
            "hub_text": {"global_head_dim": 256, "per_layer_config": None},
            "processor": {"patch_size": 16, "max_soft_tokens": 280},
        },
    ),
    "internvl": (
        "internvl",
        {
            "text_config": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=128, layer_types=["full_attention"] * 8,
                                # InternVL2.5's Qwen2 LM: mlx-vlm 0.7.6's internvl_chat has no Qwen3 (q/k norm) LM
                                model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
            "vision_config": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                  image_size=[448, 448], patch_size=[14, 14]),
            "top": {"image_seq_length": 256},
            "hub_text": {"rope_theta": 1000000.0},  # mlx-vlm's InternVL reads it at the top of text_config
            "preprocessor": {"size": {"height": 448, "width": 448}},
        },
    ),
}
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "preprocessor_config.json", "processor_config.json", "chat_template.jinja", "chat_template.json",
               "image_a.png", "image_b.png")


def make(a):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    for fam, (fixture, edits) in FAMILIES.items():
        src, dst = os.path.join(TINY, fixture), os.path.join(a.out, fam)
        if os.path.exists(os.path.join(dst, "model.safetensors")):
            print(f"{fam}: {dst} exists", file=sys.stderr)
            continue
        cfg = json.load(open(os.path.join(src, "config.json")))
        for k in ("text_config", "vision_config"):
            cfg[k].update(edits.get(k, {}))
        cfg.update(edits.get("top", {}))
        for k in edits.get("drop", []):
            cfg.pop(k, None)
        cfg["dtype"] = "float32"
        tmp = dst + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for f in MODEL_FILES:
            if os.path.exists(os.path.join(src, f)):
                shutil.copy(os.path.join(src, f), tmp)
        json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"), indent=1)
        if "preprocessor" in edits:
            p = json.load(open(os.path.join(tmp, "preprocessor_config.json")))
            p.update(edits["preprocessor"])
            json.dump(p, open(os.path.join(tmp, "preprocessor_config.json"), "w"), indent=1)
        if "processor" in edits:
            p = json.load(open(os.path.join(tmp, "processor_config.json")))
            p["image_processor"].update(edits["processor"])
            p.pop("feature_extractor", None)
            json.dump(p, open(os.path.join(tmp, "processor_config.json"), "w"), indent=1)
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tmp), dtype=torch.float32)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
        model.save_pretrained(tmp, safe_serialization=True)
        for k, v in edits.get("hub_text", {}).items():
            cfg["text_config"].pop(k, None) if v is None else cfg["text_config"].__setitem__(k, v)
        json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"), indent=1)  # the hub-style config, not the re-saved one
        os.replace(tmp, dst)
        n = sum(p.numel() for p in model.parameters())
        print(f"{fam}: {n / 1e6:.0f} M parameters -> {dst}", file=sys.stderr)
    chat = os.path.join(a.out, "internvl_chat")
    if os.path.isdir(os.path.join(a.out, "internvl")) and not os.path.exists(chat):
        internvl_chat(os.path.join(a.out, "internvl"), chat)
    img = os.path.join(a.out, "image.png")
    if not os.path.exists(img):
        from PIL import Image
        import numpy as np

        rng = np.random.default_rng(0)
        arr = (rng.random((a.height, a.width, 3)) * 255).astype("uint8")
        Image.fromarray(arr).save(img + ".tmp.png")
        os.replace(img + ".tmp.png", img)


def internvl_chat(native, out):
    """The InternVL checkpoint re-keyed to the internvl_chat layout Qianfan-OCR ships (the one mlx-vlm
    reads with its own processor; its native-InternVL path needs torchvision), by the fixture
    generator's own re-keying with the benchmark sizes."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import make_tiny_internvl as m

    cfg = json.load(open(os.path.join(native, "config.json")))
    v, t = cfg["vision_config"], cfg["text_config"]
    vision = dict(m.VISION, **{k: v[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")},
                  image_size=v["image_size"][0], patch_size=v["patch_size"][0])
    text = dict(m.TEXT, **{k: t[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "head_dim", "model_type")},
                architectures=[{"qwen2": "Qwen2ForCausalLM"}.get(t["model_type"], "Qwen3ForCausalLM")])
    shutil.rmtree(out + ".tmp", ignore_errors=True)
    m.chat_layout(native, out + ".tmp", vision, text, v["image_size"][0])
    os.replace(out + ".tmp", out)
    print(f"internvl_chat: -> {out}", file=sys.stderr)


def ours(exe, model, img):
    cmd = [exe, "--model", model, "--chat", "--prompt", PROMPT, "--image", img, "--max-new-tokens", "1", "--json"]
    env = dict(os.environ, LD_PRELOAD=os.environ.get("VLM_BENCH_OURS_PRELOAD", ""))
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1])
    return len(out["prompt_token_ids"]), out["performance"]["prefill_tokens_per_sec"]


def load_peer(models):
    """mlx-vlm in this process: every model loaded once, with its formatted prompt (or the error)."""
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template

    loaded = {}
    for fam, path in models.items():
        try:
            m, p = load(path)
            loaded[fam] = (m, p, apply_chat_template(p, m.config, PROMPT, num_images=1))
        except Exception as e:  # reported in the table, not fatal
            loaded[fam] = e
    return loaded


def peer_preload(kind):
    openblas = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
    if kind == "none" or not os.path.exists(openblas):
        return ""
    if kind == "openblas":
        return openblas
    routers = glob.glob(os.path.expanduser("~/.cache/mlx-sys/mlx-cpu-*/mlx_cpu.libs/libmlx-models-blas-route-*.so"))
    if not routers:
        sys.exit("--peer-blas same: no BLAS router under ~/.cache/mlx-sys (build mlx-sys first)")
    return f"{max(routers, key=os.path.getmtime)} {openblas}"


def run(a):
    want = peer_preload(a.peer_blas)
    if os.environ.get("LD_PRELOAD", "") != want:  # the peer's BLAS is chosen at process start
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, LD_PRELOAD=want, VLM_BENCH_OURS_PRELOAD=os.environ.get("LD_PRELOAD", "")))
    exe = a.exe or os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "examples", "generate")
    img = os.path.join(a.out, "image.png")
    # InternVL runs in the InternVL-Chat layout (Qianfan-OCR's), the one mlx-vlm reads
    names = [f for f in FAMILIES if f != "internvl"] + ["internvl_chat"]
    models = {f: os.path.join(a.out, f) for f in names if os.path.isdir(os.path.join(a.out, f))}
    from mlx_vlm import stream_generate

    loaded = load_peer(models)
    rows = {}
    for fam, path in models.items():
        r = rows.setdefault(fam, {"ours": [], "mlx_vlm": [], "tokens": None, "peer_tokens": None, "peer_error": None})
        for i in range(a.runs + 1):  # the first round warms both sides up and is dropped
            n, tps = ours(exe, path, img)
            r["tokens"] = n
            if i:
                r["ours"].append(tps)
            print(f"{fam} ours: {n} tokens, {tps:.1f} tok/s", file=sys.stderr, flush=True)
            l = loaded[fam]
            if isinstance(l, Exception):
                r["peer_error"] = f"{type(l).__name__}: {l}"[:200]
                continue
            m, p, prompt = l
            for resp in stream_generate(m, p, prompt, image=[img], max_tokens=1):
                pass
            r["peer_tokens"] = resp.prompt_tokens
            if i:
                r["mlx_vlm"].append(resp.prompt_tps)
            print(f"{fam} mlx-vlm: {resp.prompt_tokens} tokens, {resp.prompt_tps:.1f} tok/s", file=sys.stderr, flush=True)
    print(f"load {os.getloadavg()[0]:.1f}; {a.runs} runs, medians; image {img}; mlx-vlm LD_PRELOAD={os.environ.get('LD_PRELOAD') or '(none)'}")
    print("| family | prompt tokens (ours / mlx-vlm) | ours tok/s | mlx-vlm tok/s | ratio |\n|---|---|---|---|---|")
    for fam, r in rows.items():
        o = statistics.median(r["ours"])
        if r["peer_error"]:
            print(f"| {fam} | {r['tokens']} / - | {o:.1f} | mlx-vlm cannot load it: {r['peer_error']} | - |")
            continue
        m = statistics.median(r["mlx_vlm"])
        print(f"| {fam} | {r['tokens']} / {r['peer_tokens']} | {o:.1f} | {m:.1f} | {o / m:.2f}x |")
    json.dump(rows, open(os.path.join(a.out, "vlm-bench.json"), "w"), indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", default=os.path.expanduser("~/.cache/mlx-models/vlm-bench"))
    m.add_argument("--width", type=int, default=448)
    m.add_argument("--height", type=int, default=448)
    r = sub.add_parser("run")
    r.add_argument("--out", default=os.path.expanduser("~/.cache/mlx-models/vlm-bench"))
    r.add_argument("--runs", type=int, default=3)
    r.add_argument("--peer-blas", choices=["same", "openblas", "none"], default="same")
    r.add_argument("--exe", help="our generate example (default: target/release/examples/generate)")
    a = ap.parse_args()
    make(a) if a.cmd == "make" else run(a)


if __name__ == "__main__":
    main()
