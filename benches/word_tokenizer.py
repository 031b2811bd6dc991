"""Write a word-level tokenizer covering a model's whole vocabulary into DIR (tokenizer.json,
tokenizer_config.json with a ChatML chat template), for serving benchmarks on random checkpoints:
every id decodes to a non-empty word (`w<id>`), so each generated token streams as text.

    python3 benches/word_tokenizer.py DIR [--vocab 151936] [--im-start 151644] [--im-end 151645] [--eot 151643]
Standard library only.
"""
import argparse
import json
import os

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--vocab", type=int, default=151936)
ap.add_argument("--eot", type=int, default=151643)
ap.add_argument("--im-start", type=int, default=151644)
ap.add_argument("--im-end", type=int, default=151645)
a = ap.parse_args()
special = {a.eot: "<|endoftext|>", a.im_start: "<|im_start|>", a.im_end: "<|im_end|>"}
vocab = {special.get(i, f"w{i}"): i for i in range(a.vocab)}
vocab["<unk>"] = vocab.pop("w0")
added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True} for i, t in sorted(special.items())]
tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
       "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
       "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>",
       "bos_token": None, "add_bos_token": False, "chat_template": template, "model_max_length": 40960,
       "added_tokens_decoder": {str(x["id"]): {k: v for k, v in x.items() if k != "id"} for x in added}}
for name, obj in [("tokenizer.json", tok), ("tokenizer_config.json", cfg)]:
    tmp = os.path.join(a.dir, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, os.path.join(a.dir, name))
print(f"word-level tokenizer of {a.vocab} ids in {a.dir}")
