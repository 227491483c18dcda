"""bf16 autocast vs fp32: xtrain tokens/s on this machine, for the default model and a larger one.

In one process, fp32 and bf16 runs alternate `--repeats` times per model; medians and their ratio
are printed. Throughput is xtrain's own log window over the second half of the steps.

    python benchmarks/precision.py [--steps 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
from accelerate.state import AcceleratorState

from throughput import compose_config, xtrain_tokens_per_s

MODELS = {
    "default (tiny_gpt2, 1.1M)": [],
    "gpt2 d=512 L=8 (26M)": ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8",
                            "model.intermediate_size=2048", "trainer.batch_size=8"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in MODELS.items():
            speed = {"fp32": [], "bf16": []}
            for i in range(args.repeats):
                for precision in speed:
                    run = Path(tmp) / f"{len(rows)}-{precision}-{i}"
                    cfg = compose_config([*overrides, f"precision={precision}"], run, args.steps)
                    speed[precision].append(xtrain_tokens_per_s(cfg)[0])
                    # the precision is fixed per process state: reset it, as Accelerate's own tests do
                    AcceleratorState._reset_state(reset_partial_state=True)
            fp32, bf16 = statistics.median(speed["fp32"]), statistics.median(speed["bf16"])
            rows.append((name, fp32, bf16))
    print(f"{torch.get_num_threads()} threads, {args.repeats} alternating repeats of {args.steps} steps")
    print(f"{'model':28} {'fp32 tok/s':>11} {'bf16 tok/s':>11} {'bf16/fp32':>9}")
    for name, fp32, bf16 in rows:
        print(f"{name:28} {fp32:11.0f} {bf16:11.0f} {bf16 / fp32:9.2f}")


if __name__ == "__main__":
    main()
