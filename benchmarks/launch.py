"""1 vs 2 local processes: time from command to the first training step, and tokens/s.

Both run the same global batch (1 x 16 vs 2 x 8 sequences) through the real CLI, alternating
`--repeats` times; tokens/s is xtrain's log window over the second half of `--steps`.
On a 2-core machine 2 processes get 1 thread each (1 process gets 2).

    python benchmarks/launch.py [--steps 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETUPS = {"1 process x batch 16": ["cluster.num_processes=1", "trainer.batch_size=16"],
          "2 processes x batch 8": ["cluster.num_processes=2", "trainer.batch_size=8"]}


def run(run_dir: Path, overrides: list[str], steps: int) -> tuple[float, float]:
    subprocess.run(
        [sys.executable, "-m", "xtrain", f"run_dir={run_dir}", f"trainer.max_steps={steps}",
         f"trainer.log_every={steps // 2}", f"trainer.eval_every={steps}", f"trainer.save_every={steps}", *overrides],
        check=True, capture_output=True,
    )
    result = json.loads((run_dir / "result.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result["time_to_first_step_s"], [r for r in rows if "train/tokens_per_s" in r][-1]["train/tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    first: dict[str, list[float]] = {name: [] for name in SETUPS}
    speed: dict[str, list[float]] = {name: [] for name in SETUPS}
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp, "warm-cache"), [], 2)  # tokenizer and data cache, not part of the measurement
        for i in range(args.repeats):
            for name, overrides in SETUPS.items():
                t, s = run(Path(tmp, f"{i}-{name.split()[0]}"), overrides, args.steps)
                first[name].append(t)
                speed[name].append(s)
    print(f"{os.cpu_count()} cores, {args.repeats} alternating repeats of {args.steps} steps, warm cache")
    for name in SETUPS:
        print(f"{name:24} first step after {statistics.median(first[name]):5.1f} s   "
              f"{statistics.median(speed[name]):7.0f} tokens/s   (runs: {', '.join(f'{x:.0f}' for x in speed[name])})")
    ratio = statistics.median(speed["2 processes x batch 8"]) / statistics.median(speed["1 process x batch 16"])
    print(f"tokens/s, 2 processes / 1 process: {ratio:.2f}")


if __name__ == "__main__":
    main()
