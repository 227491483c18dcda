"""tokens/s of ddp, zero1, zero2, zero3 and fsdp on 2 CPU processes, as ratios to ddp.

Every strategy trains the same model with the same batch (2 processes x `--batch`) through
the real CLI; the strategies alternate `--repeats` times and the medians are compared.
tokens/s is xtrain's own log window over the second half of `--steps`. ZeRO and FSDP run on
the CPU through the test suite's seams (`tests/seams/zero_on_cpu.py`, `fsdp_on_cpu.py`): these
are CPU figures over gloo, not a prediction for GPUs.

    python benchmarks/strategies.py [--steps 40] [--repeats 3] [--batch 8] [override ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from launch import run

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
SEAMS = {"XTRAIN_SEAMS": ",".join(str(Path(__file__).resolve().parents[1] / "tests" / "seams" / f"{name}.py")
                                 for name in ("zero_on_cpu", "fsdp_on_cpu"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="config overrides, as on the xtrain command line")
    args = parser.parse_args()
    os.environ.update(SEAMS)
    common = ["cluster.num_processes=2", f"trainer.batch_size={args.batch}", *args.overrides]
    speed: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp, "warm-cache"), common, 2)  # tokenizer and data cache, not part of the measurement
        for i in range(args.repeats):
            for strategy in STRATEGIES:
                _, tokens_per_s = run(Path(tmp, f"{i}-{strategy}"), [*common, f"strategy={strategy}"], args.steps)
                speed[strategy].append(tokens_per_s)
    ddp = statistics.median(speed["ddp"])
    print(f"{os.cpu_count()} cores, 2 processes x batch {args.batch}, {args.repeats} alternating repeats of "
          f"{args.steps} steps {' '.join(args.overrides)}")
    print(f"{'strategy':9} {'tokens/s':>9} {'vs ddp':>7}   runs")
    for strategy in STRATEGIES:
        median = statistics.median(speed[strategy])
        print(f"{strategy:9} {median:9.0f} {median / ddp:7.2f}   {', '.join(f'{x:.0f}' for x in speed[strategy])}")


if __name__ == "__main__":
    main()
