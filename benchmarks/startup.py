"""Start-up costs: `python -m xtrain --cfg job` wall time, and the default run's time to its first step.

    python benchmarks/startup.py [--repeats 5]

Time to first step is from process start to the end of optimizer step 1 (result.json's
`time_to_first_step_s`), once with an empty cache (tokenizer training, tokenization) and
then with the cache warm.
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


def wall(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def first_step(run_dir: Path, env: dict) -> float:
    subprocess.run(
        [sys.executable, "-m", "xtrain", f"run_dir={run_dir}", "trainer.max_steps=2"],
        check=True, capture_output=True, env=env,
    )
    return json.loads((run_dir / "result.json").read_text())["time_to_first_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "XTRAIN_CACHE_DIR": f"{tmp}/cache"}
        cfg_job = [wall([sys.executable, "-m", "xtrain", "--cfg", "job"], env) for _ in range(args.repeats)]
        cold = first_step(Path(tmp, "cold"), env)
        warm = [first_step(Path(tmp, f"warm{i}"), env) for i in range(args.repeats)]
    print(f"python -m xtrain --cfg job: median {statistics.median(cfg_job):.2f} s  "
          f"(runs: {', '.join(f'{x:.2f}' for x in cfg_job)})")
    print(f"default run, time to first step: cold cache {cold:.1f} s, warm cache median "
          f"{statistics.median(warm):.1f} s  (runs: {', '.join(f'{x:.1f}' for x in warm)})")


if __name__ == "__main__":
    main()
