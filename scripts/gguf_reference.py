#!/usr/bin/env python3
"""Reference data for mlx-convert's GGUF reader and converter, made with the `gguf` PyPI package.

    pip install gguf numpy
    python3 scripts/gguf_reference.py crates/convert/tests/fixtures

Writes, deterministically (fixed seed):

  quants/<TYPE>.bin    random blocks of every ggml type gguf-py can dequantize
  quants/<TYPE>.f32    gguf.quants.dequantize of those blocks, little-endian f32
  tiny-llama.gguf      a two-layer llama-architecture GGUF (F32, F16, BF16, Q8_0, Q4_0 tensors,
                       Q/K rows permuted as llama.cpp's converter does, a byte-level BPE vocabulary,
                       a chat template and metadata of every value type)
  tiny-llama.reference.safetensors
                       its tensors under Hugging Face names: gguf-py's dequantization with the
                       Q/K permutation undone by transformers' formula, f32
"""
import json
import os
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

SEED = 20261204

QUANT_TYPES = [
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0",
    "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4",
]


def write_quants(out, rng):
    qdir = os.path.join(out, "quants")
    os.makedirs(qdir, exist_ok=True)
    for name in QUANT_TYPES:
        qt = T[name]
        block, type_size = GGML_QUANT_SIZES[qt]
        n_blocks = max(4, 1024 // block)
        raw = rng.integers(0, 256, size=n_blocks * type_size, dtype=np.uint8)
        if name in ("F32", "F16"):
            deq = raw.view({"F32": "<f4", "F16": "<f2"}[name]).astype(np.float32)
        else:
            deq = gguf.quants.dequantize(raw.reshape(1, -1), qt)
        deq = np.asarray(deq, dtype="<f4").reshape(-1)
        assert deq.size == n_blocks * block, (name, deq.size)
        raw.tofile(os.path.join(qdir, f"{name}.bin"))
        deq.tofile(os.path.join(qdir, f"{name}.f32"))


def llama_cpp_permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def transformers_reverse_permute(w, n_head, n_head_kv):
    """transformers' modeling_gguf_pytorch_utils reverse_permute_weights."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        b = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def byte_level_vocab():
    """GPT-2's bytes_to_unicode, the alphabet of a byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_llama(out, rng):
    hidden, inter, layers, n_head, n_kv, vocab_extra = 32, 64, 2, 4, 2, 0
    head_dim = hidden // n_head
    alphabet = byte_level_vocab()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ c", "a p", "Ġc ap", "i t", "a l", "Ġ o", "Ġo f"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["".join(m.split(" ")) for m in merges]
    vocab = len(tokens) + vocab_extra
    token_types = [3, 3, 3] + [1] * (len(tokens) - 3)

    w = gguf.GGUFWriter(os.path.join(out, "tiny-llama.gguf"), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    # one key of every remaining value type, read back by the parser tests
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_int32("test.i32", -2000000000)
    w.add_int64("test.i64", -(2**40))
    w.add_uint64("test.u64", 2**50)
    w.add_float64("test.f64", 0.1)
    w.add_bool("test.bool", True)
    w.add_array("test.f32s", [0.5, -1.25, 3.0])

    hf = {}
    hf["model.embed_tokens.weight"] = rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.5
    hf["model.norm.weight"] = 1.0 + 0.1 * rng.standard_normal(hidden).astype(np.float32)
    hf["lm_head.weight"] = rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.2
    for i in range(layers):
        p = f"model.layers.{i}."
        hf[p + "self_attn.q_proj.weight"] = rng.standard_normal((n_head * head_dim, hidden)).astype(np.float32) * 0.2
        hf[p + "self_attn.k_proj.weight"] = rng.standard_normal((n_kv * head_dim, hidden)).astype(np.float32) * 0.2
        hf[p + "self_attn.v_proj.weight"] = rng.standard_normal((n_kv * head_dim, hidden)).astype(np.float32) * 0.2
        hf[p + "self_attn.o_proj.weight"] = rng.standard_normal((hidden, n_head * head_dim)).astype(np.float32) * 0.2
        hf[p + "mlp.gate_proj.weight"] = rng.standard_normal((inter, hidden)).astype(np.float32) * 0.2
        hf[p + "mlp.up_proj.weight"] = rng.standard_normal((inter, hidden)).astype(np.float32) * 0.2
        hf[p + "mlp.down_proj.weight"] = rng.standard_normal((hidden, inter)).astype(np.float32) * 0.2
        hf[p + "input_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(hidden).astype(np.float32)
        hf[p + "post_attention_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(hidden).astype(np.float32)

    # HF name -> (GGUF name, storage type); storage types are spread over the layers
    plan = {
        "model.embed_tokens.weight": ("token_embd.weight", T.Q8_0),
        "model.norm.weight": ("output_norm.weight", T.F32),
        "lm_head.weight": ("output.weight", T.F16),
    }
    kinds = [T.Q8_0, T.Q4_0, T.BF16, T.F16, T.Q4_1, T.Q5_0, T.Q5_1]
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(layers):
        for j, (h, g) in enumerate(names.items()):
            plan[f"model.layers.{i}.{h}.weight"] = (f"blk.{i}.{g}.weight", kinds[(i + j) % len(kinds)])
        plan[f"model.layers.{i}.input_layernorm.weight"] = (f"blk.{i}.attn_norm.weight", T.F32)
        plan[f"model.layers.{i}.post_attention_layernorm.weight"] = (f"blk.{i}.ffn_norm.weight", T.F32)

    reference = {}
    for hname, (gname, qt) in plan.items():
        t = hf[hname]
        if hname.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, n_head, n_head)
        elif hname.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, n_head, n_kv)
        if qt == T.F32:
            stored = t.astype(np.float32)
            w.add_tensor(gname, stored)
        elif qt == T.F16:
            stored = t.astype(np.float16)
            w.add_tensor(gname, stored)
        else:
            stored = gguf.quants.quantize(t, qt)
            w.add_tensor(gname, stored, raw_shape=stored.shape, raw_dtype=qt)
        deq = gguf.quants.dequantize(stored, qt) if qt not in (T.F32, T.F16) else stored.astype(np.float32)
        deq = np.asarray(deq, dtype=np.float32).reshape(t.shape)
        if hname.endswith("q_proj.weight"):
            deq = transformers_reverse_permute(deq, n_head, n_head)
        elif hname.endswith("k_proj.weight"):
            deq = transformers_reverse_permute(deq, n_head, n_kv)
        reference[hname] = deq

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    write_safetensors(os.path.join(out, "tiny-llama.reference.safetensors"), reference)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "crates/convert/tests/fixtures"
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(SEED)
    write_quants(out, rng)
    write_tiny_llama(out, rng)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
