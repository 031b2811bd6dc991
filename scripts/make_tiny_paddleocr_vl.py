#!/usr/bin/env python3
"""A tiny random PaddleOCR-VL checkpoint (vision encoder, projector and ERNIE-4.5 language model,
hub-style config and tensor names) and its transformers references, for
tests/parity_paddleocr_vl.rs.

    python3 scripts/make_tiny_paddleocr_vl.py [OUT_DIR]   (needs torch, transformers, safetensors, pillow)

OUT_DIR defaults to crates/models/tests/fixtures/tiny/paddleocr_vl. Shapes: a 2-layer ERNIE-4.5
decoder of 64 (4 heads of 16 over 2 KV heads, M-RoPE sections [2, 3, 3], head tied to the embedding), a 2-layer
vision encoder of 32 (2 heads, 8-pixel patches, an 8x8 position table) merged 2x2 by the
projector. The tokenizer is the `qwen3_5_vl` fixture's (the real Qwen3 tokenizer shrunk to 512
ids); the chat template has the shape of PaddleOCR-VL's (`User: ` with the image markers before the
text, `Assistant: `, a begin and an end-of-turn token) written with that tokenizer's special tokens
(`<|vision_start|><|image_pad|><|vision_end|>` for each image).

Layout: config.json is flat as the hub's is (the decoder's keys at the top level, `vision_config`
nested, `rope_scaling` with `mrope_section`); tensors use the hub's names (`model.*` for the
decoder, `visual.vision_model.*`, `mlp_AR.*` for the projector, `lm_head`), which transformers maps
to its own on load. The images are drawn from a fixed formula (no randomness): A is 100x61 pixels
(smart resize to 96x64), B 12x70 (narrower than the 16-pixel factor: widened to 16 first, then 96
rows).

Weights: random (HF init, 1-D tensors perturbed as make_tiny_dense.py does), rounded to bf16; the
references come from the model reloaded in f32 with eager attention. `reference.safetensors`:
- `pixel_values_a` / `grid_a`, `grid_b`, `pixel_values_b`: `PaddleOCRVLImageProcessorPil` output;
- `vision_a`: the encoder's output (after post_layernorm, before the projector) for image A;
- `tower_a`, `tower_b`: `get_image_features` (projector output) of each image;
- `ids_1`: the expanded ids of [user: image A + text] with the generation prompt (the chat template
  rendered by the tokenizer, each `<|image_pad|>` repeated grid_h * grid_w / 4 times, as the
  processor does), `logits_1` its full-prompt logits, `greedy_1` the prompt and 8 greedy tokens;
- `ids_2`, `logits_2`, `greedy_2`: the same for [user: image A + text, assistant: text, user:
  image B + text], `logits_2` for its last TAIL_2 positions only.
"""
import json
import os
import shutil
import sys

import torch
import transformers as T
from safetensors.torch import load_file, save_file
from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import PaddleOCRVLImageProcessorPil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_dense import perturb  # noqa: E402
from make_tiny_qwen35_vl import IMAGE, image, image_turns, prompt_references  # noqa: E402  (same image token, images, conversations, prompt loop)

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "crates", "models", "tests", "fixtures", "tiny")
STEPS = 8
START, END, VIDEO = 495, 496, 499
BOS, EOS = 487, 488

TEMPLATE = (
    "{{- '<|im_start|>' -}}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}{{- message.content + '\\n' -}}"
    "{%- elif message.role == 'user' -%}{{- 'User: ' -}}"
    "{%- if message.content is string -%}{{- message.content -}}"
    "{%- else -%}"
    "{%- for part in message.content -%}{%- if part.type == 'image' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}{%- endif -%}{%- endfor -%}"
    "{%- for part in message.content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{{- '\\n' -}}"
    "{%- elif message.role == 'assistant' -%}{{- 'Assistant: ' -}}"
    "{%- if message.content is string -%}{{- message.content -}}"
    "{%- else -%}{%- for part in message.content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{{- '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
)

MESSAGES_1, MESSAGES_2 = image_turns("OCR:")

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
            use_bias=False, pad_token_id=0, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.1)
ROPE = {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [2, 3, 3]}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_channels=3,
              image_size=64, patch_size=8, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, spatial_merge_size=2,
              rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
PROCESSOR = dict(min_pixels=32 * 32, max_pixels=80 * 80, patch_size=8, merge_size=2, temporal_patch_size=1,
                 image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])




def config():
    return T.PaddleOCRVLConfig(text_config={**TEXT, "rope_parameters": ROPE}, vision_config=VISION,
                               image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                               vision_end_token_id=END, tie_word_embeddings=True)


def hub_config():
    """config.json as the hub's PaddleOCR-VL ships it: the decoder's keys flat at the top level."""
    vision = {"model_type": "paddleocr_vl_vision", **VISION}
    del vision["rope_parameters"]
    return {"architectures": ["PaddleOCRVLForConditionalGeneration"], "model_type": "paddleocr_vl", **TEXT,
            "rope_theta": ROPE["rope_theta"], "rope_scaling": {"type": "default", "mrope_section": ROPE["mrope_section"]},
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "image_token_id": IMAGE, "video_token_id": VIDEO,
            "vision_start_token_id": START, "vision_end_token_id": END, "vision_config": vision}


def hub_name(k):
    """transformers' tensor name to the hub checkpoint's (the inverse of its key mapping)."""
    for ours, hub in (("model.projector.", "mlp_AR."), ("model.visual.", "visual."), ("model.language_model.", "model.")):
        if k.startswith(ours):
            return hub + k[len(ours):]
    return k






def write_checkpoint(model, out):
    """Save with transformers, then rewrite config.json and the tensor names in the hub's layout."""
    model.save_pretrained(out, safe_serialization=True)
    path = os.path.join(out, "model.safetensors")
    tensors = {hub_name(k): v for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hub_config(), f, indent=1)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(FIXTURES, "paddleocr_vl")
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(70)
    model = T.PaddleOCRVLForConditionalGeneration(config()).eval()
    perturb(model, 71)
    model = model.to(torch.bfloat16)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    write_checkpoint(model, out)
    src = os.path.join(FIXTURES, "qwen3_5_vl")
    shutil.copy(os.path.join(src, "tokenizer.json"), out)
    tc = json.load(open(os.path.join(src, "tokenizer_config.json")))
    tc["chat_template"] = TEMPLATE
    tc["bos_token"], tc["eos_token"] = "<|im_start|>", "<|im_end|>"
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=1)
    proc = PaddleOCRVLImageProcessorPil(**PROCESSOR)
    proc.save_pretrained(out)
    tok = T.AutoTokenizer.from_pretrained(out)
    model = T.PaddleOCRVLForConditionalGeneration.from_pretrained(out, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    # The hub names map back onto every tensor of the model.
    got = model.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v.float()), f"{k} did not load from the hub layout"
    imgs = {"a": image(100, 61, 0), "b": image(12, 70, 1)}
    for k, im in imgs.items():
        im.save(os.path.join(out, f"image_{k}.png"))
    ref = {}
    for k, im in imgs.items():
        p = proc(images=[im], return_tensors="pt")
        ref[f"pixel_values_{k}"], ref[f"grid_{k}"] = p["pixel_values"].float(), p["image_grid_thw"]
        with torch.no_grad():
            feats = model.model.get_image_features(p["pixel_values"], p["image_grid_thw"])
            ref[f"tower_{k}"] = feats.pooler_output[0].float()
            if k == "a":
                ref["vision_a"] = feats.last_hidden_state.reshape(-1, VISION["hidden_size"]).float()
    meta = dict(seed=70, steps=STEPS, weights_dtype="bfloat16", reference_dtype="float32", attn_implementation="eager",
                torch=torch.__version__, transformers=T.__version__, messages_1=MESSAGES_1, messages_2=MESSAGES_2,
                grids={k: ref[f"grid_{k}"].tolist() for k in imgs})
    prompt_references(model, tok, ref, meta, VISION["spatial_merge_size"], MESSAGES_1, MESSAGES_2)
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))
    for f in os.listdir(out):
        os.chmod(os.path.join(out, f), 0o644)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps({k: v for k, v in meta.items() if k.startswith(("greedy", "prefill", "grids"))}))


if __name__ == "__main__":
    main()
