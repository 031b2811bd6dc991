#!/usr/bin/env python3
"""A tiny random Qwen3.5 vision-language checkpoint (tower included, hub-style config) and its
transformers references, for tests/parity_qwen3_5_vl.rs.

    python3 scripts/make_tiny_qwen35_vl.py [OUT_DIR]   (needs torch, transformers, safetensors, pillow)

OUT_DIR defaults to crates/models/tests/fixtures/tiny/qwen3_5_vl_image. The shapes are those of the
`qwen3_5_vl` fixture (4 hybrid layers of 64, a one-block vision tower of 32 with 16-pixel patches
merged 2x2); the tokenizer is that fixture's (the real Qwen3 tokenizer shrunk to 512 ids) with a
chat template that writes `<|vision_start|><|image_pad|><|vision_end|>` for each image part, as
Qwen3.5's does. Two images are drawn from a fixed formula (no randomness): A is 100x61 and B 50x70
pixels, so the smart resize (factor 32, min 32*32, max 128*128 pixels) resamples both.

Weights: random (HF init, 1-D tensors perturbed as make_tiny_dense.py does), rounded to bf16 and
saved with `save_pretrained`; the references come from the model reloaded in f32 with eager
attention. `reference.safetensors` holds:
- `pixel_values_a` / `grid_a`, `grid_b`: `Qwen2VLImageProcessorPil` output (B's pixel values are
  left out to keep the fixture under 1 MB; its tower output is kept);
- `tower_a`, `tower_b`: `get_image_features` (the merged tower output) of each image;
- `ids_1`: the expanded ids of [user: image A + text] with the generation prompt (the chat template
  rendered by the tokenizer, each `<|image_pad|>` repeated grid_h * grid_w / 4 times, as the
  processor does), `logits_1` its full-prompt logits, `greedy_1` the prompt and 8 greedy tokens;
- `ids_2`, `logits_2`, `greedy_2`: the same for [user: image A + text, assistant: text, user:
  image B + text], `logits_2` for its last TAIL_2 positions only (image B's tokens and the text
  after them).
"""
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers as T
from PIL import Image
from safetensors.torch import save_file
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_dense import margins, perturb  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "crates", "models", "tests", "fixtures", "tiny")
STEPS = 8
TAIL_2 = 16
IMAGE, START, END = 498, 495, 496

TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

def image_turns(prompt):
    """The fixtures' conversations: one image with `prompt`, then a reply and a second image."""
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    return one, one + [
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And here?"}]},
    ]


MESSAGES_1, MESSAGES_2 = image_turns("What is in the picture?")


def image(w, h, k):
    """Smooth colour gradients with a diagonal stripe (deterministic)."""
    y, x = np.mgrid[0:h, 0:w]
    r = (x * 255 // max(w - 1, 1) + k * 40) % 256
    g = (y * 255 // max(h - 1, 1) + k * 90) % 256
    b = np.where((x + y * 2 + k) % 17 < 6, 230, 20 + k * 30)
    return Image.fromarray(np.stack([r, g, b], -1).astype(np.uint8), "RGB")


def config():
    base = json.load(open(os.path.join(FIXTURES, "qwen3_5_vl", "config.json")))
    text = {k: v for k, v in base["text_config"].items() if k not in ("model_type",)}
    vision = {k: v for k, v in base["vision_config"].items() if k not in ("model_type",)}
    return T.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=499,
                           vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False)


def expand(ids, grids, merge):
    out, k = [], 0
    for t in ids:
        if t == IMAGE:
            n = int(grids[k].prod()) // (merge * merge)
            out.extend([IMAGE] * n)
            k += 1
        else:
            out.append(t)
    assert k == len(grids)
    return torch.tensor([out], dtype=torch.long)


@torch.no_grad()
def run(model, ids, pixel_values, grids):
    """Full-prompt logits, and the prompt with STEPS greedy tokens decoded through the cache (the
    3-D positions of the prompt, then its rope delta)."""
    kw = dict(pixel_values=pixel_values, image_grid_thw=grids, mm_token_type_ids=(ids == IMAGE).long())
    logits = model(input_ids=ids, use_cache=False, **kw).logits[0].float()
    model.model.rope_deltas = None
    out = model(input_ids=ids, use_cache=True, **kw)
    seq = ids
    for _ in range(STEPS):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    model.model.rope_deltas = None
    return logits, seq


def prompt_references(model, tok, ref, meta, merge, messages_1, messages_2):
    """`ids_N`, `logits_N` (the last TAIL_2 rows for N = 2) and `greedy_N` into `ref`, the rendered
    text, greedy tail and smallest top-1/top-2 margin into `meta`, for [messages_1 with image A] and
    [messages_2 with images A and B] (`ref` holds their `pixel_values_*` and `grid_*`)."""
    for n, (msgs, keys) in {"1": (messages_1, "a"), "2": (messages_2, "ab")}.items():
        raw = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        raw = raw["input_ids"] if isinstance(raw, dict) else raw
        grids = torch.cat([ref[f"grid_{k}"] for k in keys])
        ids = expand(list(raw), grids, merge)
        pixels = torch.cat([ref[f"pixel_values_{k}"] for k in keys])
        logits, seq = run(model, ids, pixels, grids)
        ref[f"ids_{n}"], ref[f"logits_{n}"], ref[f"greedy_{n}"] = ids, logits if n == "1" else logits[-TAIL_2:], seq
        meta[f"text_{n}"] = tok.decode(raw)
        meta[f"greedy_new_{n}"] = seq[0, ids.shape[1]:].tolist()
        meta[f"prefill_top1_top2_margin_min_{n}"] = min(margins(logits))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(FIXTURES, "qwen3_5_vl_image")
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(50)
    model = T.Qwen3_5ForConditionalGeneration(config()).eval()
    perturb(model, 51)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    src = os.path.join(FIXTURES, "qwen3_5_vl")
    shutil.copy(os.path.join(src, "tokenizer.json"), out)
    tc = json.load(open(os.path.join(src, "tokenizer_config.json")))
    tc["chat_template"] = TEMPLATE
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=1)
    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128}, patch_size=16,
                                      merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5],
                                      image_std=[0.5, 0.5, 0.5])
    proc.save_pretrained(out)
    tok = T.AutoTokenizer.from_pretrained(out)
    model = T.Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    imgs = {"a": image(100, 61, 0), "b": image(50, 70, 1)}
    for k, im in imgs.items():
        im.save(os.path.join(out, f"image_{k}.png"))
    ref = {}
    for k, im in imgs.items():
        p = proc(images=[im], return_tensors="pt")
        ref[f"pixel_values_{k}"], ref[f"grid_{k}"] = p["pixel_values"].float(), p["image_grid_thw"]
        with torch.no_grad():
            ref[f"tower_{k}"] = model.model.get_image_features(p["pixel_values"], p["image_grid_thw"]).pooler_output[0].float()
    meta = dict(seed=50, steps=STEPS, weights_dtype="bfloat16", reference_dtype="float32", attn_implementation="eager",
                torch=torch.__version__, transformers=T.__version__, messages_1=MESSAGES_1, messages_2=MESSAGES_2)
    prompt_references(model, tok, ref, meta, 2, MESSAGES_1, MESSAGES_2)
    del ref["pixel_values_b"]
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))
    for f in os.listdir(out):
        os.chmod(os.path.join(out, f), 0o644)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps({k: v for k, v in meta.items() if k.startswith("greedy") or k.startswith("prefill")}))


if __name__ == "__main__":
    main()
