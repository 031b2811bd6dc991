#!/usr/bin/env python3
"""A tiny random InternVL checkpoint (towers included, hub-style config) in two layouts, and its
transformers references, for tests/parity_internvl.rs.

    python3 scripts/make_tiny_internvl.py [OUT_ROOT]   (needs torch, transformers, safetensors, pillow)

OUT_ROOT defaults to crates/models/tests/fixtures/tiny. Two directories are written:
- `internvl`: transformers' native layout (`InternVLForConditionalGeneration`, model_type
  `internvl`, saved by `save_pretrained` with keys `vision_tower.*`, `multi_modal_projector.*`,
  `language_model.model.*`) with a `GotOcr2ImageProcessor` preprocessor_config.json;
- `internvl_chat`: the same bf16 weights re-keyed to the layout InternVL-Chat and Qianfan-OCR
  checkpoints ship (model_type `internvl_chat`, keys `vision_model.*` with a fused `attn.qkv`,
  `mlp1.{0,1,3}`, `language_model.model.*`; the inverse of transformers'
  `convert_internvl_weights_to_hf.py` mapping), with `vision_config`/`llm_config` and the
  tiling settings (`force_image_size`, `min/max_dynamic_patch`, `use_thumbnail`) in config.json
  and no preprocessor_config.json;
- `internvl/config.qianfan_ocr.json`: the config transformers' `QianfanOCRForConditionalGeneration`
  (model_type `qianfan_ocr`) saves for the same model; that class reads the `internvl_chat`
  weights (the hub Qianfan-OCR layout) through its key conversion, and the script checks it gives
  the native model's prompt-1 logits (max abs diff recorded in reference.json).

Shapes: InternViT of 2 layers of 32 (2 heads, 8-pixel patches of 32x32 tiles, so 16 patches and
a class token), pixel shuffle 0.5 (4 tokens a tile), the MLP projector, and a Qwen3 language model
of 2 layers of 64 (tied embeddings, as Qianfan-OCR's Qwen3-4B). The tokenizer is the qwen3
fixture's (the real Qwen3 tokenizer shrunk to 512 ids) with ids 495/496/498 renamed `<img>`,
`</img>` and `<IMG_CONTEXT>`, and a chat template that writes `<IMG_CONTEXT>\\n` for each image
part (the placeholder the processor expands into `<img>` + `<IMG_CONTEXT>` x 4 per tile +
`</img>`). Two images are drawn from a fixed formula: A is 100x45 pixels (2x1 tiles plus the
thumbnail) and B 40x70 (1x2 tiles plus the thumbnail); tiling allows 1 to 6 tiles.

Weights: random (HF init, 1-D tensors perturbed as make_tiny_dense.py does, the class token,
position table and layer scales set to random values since HF initializes them to constants),
rounded to bf16; the references come from the native model reloaded in f32 with eager attention.
`internvl/reference.safetensors` holds:
- `pixel_values_a`, `pixel_values_b`: `GotOcr2ImageProcessorPil` output (`[tiles, 3, 32, 32]`);
- `tower_a`, `tower_b`: `get_image_features` (the projector output, `[tiles * 4, 64]`);
- `ids_1`: the expanded ids of [user: image A + text] with the generation prompt, `logits_1` its
  full-prompt logits, `greedy_1` the prompt and 8 greedy tokens;
- `ids_2`, `logits_2` (last TAIL_2 positions), `greedy_2`: the same for [user: image A + text,
  assistant: text, user: image B + text].
"""
import json
import os
import shutil
import sys

import torch
import transformers as T
from safetensors.torch import load_file, save_file
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_dense import margins, perturb  # noqa: E402
from make_tiny_qwen35_vl import image, image_turns  # noqa: E402  (the same deterministic pictures and conversations)

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "crates", "models", "tests", "fixtures", "tiny")
SEED = int(os.environ.get("SEED", "70"))
STEPS = 8
TAIL_2 = 16
IMG_START, IMG_END, IMG_CONTEXT = 495, 496, 498
TILE, PATCH, SEQ = 32, 8, 4
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<IMG_CONTEXT>\\n' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MESSAGES_1, MESSAGES_2 = image_turns("Read the text in the image.")

VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=TILE,
              patch_size=PATCH, attention_bias=True, use_qk_norm=False, norm_type="layer_norm", layer_norm_eps=1e-6,
              hidden_act="gelu", use_mean_pooling=True, layer_scale_init_value=0.1, num_channels=3)
TEXT = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
            rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=512, tie_word_embeddings=True,
            bos_token_id=486, eos_token_id=488, pad_token_id=486, hidden_act="silu", initializer_range=0.1)




def config():
    return T.InternVLConfig(vision_config=dict(VISION), text_config=dict(TEXT), image_token_id=IMG_CONTEXT,
                            image_seq_length=SEQ, downsample_ratio=0.5, projector_hidden_act="gelu",
                            vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=True,
                            initializer_range=0.1)


def randomize_constants(model, seed):
    """HF initializes the class token and the position table to zeros and the layer scales to
    0.1: give them random values so the parity test sees them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("cls_token") or name.endswith("position_embeddings"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif ".lambda_" in name:
                t.copy_(1.0 + torch.randn(t.shape, generator=g) * 0.2)


def tokenizer_files(out):
    src = os.path.join(FIXTURES, "qwen3")
    tok = json.load(open(os.path.join(src, "tokenizer.json")))
    names = {IMG_START: "<img>", IMG_END: "</img>", IMG_CONTEXT: "<IMG_CONTEXT>"}
    for a in tok["added_tokens"]:
        if a["id"] in names:
            a["content"] = names[a["id"]]
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    tc = json.load(open(os.path.join(src, "tokenizer_config.json")))
    tc["chat_template"] = TEMPLATE
    for k, v in list(tc.get("added_tokens_decoder", {}).items()):
        if int(k) in names:
            v["content"] = names[int(k)]
    tc["extra_special_tokens"] = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=1, ensure_ascii=False)


def chat_layout(native_dir, out, vision=None, text=None, tile=None):
    """The native checkpoint re-keyed to the internvl_chat layout (config and weights); `vision`,
    `text` and `tile` describe it (default: this fixture's VISION, TEXT and TILE)."""
    vision, text, tile = vision or VISION, text or TEXT, tile or TILE
    os.makedirs(out, exist_ok=True)
    sd = load_file(os.path.join(native_dir, "model.safetensors"))
    new = {}
    d = vision["hidden_size"]
    # transformers saves InternVL in the hub layout (`vision_tower.*`, `multi_modal_projector.*`,
    # `language_model.model.*`); its in-memory names carry a `model.` prefix instead.
    sd = {(k[len("model."):] if k.startswith(("model.vision_tower.", "model.multi_modal_projector.")) else k): v for k, v in sd.items()}
    for k, v in sd.items():
        if k.startswith("model.language_model."):
            new["language_model.model." + k[len("model.language_model."):]] = v
        elif k.startswith("language_model.model.") or k == "language_model.lm_head.weight":
            new[k] = v
        elif k == "lm_head.weight":
            new["language_model.lm_head.weight"] = v
        elif k.startswith("multi_modal_projector."):
            rest = k[len("multi_modal_projector."):]
            for a, b in (("layer_norm", "0"), ("linear_1", "1"), ("linear_2", "3")):
                rest = rest.replace(a, b) if rest.startswith(a) else rest
            new["mlp1." + rest] = v
        elif k.startswith("vision_tower."):
            rest = k[len("vision_tower."):]
            if ".attention.k_proj." in rest or ".attention.v_proj." in rest:
                continue
            rest = (rest.replace("embeddings.cls_token", "embeddings.class_embedding")
                    .replace("embeddings.position_embeddings", "embeddings.position_embedding")
                    .replace("embeddings.patch_embeddings.projection", "embeddings.patch_embedding")
                    .replace("encoder.layer.", "encoder.layers.")
                    .replace("lambda_", "ls")
                    .replace("attention.projection_layer", "attn.proj")
                    .replace("layernorm_before", "norm1")
                    .replace("layernorm_after", "norm2"))
            if ".attention.q_proj." in rest:
                kk = k.replace("q_proj", "k_proj")
                vv = k.replace("q_proj", "v_proj")
                v = torch.cat([v, sd[kk], sd[vv]], 0)
                assert v.shape[0] == 3 * d
                rest = rest.replace("attention.q_proj", "attn.qkv")
            new["vision_model." + rest] = v
        else:
            raise SystemExit(f"unexpected key {k}")
    save_file({k: v.contiguous() for k, v in new.items()}, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    vision = {k: v for k, v in vision.items() if k not in ("attention_bias", "use_qk_norm", "use_mean_pooling", "layer_scale_init_value")}
    vision.update(model_type="intern_vit_6b", architectures=["InternVisionModel"], qkv_bias=True, qk_normalization=False,
                  use_flash_attn=False, drop_path_rate=0.0, initializer_factor=1.0)
    cfg = {
        "architectures": ["InternVLChatModel"], "model_type": "internvl_chat", "vision_config": vision, "llm_config": dict(text),
        "select_layer": -1, "ps_version": "v2", "downsample_ratio": 0.5, "template": "internvl2_5", "dynamic_image_size": True,
        "use_thumbnail": True, "max_dynamic_patch": 6, "min_dynamic_patch": 1, "force_image_size": tile,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    shutil.copy(os.path.join(native_dir, "generation_config.json"), out)
    for f in ("tokenizer.json", "tokenizer_config.json", "image_a.png", "image_b.png"):
        shutil.copy(os.path.join(native_dir, f), out)


@torch.no_grad()
def qianfan_ocr_config(native_dir, chat_dir, ref):
    """transformers' `QianfanOCRForConditionalGeneration` (model_type `qianfan_ocr`) reads the
    InternVL-Chat weights (the hub Qianfan-OCR layout, through its key conversion): its config as
    transformers saves it goes to `internvl/config.qianfan_ocr.json`, after checking that the model
    gives the native model's logits of prompt 1."""
    import tempfile
    cfg = T.QianfanOCRConfig(vision_config=dict(VISION), text_config=dict(TEXT), image_token_id=IMG_CONTEXT, image_seq_length=SEQ,
                             downsample_ratio=0.5, projector_hidden_act="gelu", vision_feature_layer=-1,
                             vision_feature_select_strategy="default", tie_word_embeddings=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        shutil.copy(os.path.join(chat_dir, "model.safetensors"), tmp)
        model, info = T.QianfanOCRForConditionalGeneration.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager",
                                                                            output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        shutil.copy(os.path.join(tmp, "config.json"), os.path.join(native_dir, "config.qianfan_ocr.json"))
    logits = model.eval()(input_ids=ref["ids_1"], pixel_values=ref["pixel_values_a"]).logits[0].float()
    diff = (logits - ref["logits_1"]).abs().max().item()
    assert diff < 1e-5, diff
    return diff


def expand(ids, tiles):
    out, k = [], 0
    for t in ids:
        if t == IMG_CONTEXT:
            out.extend([IMG_START] + [IMG_CONTEXT] * (SEQ * tiles[k]) + [IMG_END])
            k += 1
        else:
            out.append(t)
    assert k == len(tiles)
    return torch.tensor([out], dtype=torch.long)


@torch.no_grad()
def run(model, ids, pixel_values):
    """Full-prompt logits, and the prompt with STEPS greedy tokens decoded through the cache."""
    logits = model(input_ids=ids, pixel_values=pixel_values, use_cache=False).logits[0].float()
    out = model(input_ids=ids, pixel_values=pixel_values, use_cache=True)
    seq = ids
    for _ in range(STEPS):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return logits, seq


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else FIXTURES
    out = os.path.join(root, "internvl")
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(SEED)
    model = T.InternVLForConditionalGeneration(config()).eval()
    perturb(model, SEED + 1)
    randomize_constants(model, SEED + 2)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer_files(out)
    proc = GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1, max_patches=6,
                                    image_mean=MEAN, image_std=STD)
    proc.save_pretrained(out)
    tok = T.AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids(["<img>", "</img>", "<IMG_CONTEXT>"]) == [IMG_START, IMG_END, IMG_CONTEXT]
    model = T.InternVLForConditionalGeneration.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    imgs = {"a": image(100, 45, 0), "b": image(40, 70, 1)}
    for k, im in imgs.items():
        im.save(os.path.join(out, f"image_{k}.png"))
    ref, tiles = {}, {}
    for k, im in imgs.items():
        p = proc(images=[im], return_tensors="pt")
        ref[f"pixel_values_{k}"] = p["pixel_values"].float()
        tiles[k] = int(p["num_patches"][0])
        with torch.no_grad():
            ref[f"tower_{k}"] = model.model.get_image_features(p["pixel_values"]).pooler_output.reshape(-1, TEXT["hidden_size"]).float()
    meta = dict(seed=SEED, steps=STEPS, weights_dtype="bfloat16", reference_dtype="float32", attn_implementation="eager",
                torch=torch.__version__, transformers=T.__version__, messages_1=MESSAGES_1, messages_2=MESSAGES_2, tiles=tiles)
    for n, (msgs, keys) in {"1": (MESSAGES_1, "a"), "2": (MESSAGES_2, "ab")}.items():
        raw = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        raw = raw["input_ids"] if isinstance(raw, dict) else raw
        ids = expand(list(raw), [tiles[k] for k in keys])
        pixels = torch.cat([ref[f"pixel_values_{k}"] for k in keys])
        logits, seq = run(model, ids, pixels)
        ref[f"ids_{n}"], ref[f"logits_{n}"], ref[f"greedy_{n}"] = ids, logits if n == "1" else logits[-TAIL_2:], seq
        meta[f"text_{n}"] = tok.decode(raw)
        meta[f"greedy_new_{n}"] = seq[0, ids.shape[1]:].tolist()
        meta[f"prefill_top1_top2_margin_min_{n}"] = min(margins(logits))
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
    chat = os.path.join(root, "internvl_chat")
    shutil.rmtree(chat, ignore_errors=True)
    chat_layout(out, chat)
    meta["qianfan_ocr_logits_1_max_abs_diff"] = qianfan_ocr_config(out, chat, ref)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for d in (out, chat):
        for f in os.listdir(d):
            os.chmod(os.path.join(d, f), 0o644)
    print(json.dumps({k: v for k, v in meta.items() if k.startswith("greedy") or k.startswith("prefill") or k == "tiles"}))


if __name__ == "__main__":
    main()
