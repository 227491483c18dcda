"""What a checkpoint costs training, written in step or behind it: asynchronous against synchronous saves.

    python benchmarks/async_save.py [--repeats 3] [--hidden 768 --layers 8] [--steps 24 --save-every 8]
    python benchmarks/async_save.py --gpu --repeats 1 --steps 30 --save-every 10    # on a GPU: the 856 M Llama

The same run twice per repeat, `trainer.async_save=true` and `=false` in turn (one process on the CPU, a GPT-2 of
~70 M parameters: hidden 768, 8 layers, vocabulary 16384, AdamW), each saving every `--save-every` steps. Per save
during the run (each save's log line): how long training waited and how long the files took; the save at the last
step, which the run's end waits for in either mode, apart. Per run: result.json's `checkpoint_blocked_s` (every
save), the steady training rate, the goodput and its parts; whether both runs of a pair end with the same weights
(bitwise). Medians over the repeats. Then one asynchronous run killed (SIGKILL) as its first checkpoint is
published, and resumed with `resume=auto`: its goodput and the parts of its span, the steps trained again and the
time down between the two attempts included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


SAVED = re.compile(r"step (\d+) \| checkpoint saved: .* \(training waited ([\d.]+) s(?:, written in ([\d.]+) s behind it)?\)")


# --gpu: benchmarks/gpu.py's Llama (856 M parameters), block 1024, batch 16, bf16 autocast, on the GPU
GPU_MODEL = ["model=tiny_llama", "model.hidden_size=2048", "model.num_layers=16", "model.num_heads=16",
             "model.intermediate_size=5632", "model.vocab_size=16384", "data.block_size=1024", "trainer.batch_size=16",
             "precision=bf16", "data.max_val_tokens=16384"]


def overrides_for(run_dir: Path, mode: str, args) -> list[str]:
    model = GPU_MODEL if args.gpu else [
        f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", "model.num_heads=12",
        f"model.intermediate_size={4 * args.hidden}", "model.vocab_size=16384", "trainer.batch_size=2",
        "data.max_val_tokens=512"]
    return [f"run_dir={run_dir}", f"trainer.async_save={mode}", *model, f"trainer.max_steps={args.steps}",
            "trainer.warmup_steps=2", f"trainer.save_every={args.save_every}", f"trainer.eval_every={args.steps}",
            f"trainer.log_every={args.save_every}", "trainer.keep_checkpoints=1"]


def run(run_dir: Path, mode: str, args) -> dict:
    overrides = overrides_for(run_dir, mode, args)
    proc = subprocess.run([sys.executable, "-m", "xtrain", *overrides], check=True, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    result = json.loads((run_dir / "result.json").read_text())
    saves = [(int(m[1]), float(m[2]), float(m[3] or m[2])) for m in SAVED.finditer(proc.stdout + proc.stderr)]
    assert len(saves) == result["checkpoint_saves"], (saves, result["checkpoint_saves"])
    result["during"] = [(waited, written) for step, waited, written in saves if step != args.steps]
    result["last"] = next(waited for step, waited, _ in saves if step == args.steps)
    return result


def killed_and_resumed(run_dir: Path, args) -> dict:
    """An asynchronous run killed as its first checkpoint is published, then resumed: its result."""
    overrides = [o if not o.startswith("trainer.log_every=") else "trainer.log_every=1"  # (every step lost is logged)
                 for o in overrides_for(run_dir, "true", args)]
    proc = subprocess.Popen([sys.executable, "-m", "xtrain", *overrides], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    while True:
        found = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}
        if found.get("checkpoint_step") or proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(2.0)  # (down between the attempts)
    subprocess.run([sys.executable, "-m", "xtrain", *overrides, "resume=auto"], check=True, capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads((run_dir / "result.json").read_text())


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    x, y = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=8)
    parser.add_argument("--gpu", action="store_true", help="benchmarks/gpu.py's 856 M Llama in bf16 on the GPU")
    args = parser.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.repeats):
            found = {mode: run(Path(root) / f"{mode}{i}", mode, args) for mode in ("true", "false")}
            pairs.append((found["true"], found["false"], same_weights(Path(root) / f"true{i}", Path(root) / f"false{i}")))
    first = pairs[0][0]
    print(f"model {first['model_parameters'] / 1e6:.1f} M parameters, {first['checkpoint_saves']} saves a run "
          f"(the last at the run's end), {args.repeats} pair(s)")
    for j, mode in enumerate(("async", "sync")):
        waited = statistics.median(w for p in pairs for w, _ in p[j]["during"])
        written = statistics.median(w for p in pairs for _, w in p[j]["during"])
        med = {key: statistics.median(p[j][key] for p in pairs)
               for key in ("last", "checkpoint_blocked_s", "tokens_per_s", "goodput", "goodput_span_s")}
        parts = pairs[0][j]["goodput_breakdown"]
        print(f"  {mode:5}  a save during the run: training waited {waited:.2f} s, its files took {written:.2f} s; "
              f"the last save {med['last']:.2f} s; blocked in all {med['checkpoint_blocked_s']:.2f} s; "
              f"{med['tokens_per_s']:.0f} tokens/s steady; goodput {med['goodput']:.1%} of {med['goodput_span_s']:.1f} s "
              "(" + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in parts.items()) + ")")
    during = statistics.median(
        statistics.median(w for w, _ in p[0]["during"]) / statistics.median(w for w, _ in p[1]["during"]) for p in pairs)
    whole = statistics.median(p[0]["checkpoint_blocked_s"] / p[1]["checkpoint_blocked_s"] for p in pairs)
    print(f"  training waited on a save during the run, async / sync: {during:.3f}; on every save, the last "
          f"included: {whole:.3f} (medians of pairs); final weights bitwise equal in every pair: {all(p[2] for p in pairs)}")
    with tempfile.TemporaryDirectory() as root:
        result = killed_and_resumed(Path(root) / "killed", args)
    [restart] = result["restarts"]
    parts = result["goodput_breakdown"]
    print(f"  async, killed and resumed from step {restart['at_step']}: {restart['steps_lost']} logged steps lost; goodput {result['goodput']:.1%} of {result['goodput_span_s']:.1f} s ("
          + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in parts.items()) + f"; the parts add up to "
          f"{sum(parts.values()):.1f} s)")


if __name__ == "__main__":
    main()
