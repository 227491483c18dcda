"""What SLURM costs on the test cluster (tests/slurm/: 2 nodes on this machine), against running here.

1. Submit-to-first-step latency: from starting `python -m xtrain ...` to the first training step
   logged in metrics.jsonl, for `cluster=slurm` on 1 node and on 2 nodes (1 process each), and the
   same runs launched locally (1 process; 2 processes).
2. A 4-point sweep: its wall time as one job array (`cluster=slurm`, 2 points at a time, each with a
   node's 2 cores) against the same sweep run locally, one point after another.
3. The cost of a stop, on a 1-node 2-process job (checkpoints every 5 steps), stopped after step 12:
   with warning (`scancel --signal=USR2`: checkpoint at the step boundary, the job requeues itself) and
   without (`scontrol requeue`: back to the newest periodic checkpoint). Steps lost (trained again) and
   the time from the signal to the requeued job's first step. The test cluster holds a requeued job for
   10 s (cred_expire=10, its minimum is 5; SLURM's default is 120 s): that is part of the figure.

4. Following a job: the `squeue` and `sacct` calls the waiting command makes per minute of a 1-node job
   that trains ~60 s (counted by shims on PATH that log each call and run the real command).
   `PYTHONPATH=<an older checkout> python benchmarks/slurm.py --parts follow` measures that checkout's.

The test cluster binds each task to its CPUs (task/cgroup + task/affinity where cgroup v1 is mounted):
the latencies are with binding on. Starts the test cluster if none is running (as root), and stops
what it started.

    python benchmarks/slurm.py [--repeats 3] [--steps 20] [--parts latency,sweep,stops,follow]
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
SCRIPTS = REPO / "tests" / "slurm"


def first_step_latency(run_dir: Path, *overrides: str) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "xtrain", f"run_dir={run_dir}", "trainer.max_steps=3",
                             "trainer.log_every=1", "trainer.eval_every=3", "trainer.save_every=3", *overrides],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    while True:
        if metrics.exists() and any("train/loss" in json.loads(line) for line in metrics.read_text().splitlines()
                                    if line.strip()):
            latency = time.perf_counter() - start
            break
        if proc.poll() is not None:
            raise SystemExit(f"run {run_dir} ended (exit {proc.returncode}) before its first step")
        time.sleep(0.05)
    if proc.wait() != 0:
        raise SystemExit(f"run {run_dir} failed")
    return latency


def sweep_wall(sweep_dir: Path, steps: int, *overrides: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "xtrain", "-m", f"run_dir={sweep_dir}", "trainer.seed=1,2,3,4",
                    f"trainer.max_steps={steps}", f"trainer.log_every={steps}", f"trainer.eval_every={steps}",
                    f"trainer.save_every={steps}", *overrides], check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - start


def stop_cost(run_dir: Path, command: list[str]) -> tuple[int, float]:
    """(steps lost, seconds from the stop command to the requeued job's first step)."""
    proc = subprocess.Popen([sys.executable, "-m", "xtrain", f"run_dir={run_dir}", "cluster=slurm",
                             "cluster.time_limit=10", "cluster.num_processes=2", "trainer.max_steps=40",
                             "trainer.log_every=1", "trainer.eval_every=20", "trainer.save_every=5",
                             "trainer.batch_size=4"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and any(json.loads(line)["step"] >= 12 for line in metrics.read_text().splitlines()
                                        if line.strip())):
        if proc.poll() is not None:
            raise SystemExit(f"run {run_dir} ended (exit {proc.returncode}) before step 12")
        time.sleep(0.05)
    job = json.loads((run_dir / "slurm.json").read_text())["job_id"]
    sent = time.time()
    subprocess.run([*command, job], check=True)
    if proc.wait() != 0:
        raise SystemExit(f"run {run_dir} failed")
    result = json.loads((run_dir / "result.json").read_text())
    [restart] = result["restarts"]
    return restart["steps_lost"], result["first_step_at"] - sent


def follower_calls(tmp: Path) -> tuple[float, float]:
    """(squeue calls, sacct calls) per minute the waiting command makes while following a ~60 s job."""
    shims, calls = tmp / "shims", tmp / "calls.log"
    shims.mkdir()
    for name in ("squeue", "sacct"):
        real = subprocess.run(["which", name], capture_output=True, text=True, check=True).stdout.strip()
        (shims / name).write_text(f"#!/bin/sh\necho {name} >> {calls}\nexec {real} \"$@\"\n")
        (shims / name).chmod(0o755)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "xtrain", f"run_dir={tmp / 'follow'}", "cluster=slurm", "cluster.time_limit=10",
                    "trainer.max_steps=240", "trainer.log_every=20", "trainer.eval_every=240", "trainer.save_every=240"],
                   cwd=REPO, check=True, capture_output=True, env={**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"})
    minutes = (time.perf_counter() - start) / 60
    names = calls.read_text().split()
    return names.count("squeue") / minutes, names.count("sacct") / minutes


def cluster_running() -> bool:
    return subprocess.run(["scontrol", "ping"], capture_output=True).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--parts", default="latency,sweep,stops,follow")
    args = parser.parse_args()
    parts = args.parts.split(",")
    started = False
    # the test cluster's config lives in its own directory (tests/slurm/start_slurm.sh); clients are told where
    os.environ.setdefault("SLURM_CONF", os.path.join(os.environ.get("SLURM_BASE", "/tmp/slurm-ci"), "etc", "slurm.conf"))
    try:
        if not cluster_running():
            subprocess.run(["bash", str(SCRIPTS / "start_slurm.sh")], check=True, capture_output=True)
            started = True
        slurm = ["cluster=slurm", "cluster.time_limit=10"]
        cases = {
            "local, 1 process": [],
            "slurm, 1 node": slurm,
            "local, 2 processes": ["cluster.num_processes=2"],
            "slurm, 2 nodes x 1 process": [*slurm, "cluster.nodes=2"],
        }
        latency: dict[str, list[float]] = {name: [] for name in cases}
        local_sweep, array_sweep = [], []
        stops = {"with warning (scancel --signal=USR2)": ["scancel", "--signal=USR2"],
                 "without warning (scontrol requeue)": ["scontrol", "requeue"]}
        stop_costs: dict[str, list[tuple[int, float]]] = {name: [] for name in stops}
        follows: list[tuple[float, float]] = []
        with tempfile.TemporaryDirectory() as tmp:
            first_step_latency(Path(tmp, "warm-cache"))  # tokenizer and data cache, not part of the measurement
            for i in range(args.repeats):
                if "latency" in parts:
                    for case, (name, overrides) in enumerate(cases.items()):
                        latency[name].append(first_step_latency(Path(tmp, f"{i}-{case}"), *overrides))
                if "sweep" in parts:
                    local_sweep.append(sweep_wall(Path(tmp, f"sweep-local-{i}"), args.steps))
                    array_sweep.append(sweep_wall(Path(tmp, f"sweep-slurm-{i}"), args.steps, *slurm,
                                                  "cluster.cpus_per_task=2", "hydra.launcher.array_parallelism=2"))
                if "stops" in parts:
                    for case, (name, command) in enumerate(stops.items()):
                        stop_costs[name].append(stop_cost(Path(tmp, f"stop-{i}-{case}"), command))
                if "follow" in parts:
                    Path(tmp, f"follow-{i}").mkdir()
                    follows.append(follower_calls(Path(tmp, f"follow-{i}")))
        print(f"medians of {args.repeats}; test cluster: 2 nodes on one 2-core machine")
        if "latency" in parts:
            print("submit-to-first-step latency:")
            for name, values in latency.items():
                print(f"  {name:28} {statistics.median(values):6.2f} s")
        if "sweep" in parts:
            lo, sl = statistics.median(local_sweep), statistics.median(array_sweep)
            print(f"4-point sweep ({args.steps} steps a point): local one at a time {lo:.1f} s, "
                  f"SLURM job array 2 at a time {sl:.1f} s ({sl / lo:.2f}x)")
        if "stops" in parts:
            print("a stop after step 12 of a 1-node 2-process job (checkpoint every 5 steps):")
            for name, values in stop_costs.items():
                lost = statistics.median(v[0] for v in values)
                down = statistics.median(v[1] for v in values)
                print(f"  {name:38} steps lost {lost:4.1f} | signal to the requeued job's first step {down:5.1f} s")
        if "follow" in parts:
            squeue, sacct = (statistics.median(v[k] for v in follows) for k in (0, 1))
            print(f"following a 1-node job of ~60 s: {squeue:.1f} squeue and {sacct:.1f} sacct calls per minute")
    finally:
        if started:
            subprocess.run(["bash", str(SCRIPTS / "stop_slurm.sh")], capture_output=True)


if __name__ == "__main__":
    main()
