"""xtrain's `task=custom` vs a hand-written Accelerate loop on the same model and data (examples/digits: the CNN on
scikit-learn's digits), one process, the same batch and optimizer.

Both run `--steps` optimizer steps; throughput (optimizer steps per second) is timed over the second half. They
alternate `--repeats` times; the medians are compared.

    python benchmarks/custom.py [--steps 400] [--repeats 5] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
PROJECT = REPO / "examples" / "digits"
sys.path.insert(0, str(PROJECT))


def xtrain_steps_per_s(steps: int, batch: int, run_dir: Path) -> float:
    from hydra import compose, initialize_config_module

    from xtrain.commands import cli
    from xtrain.config import schema
    from xtrain.backends.registry import resolve_auto
    from xtrain.backends.local import run_here

    cli.register_schemas()
    with initialize_config_module(config_module="xtrain.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"run_dir={run_dir}", "task=custom", "model._target_=mymodels.cnn", "data.train._target_=mydata.digits",
            "+data.train.split=train", "data.val._target_=mydata.digits", "+data.val.split=val",
            f"task.code_dir={PROJECT}", f"trainer.batch_size={batch}", f"trainer.max_steps={steps}",
            f"trainer.log_every={steps // 2}", f"trainer.eval_every={steps}", f"trainer.save_every={steps}"])
    cfg = resolve_auto(schema.from_container(cfg))
    from xtrain.launch import preflight

    run_here(cfg, preflight.write_run_dir(preflight.preflight(cfg)))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    second_half = [r for r in rows if "train/examples_per_s" in r][-1]
    return second_half["train/examples_per_s"] / batch


def hand_written_steps_per_s(steps: int, batch: int) -> float:
    """The loop an Accelerate user writes (its cv_example.py, minus the image pipeline: a schedule stepped with the
    optimizer, as there), with gradient clipping as xtrain's default."""
    from mydata import Digits
    from mymodels import cnn

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = cnn()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    loader = DataLoader(Digits("train"), batch_size=batch, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    done, start = 0, None
    while done < steps:
        for images, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # as xtrain's default trainer.max_grad_norm
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            done += 1
            if done == steps // 2:
                start = time.perf_counter()
            if done == steps:
                break
    return (steps - steps // 2) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            ours.append(xtrain_steps_per_s(args.steps, args.batch, Path(tmp) / f"run{i}"))
            theirs.append(hand_written_steps_per_s(args.steps, args.batch))
            print(f"repeat {i}: xtrain {ours[-1]:.1f} steps/s, hand-written {theirs[-1]:.1f} steps/s", flush=True)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"task=custom vs a hand-written Accelerate loop (median of {args.repeats}, {args.steps} steps, batch "
          f"{args.batch}, timed over the second half): {a:.1f} vs {b:.1f} steps/s = {a / b:.3f}x")


if __name__ == "__main__":
    main()
