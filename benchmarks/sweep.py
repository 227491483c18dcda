"""What a sweep costs on top of its points, and what running points in parallel gives.

1. Per-point overhead: the wall time of a 4-point sweep (`python -m xtrain -m ...`, points in
   the driver) minus the sum of its points' own wall times (result.json), per point. It holds
   the sweep's one-off start-up (interpreter, torch and transformers imports, Hydra) and, per
   point, composing and checking it and the summary files rewritten after it. The marginal
   part: the same difference for 8 points minus that for 4, per extra point.
2. Parallel points: 2 points at once with 1 core each (`hydra.launcher.n_jobs=2`) against the
   same 2 points one after another with 2 cores each: tokens per second of sweep wall time.

    python benchmarks/sweep.py [--steps 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sweep(sweep_dir: Path, steps: int, *overrides: str) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "xtrain", "-m", f"run_dir={sweep_dir}", f"trainer.max_steps={steps}",
                    f"trainer.log_every={steps}", f"trainer.eval_every={steps}", f"trainer.save_every={steps}",
                    *overrides], check=True, capture_output=True, cwd=REPO)
    wall = time.perf_counter() - start
    points = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    return wall, [json.loads((sweep_dir / p["dir"] / "result.json").read_text()) for p in points]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    overhead, marginal, sequential, parallel = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        sweep(Path(tmp, "warm-cache"), 2)  # tokenizer and data cache, not part of the measurement
        for i in range(args.repeats):
            extra = {}
            for seeds in ("1,2,3,4", "1,2,3,4,5,6,7,8"):
                wall, results = sweep(Path(tmp, f"grid-{i}-{len(seeds)}"), args.steps, f"trainer.seed={seeds}")
                extra[len(results)] = wall - sum(r["wall_time_s"] for r in results)
            overhead.append(extra[4] / 4)
            marginal.append((extra[8] - extra[4]) / 4)
            for n_jobs, speeds in ((1, sequential), (2, parallel)):
                wall, results = sweep(Path(tmp, f"pair-{n_jobs}-{i}"), args.steps, "trainer.seed=1,2",
                                      f"hydra.launcher.n_jobs={n_jobs}")
                tokens = sum(r["tokens_per_s"] * r["train_time_s"] for r in results)
                speeds.append(tokens / wall)
    print(f"{os.cpu_count()} cores, {args.repeats} repeats of {args.steps}-step points")
    print(f"per-point overhead of a 4-point sweep: {statistics.median(overhead):.2f} s "
          f"(runs: {', '.join(f'{x:.2f}' for x in overhead)})")
    print(f"marginal overhead per extra point:      {statistics.median(marginal):.2f} s "
          f"(runs: {', '.join(f'{x:.2f}' for x in marginal)})")
    seq, par = statistics.median(sequential), statistics.median(parallel)
    print(f"2 points one after another (2 cores each): {seq:.0f} tokens/s of sweep wall time")
    print(f"2 points at once (1 core each):           {par:.0f} tokens/s of sweep wall time ({par / seq:.2f}x)")


if __name__ == "__main__":
    main()
