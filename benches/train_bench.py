#!/usr/bin/env python3
"""Training tokens/s and peak memory: mlx-models' SftTrainer against mlx-lm's trainer
(mlx_lm.tuner.trainer.train, what `mlx_lm.lora` runs) on the same model, batch and sequence
length, full fine-tune and LoRA, each configuration in its own process, printing ours/mlx-lm.

Both sides: batches of --batch-size random sequences of --seq-len tokens (loss on every
position), AdamW (lr 1e-5, weight decay 0.01), no gradient clipping, --warmup updates then
--steps measured; LoRA rank 8, scale 20, the last 16 layers, every linear projection (mlx-lm's
defaults). The model is first written in --dtype (f32 on the CPU, bf16 on a GPU) so both load the
same weights; --random CONFIG.json writes weights drawn by mlx-lm's own initialisation for that
config instead of reading --model (the GPU machine has no model files).
Peak memory: MLX's peak since the process started, as mlx-lm's trainer reports it. Each side
also reports tokens per CPU second (the measured steps' tokens over the CPU time, all threads,
they used), which a loaded machine disturbs less than the wall-clock rate ("CPU-s ratio").

  python3 benches/train_bench.py --model ~/.cache/mlx-models/SmolLM2-135M-Instruct \
      [--batch-size 4] [--seq-len 128] [--steps 10] [--warmup 3] [--bin PATH] [--dtype f32|bf16]
  python3 benches/train_bench.py --random config.json --dtype bf16 ...   (benches/gpu_train_bench.sh)
(python with mlx-lm 0.32.2, e.g. /work/venvs/mlxlm/bin/python; --bin: the train_bench example,
default target/release/examples/train_bench, built with
`cargo build --release -p mlx-training --example train_bench`; --lib-dir: the libmlx.so it runs
with, default mlx-sys's CPU build in ~/.cache/mlx-sys)
"""
import argparse
import json
import os
import subprocess
import sys
import shutil
import tempfile


def mlx_lm_run(a):
    import mlx.core as mx
    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm.tuner.trainer import TrainingArgs, TrainingCallback, train
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    from pathlib import Path
    model, _ = load_model(Path(a.model_f32))
    if a.mode == "lora":
        model.freeze()
        linear_to_lora_layers(model, 16, {"rank": 8, "scale": 20.0, "dropout": 0.0})
    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    n = a.batch_size * (a.steps + a.warmup)
    data = [(rng.integers(0, vocab, a.seq_len).tolist(), 0) for _ in range(n)]

    import time

    class Cb(TrainingCallback):
        reports = []

        def on_train_loss_report(self, info):
            self.reports.append(dict(info, cpu_seconds=time.process_time()))

    cb = Cb()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArgs(batch_size=a.batch_size, iters=a.warmup + a.steps, val_batches=0, steps_per_report=a.warmup,
                            steps_per_eval=10**9, steps_per_save=10**9, max_seq_length=a.seq_len,
                            adapter_file=os.path.join(tmp, "a.safetensors"))
        opt = optim.AdamW(learning_rate=1e-5, weight_decay=0.01)
        # the trainer saves the trained weights when it ends (all of them for a full fine-tune):
        # not part of the measurement, and skipped
        import mlx_lm.tuner.trainer as trainer_module
        trainer_module.mx = type("NoSave", (), {"__getattr__": lambda _, k: getattr(mx, k), "save_safetensors": staticmethod(lambda *a, **k: None)})()
        train(model, opt, data, val_dataset=None, args=args, training_callback=cb)
    trainable = sum(v.size for _, v in __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.trainable_parameters()))
    # the reports after the warm-up window cover the measured steps
    after = [r for r in cb.reports if r["iteration"] > a.warmup]
    tok = sum(r["tokens_per_second"] * 1 for r in after) / len(after)
    start = [r for r in cb.reports if r["iteration"] == a.warmup]
    cpu_tok = (after[-1]["trained_tokens"] - start[0]["trained_tokens"]) / (after[-1]["cpu_seconds"] - start[0]["cpu_seconds"]) if start else float("nan")
    print(json.dumps({"impl": "mlx-lm", "mode": a.mode, "trainable_params": int(trainable), "tokens_per_second": tok, "tokens_per_cpu_second": cpu_tok,
                      "peak_memory_gb": mx.get_peak_memory() / 1e9, "last_loss": after[-1]["train_loss"]}))


DTYPES = {"f32": ("float32", "float32"), "bf16": ("bfloat16", "bfloat16")}


def write_model(src, dst, dtype, random_config=None):
    import mlx.core as mx
    import shutil
    os.makedirs(dst, exist_ok=True)
    dt = getattr(mx, DTYPES[dtype][0])
    if random_config:
        from mlx.utils import tree_flatten
        from mlx_lm.utils import _get_classes
        cfg = json.load(open(random_config))
        model_class, args_class = _get_classes(cfg)
        model = model_class(args_class.from_dict(cfg))
        w = dict(tree_flatten(model.parameters()))
        shutil.copy(random_config, os.path.join(dst, "config.json"))
    else:
        w = mx.load(os.path.join(src, "model.safetensors"))
        for f in os.listdir(src):
            if f != "model.safetensors" and not os.path.isdir(os.path.join(src, f)):
                shutil.copy(os.path.join(src, f), dst)
    mx.save_safetensors(os.path.join(dst, "model.safetensors"), {k: v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in w.items()}, metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(dst, "config.json")))
    for k in ("torch_dtype", "dtype"):
        if k in cfg:
            cfg[k] = DTYPES[dtype][1]
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--random", help="config.json: random weights (mlx-lm's init) instead of --model")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bin", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "target/release/examples/train_bench"))
    p.add_argument("--lib-dir", default=os.path.expanduser("~/.cache/mlx-sys/mlx-cpu-0.32.2/mlx/lib"),
                   help="where our binary finds libmlx.so (prepended to LD_LIBRARY_PATH for it)")
    p.add_argument("--no-extra", action="store_true", help="full fine-tune: only our default head (not also the full logits and gradient checkpointing)")
    p.add_argument("--tmp", help="where the converted model is written (default: the system's temporary folder)")
    p.add_argument("--mlx-lm-run", dest="mode", choices=["full", "lora"])
    p.add_argument("--model-f32")
    a = p.parse_args()
    if a.mode:
        return mlx_lm_run(a)
    if not (a.model or a.random):
        p.error("--model or --random is required")
    tmp = tempfile.mkdtemp(dir=a.tmp)
    f32 = os.path.join(tmp, "model-" + a.dtype)
    write_model(os.path.expanduser(a.model or ""), f32, a.dtype, a.random)
    common = ["--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    ours_env = dict(os.environ, LD_LIBRARY_PATH=a.lib_dir + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else ""))
    # The PyPI mlx-cpu wheel bundles reference BLAS; our libmlx runs OpenBLAS behind mlx-sys's BLAS
    # router: on the CPU, give mlx-lm the same by preloading both, as llm_bench does
    # (MLX_LM_PRELOAD overrides; "" for none).
    import glob
    blas = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
    router = sorted(glob.glob(os.path.join(a.lib_dir, "..", "..", "mlx_cpu.libs", "libmlx-models-blas-route-*.so")))
    preload = os.environ.get("MLX_LM_PRELOAD", " ".join(router[:1] + [blas]) if a.dtype == "f32" and os.path.exists(blas) else "")
    peer_env = dict(os.environ, LD_PRELOAD=preload) if preload else dict(os.environ)
    print(f"mlx-lm LD_PRELOAD={preload or '(none)'}", flush=True)
    rows = []
    for mode in ["full", "lora"]:
        theirs = json.loads(subprocess.run([sys.executable, __file__, "--mlx-lm-run", mode, "--model-f32", f32] + common, env=peer_env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        variants = [[], ["--full-logits"], ["--grad-checkpoint"]] if mode == "full" and not a.no_extra else [[]]
        for extra in variants:
            lora = ["--lora-rank", "8"] if mode == "lora" else []
            ours = json.loads(subprocess.run([a.bin, "--model", f32, "--dtype", a.dtype] + common + lora + extra, env=ours_env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
            rows.append((mode, ours, theirs))
            print(json.dumps({"mode": mode, "ours": ours, "mlx_lm": theirs}), flush=True)
    import mlx.core as mx
    print(f"batch {a.batch_size} x {a.seq_len} tokens, {a.steps} measured steps after {a.warmup}, {a.dtype}, {mx.default_device()}")
    print(f"{'mode':6} {'our head':16} {'ours tok/s':>10} {'mlx-lm tok/s':>12} {'ratio':>6} {'CPU-s ratio':>11} {'ours peak GB':>12} {'mlx-lm peak GB':>14} {'ratio':>6}")
    for mode, o, t in rows:
        cpu_ratio = o.get("tokens_per_cpu_second", float("nan")) / t.get("tokens_per_cpu_second", float("nan"))
        print(f"{mode:6} {o['head'] + (' +ckpt' if o.get('grad_checkpoint') else ''):16} {o['tokens_per_second']:10.1f} {t['tokens_per_second']:12.1f} {o['tokens_per_second'] / t['tokens_per_second']:6.2f} {cpu_ratio:11.2f} "
              f"{o['peak_memory_gb']:12.3f} {t['peak_memory_gb']:14.3f} {o['peak_memory_gb'] / t['peak_memory_gb']:6.2f}")
        if o["trainable_params"] != t["trainable_params"]:
            print(f"  note: trainable parameters differ: ours {o['trainable_params']}, mlx-lm {t['trainable_params']}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
