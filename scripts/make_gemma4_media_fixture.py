#!/usr/bin/env python3
"""Tiny Gemma 4 conditional-generation checkpoint with a vision tower AND an audio encoder, and
the transformers references the Rust parity tests (crates/models/tests/gemma4_media.rs) read.

    python3 scripts/make_gemma4_media_fixture.py [OUT_DIR]
        (default crates/models/tests/fixtures/tiny/gemma4_media;
         needs torch, transformers 5.x, safetensors, numpy, pillow)

The public Gemma 4 fixture has no audio tower: this one adds a tiny random `audio_config`.
Every tensor is random (norm weights around 1, clip bounds of the clipped linears finite so
clipping happens, the vision standardisation buffers set), rounded to bf16, saved with
`save_pretrained` and reloaded in f32 (sdpa attention) for the references:

- processor outputs: a 100x60 noise image and a 7x30 one through `Gemma4ImageProcessorPil`
  (PIL bicubic resize, max_soft_tokens 70, patch 4, pooling 2): `image*_rgb` (the input
  pixels), `image*_pixel_values` (real patches only) and `image*_grid`; a 14860-sample clip
  (sine + noise, 16 kHz) through `Gemma4AudioFeatureExtractor`: `audio_samples` and
  `audio_features` (the frames its mask keeps);
- tower outputs: `vision_hidden` (`Gemma4VisionModel` last_hidden_state), `vision_embeds`
  (after `embed_vision`), `audio_hidden` (`Gemma4AudioModel` valid rows), `audio_embeds`;
- the merged prompt `input_ids` (text, `<boi> image*60 <eoi>`, text, `<boa> audio*23 <eoa>`,
  text; built as `Gemma4Processor` expands placeholders), its full `logits`, and
  `greedy_ids`: 16 greedy tokens, each by a full recompute with the media.

The seed is retried until every top-1/top-2 logit gap of the prefill's last position and of
the greedy steps is at least 0.02.

`reference_bidirectional.safetensors` (and `.json`) hold the same model's references with
`text_config.use_bidirectional_attention = "vision"` (the checkpoint's config with that one
field changed; the tests write that config next to the fixture's weights): transformers then
lets each image's soft tokens attend to each other both ways in the sliding layers
(`mm_token_type_ids` marks them; full-attention layers and every other token stay causal).
`input_ids`, `logits` and `greedy_ids` as above on the same prompt (generated tokens are text),
and `two_images_ids` (text, the 100x60 image, text, a 64x48 noise image `second_rgb`, text)
with the logits of its last `TAIL` positions (`two_images_logits_tail`). The JSON records how far the causal
logits lie from the bidirectional ones.
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
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TOKENIZER_FROM = os.path.join(REPO, "crates/models/tests/fixtures/tiny/gemma4")
STEPS = 16
TAIL = 4

# Media tokens on unused ids of the tiny vocabulary, renamed as Gemma 4 names them.
MEDIA_TOKENS = {
    "boi_token_id": (8, "<|image>"),
    "eoi_token_id": (9, "<image|>"),
    "image_token_id": (10, "<|image|>"),
    "boa_token_id": (11, "<|audio>"),
    "eoa_token_index": (12, "<audio|>"),
    "audio_token_id": (13, "<|audio|>"),
    "video_token_id": (14, "<|video|>"),
}

TEXT = dict(
    vocab_size=1024, vocab_size_per_layer_input=1024, hidden_size=64,
    hidden_size_per_layer_input=16, intermediate_size=64, num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_kv_shared_layers=2,
    use_double_wide_mlp=True, attention_k_eq_v=False, enable_moe_block=False, sliding_window=16,
    rope_parameters={
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh", pad_token_id=0, bos_token_id=2, eos_token_id=1, initializer_range=0.1,
)
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=32,
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "axial", "rope_theta": 100.0}, use_clipped_linears=True,
    standardize=True, hidden_activation="gelu_pytorch_tanh", initializer_range=0.1,
)
AUDIO = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, hidden_act="silu",
    subsampling_conv_channels=[128, 8], conv_kernel_size=5, residual_weight=0.5, attention_chunk_size=4,
    attention_context_left=5, attention_context_right=0, attention_logit_cap=50.0, use_clipped_linears=True,
    rms_norm_eps=1e-6, output_proj_dims=48, initializer_range=0.1,
)
IMAGE_PROC = dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
AUDIO_SAMPLES = 14860  # 92 valid mel frames, 93 after the extractor's padding: one padded soft token


def config():
    ids = {k: v[0] for k, v in MEDIA_TOKENS.items()}
    return T.Gemma4Config(text_config=TEXT, vision_config=VISION, audio_config=AUDIO, tie_word_embeddings=True, **ids)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if t.ndim <= 1 and "per_dim_scale" not in name and not name.endswith("bias"):
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))  # norm weights, layer scalars
            elif name.endswith("position_embedding_table"):
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.1 * torch.randn(t.shape, generator=g) * (3.0 if t.ndim <= 1 else 1.0))
        for name, b in model.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("input_min", "output_min"):
                b.fill_(-(1.0 + torch.rand((), generator=g).item()))
            elif leaf in ("input_max", "output_max"):
                b.fill_(1.0 + torch.rand((), generator=g).item())
            elif leaf == "std_bias":
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
            elif leaf == "std_scale":
                b.copy_(0.5 + 0.2 * torch.randn(b.shape, generator=g))
        model.model.language_model.norm.weight.add_(3.0)  # wider final logits: clear greedy margins


def write_tokenizer(out):
    tok = json.load(open(os.path.join(TOKENIZER_FROM, "tokenizer.json")))
    rename = {i: name for i, name in MEDIA_TOKENS.values()}
    for a in tok["added_tokens"]:
        if a["id"] in rename:
            a["content"], a["special"] = rename[a["id"]], True
    vocab = tok["model"]["vocab"]
    for k in [k for k, i in vocab.items() if i in rename]:
        del vocab[k]
    for i, name in rename.items():
        vocab[name] = i
    json.dump(tok, open(os.path.join(out, "tokenizer.json"), "w"), ensure_ascii=False)
    tc = json.load(open(os.path.join(TOKENIZER_FROM, "tokenizer_config.json")))
    for i, name in rename.items():
        if str(i) in tc.get("added_tokens_decoder", {}):
            tc["added_tokens_decoder"][str(i)]["content"] = name
            tc["added_tokens_decoder"][str(i)]["special"] = True
    tc.update(image_token="<|image|>", boi_token="<|image>", eoi_token="<image|>",
              audio_token="<|audio|>", boa_token="<|audio>", eoa_token="<audio|>", processor_class="Gemma4Processor")
    tc["chat_template"] = tc["chat_template"].replace(
        "{%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}",
        "{%- if item['type'] == 'image' -%}\n                {{ '<|image|>' }}\n"
        "            {%- elif item['type'] == 'audio' -%}\n                {{ '<|audio|>' }}")
    assert "<|audio|>" in tc["chat_template"], "chat template layout changed"
    json.dump(tc, open(os.path.join(out, "tokenizer_config.json"), "w"), ensure_ascii=False, indent=1)


def media_inputs():
    rs = np.random.RandomState(7)
    img = rs.randint(0, 256, size=(60, 100, 3), dtype=np.uint8)
    tall = rs.randint(0, 256, size=(30, 7, 3), dtype=np.uint8)
    t = np.arange(AUDIO_SAMPLES) / 16000.0
    wav = (0.5 * np.sin(2 * np.pi * 440.0 * t) + 0.1 * np.random.RandomState(1).randn(AUDIO_SAMPLES)).astype(np.float32)
    return img, tall, wav


def process_image(proc, rgb):
    out = proc(images=Image.fromarray(rgb), return_tensors="pt")
    pos = out["image_position_ids"][0]
    real = (pos >= 0).all(-1)
    grid = (int(pos[real, 1].max()) + 1, int(pos[real, 0].max()) + 1)
    return out, out["pixel_values"][0][real], grid


@torch.no_grad()
def build(out, seed):
    torch.manual_seed(seed)
    model = T.Gemma4ForConditionalGeneration(config()).eval()
    randomize(model, seed + 1)
    shutil.rmtree(out, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    # sdpa, transformers' default: its boolean masks are what Gemma4AudioModel's blocked attention
    # expects (eager builds additive float masks, which the audio tower's `logical_not` inverts).
    model, info = T.Gemma4ForConditionalGeneration.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa",
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    write_tokenizer(out)
    json.dump({"image_processor": dict(image_processor_type="Gemma4ImageProcessorPil", **IMAGE_PROC),
               "feature_extractor": dict(feature_extractor_type="Gemma4AudioFeatureExtractor", feature_size=128,
                                         sampling_rate=16000)},
              open(os.path.join(out, "processor_config.json"), "w"), indent=1)

    proc = Gemma4ImageProcessorPil(**IMAGE_PROC)
    fe = Gemma4AudioFeatureExtractor()
    img, tall, wav = media_inputs()
    img_in, img_pv, img_grid = process_image(proc, img)
    _, tall_pv, tall_grid = process_image(proc, tall)
    aud_in = fe([wav], return_tensors="pt")  # a batch of one (a bare 1-d array is mis-shaped by 5.17)
    feats = aud_in["input_features"].float()
    fmask = aud_in["input_features_mask"].bool()

    m = model.model
    vision_hidden = m.vision_tower(pixel_values=img_in["pixel_values"], pixel_position_ids=img_in["image_position_ids"]).last_hidden_state
    vision_embeds = m.get_image_features(img_in["pixel_values"], img_in["image_position_ids"]).pooler_output[0]
    a = m.audio_tower(feats, fmask)
    audio_hidden = a.last_hidden_state[a.attention_mask]
    audio_embeds = m.get_audio_features(feats, fmask).pooler_output[a.attention_mask]
    n_img, n_aud = vision_embeds.shape[0], audio_embeds.shape[0]

    tid = {k: v[0] for k, v in MEDIA_TOKENS.items()}
    rs = np.random.RandomState(1234)
    text = lambda n: rs.randint(240, 1000, size=n).tolist()
    ids = ([2] + text(6) + [tid["boi_token_id"]] + [tid["image_token_id"]] * n_img + [tid["eoi_token_id"]] + text(4)
           + [tid["boa_token_id"]] + [tid["audio_token_id"]] * n_aud + [tid["eoa_token_index"]] + text(5))
    media = dict(pixel_values=img_in["pixel_values"], image_position_ids=img_in["image_position_ids"],
                 input_features=feats, input_features_mask=fmask)
    seq = torch.tensor([ids])
    logits = model(input_ids=seq, use_cache=False, **media).logits.float()
    step_logits = []
    for _ in range(STEPS):
        last = model(input_ids=seq, use_cache=False, **media).logits[0, -1].float()
        step_logits.append(last)
        seq = torch.cat([seq, last.argmax().view(1, 1)], dim=1)
    margins = [float(v[0] - v[1]) for v in (torch.topk(l, 2).values for l in step_logits)]

    ref = dict(
        image_rgb=torch.from_numpy(img), image_pixel_values=img_pv.float(), image_grid=torch.tensor(img_grid, dtype=torch.int32),
        tall_rgb=torch.from_numpy(tall), tall_pixel_values=tall_pv.float(), tall_grid=torch.tensor(tall_grid, dtype=torch.int32),
        audio_samples=torch.from_numpy(wav), audio_features=feats[0][fmask[0]],
        vision_hidden=vision_hidden.float(), vision_embeds=vision_embeds.float(),
        audio_hidden=audio_hidden.float(), audio_embeds=audio_embeds.float(),
        input_ids=torch.tensor([ids], dtype=torch.int32), logits=logits, greedy_ids=seq.to(torch.int32),
    )
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))
    meta = dict(
        seed=seed, model_class="Gemma4ForConditionalGeneration", weights_dtype="bfloat16", reference_dtype="float32",
        attn_implementation="sdpa", torch=torch.__version__, transformers=T.__version__,
        image_processor="Gemma4ImageProcessorPil", image_soft_tokens=n_img, image_grid=img_grid, tall_grid=tall_grid,
        audio_samples=AUDIO_SAMPLES, audio_frames_valid=int(fmask.sum()), audio_frames_padded=int(fmask.shape[1]),
        audio_soft_tokens=n_aud, audio_soft_tokens_padded=int(a.attention_mask.shape[1]),
        prompt_len=len(ids), greedy_new_ids=seq[0, len(ids):].tolist(), decode_top1_top2_margin_min=min(margins),
        media_tokens={k: v[0] for k, v in MEDIA_TOKENS.items()},
    )
    json.dump(meta, open(os.path.join(out, "reference.json"), "w"), indent=1)
    bidirectional_references(out, model, ids, media, logits, tid, n_img, proc)
    return meta


def mm_token_type_ids(seq, image_token):
    """What `Gemma4Processor` returns: 1 at image soft tokens, 0 elsewhere (no video here;
    audio tokens, 3, take no part in the bidirectional mask)."""
    return (seq == image_token).long()


@torch.no_grad()
def bidirectional_references(out, model, ids, media, causal_logits, tid, n_img, proc):
    model.config.text_config.use_bidirectional_attention = "vision"
    img_tok = tid["image_token_id"]
    seq = torch.tensor([ids])
    logits = model(input_ids=seq, mm_token_type_ids=mm_token_type_ids(seq, img_tok), use_cache=False, **media).logits.float()
    margins = []
    for _ in range(STEPS):
        last = model(input_ids=seq, mm_token_type_ids=mm_token_type_ids(seq, img_tok), use_cache=False, **media).logits[0, -1].float()
        top = torch.topk(last, 2).values
        margins.append(float(top[0] - top[1]))
        seq = torch.cat([seq, last.argmax().view(1, 1)], dim=1)

    second = np.random.RandomState(5).randint(0, 256, size=(48, 64, 3), dtype=np.uint8)
    second_in, _, _ = process_image(proc, second)
    n_second = int((second_in["image_position_ids"][0] >= 0).all(-1).sum()) // 4  # pooling 2x2
    rs = np.random.RandomState(99)
    text = lambda n: rs.randint(240, 1000, size=n).tolist()
    two = ([2] + text(3) + [tid["boi_token_id"]] + [img_tok] * n_img + [tid["eoi_token_id"]] + text(2)
           + [tid["boi_token_id"]] + [img_tok] * n_second + [tid["eoi_token_id"]] + text(3))
    img_in = dict(pixel_values=media["pixel_values"], image_position_ids=media["image_position_ids"])
    pv = torch.cat([img_in["pixel_values"], second_in["pixel_values"]])
    pos = torch.cat([img_in["image_position_ids"], second_in["image_position_ids"]])
    two_seq = torch.tensor([two])
    two_logits = model(input_ids=two_seq, mm_token_type_ids=mm_token_type_ids(two_seq, img_tok), use_cache=False,
                       pixel_values=pv, image_position_ids=pos).logits[0, -TAIL:].float()
    two_causal = model(input_ids=two_seq, use_cache=False, pixel_values=pv, image_position_ids=pos).logits[0, -TAIL:].float()
    model.config.text_config.use_bidirectional_attention = None

    rel = lambda a, b: float((a - b).norm() / b.norm())
    ref = dict(input_ids=torch.tensor([ids], dtype=torch.int32), logits=logits, greedy_ids=seq.to(torch.int32),
               second_rgb=torch.from_numpy(second), two_images_ids=torch.tensor([two], dtype=torch.int32),
               two_images_logits_tail=two_logits)
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference_bidirectional.safetensors"))
    meta = dict(
        use_bidirectional_attention="vision", prompt_len=len(ids), greedy_new_ids=seq[0, len(ids):].tolist(),
        decode_top1_top2_margin_min=min(margins), causal_vs_bidirectional_logits_rel=rel(causal_logits, logits),
        two_images_len=len(two), two_images_soft_tokens=[n_img, n_second], tail=TAIL,
        two_images_causal_vs_bidirectional_tail_rel=rel(two_causal, two_logits),
    )
    json.dump(meta, open(os.path.join(out, "reference_bidirectional.json"), "w"), indent=1)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "crates/models/tests/fixtures/tiny/gemma4_media")
    for seed in range(20):
        meta = build(out, seed)
        if meta["decode_top1_top2_margin_min"] >= 0.02:
            break
    sizes = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
    print(json.dumps(dict(meta, files=sizes), indent=1))


if __name__ == "__main__":
    main()
