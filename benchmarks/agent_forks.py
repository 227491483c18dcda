"""A sweep's multi-process points with their torchrun agents forked from the driver's server, against each agent
started anew (`XTRAIN_AGENT_FORKSERVER=0`): the machine's CPU for the whole sweep and each point's time from its
start to its first step (result.json), the first point apart (it starts the server either way).

The sweep: `--points` points of 2 processes each, in the driver, on the default model at a quarter of its width
(`--steps` steps each), the two variants alternating `--repeats` times. Run it on a machine with nothing else
running: the CPU is read from /proc/stat.

    python benchmarks/agent_forks.py [--points 4] [--steps 10] [--repeats 3]
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
NARROW = ["model.hidden_size=32", "model.intermediate_size=128", "model.num_heads=2"]


def busy_s() -> float:
    with open("/proc/stat") as f:
        user, nice, system, _, _, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def sweep(sweep_dir: Path, points: int, steps: int, forked: bool) -> tuple[float, float, list[float]]:
    env = {**os.environ, "XTRAIN_AGENT_FORKSERVER": "1" if forked else "0"}
    seeds = ",".join(str(i) for i in range(points))
    cpu, start = busy_s(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "xtrain", "-m", f"run_dir={sweep_dir}", f"trainer.seed={seeds}",
                    "cluster.num_processes=2", f"trainer.max_steps={steps}", f"trainer.eval_every={steps}",
                    f"trainer.save_every={steps}", "trainer.warmup_steps=1", *NARROW],
                   check=True, capture_output=True, cwd=REPO, env=env)
    wall, cpu = time.perf_counter() - start, busy_s() - cpu
    firsts = [json.loads((p / "result.json").read_text())["time_to_first_step_s"]
              for p in sorted(sweep_dir.glob("[0-9]*_*"), key=lambda p: int(p.name.split("_")[0]))]
    return cpu, wall, firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    found: dict[bool, list] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for forked in (True, False):
                found[forked].append(sweep(Path(tmp) / f"{forked}_{repeat}", args.points, args.steps, forked))
    for forked, runs in found.items():
        cpu = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        later = statistics.median(t for r in runs for t in r[2][1:])
        first = statistics.median(r[2][0] for r in runs)
        print(f"agents {'forked from the server' if forked else 'started anew':24s}: {args.points} points, "
              f"machine CPU {cpu:.1f} s, wall {wall:.1f} s; start to first step: first point {first:.1f} s, "
              f"later points {later:.1f} s (medians of {args.repeats})")


if __name__ == "__main__":
    main()
