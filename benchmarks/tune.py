"""What pruning saves, how busy the slots stay, and what asking and telling cost (`hydra/sweeper=xtrain_optuna`).

1. Pruning: one search space and seed (TPE), studied with the median pruner and with none: the optimizer
   steps trained over all trials, the study's wall time, and the best val loss each found (the pruned
   study's must be within 2 % of the unpruned one's). Target: at least 2x fewer steps.
2. Idle time between trials: a study with `n_jobs=2`; for each trial after the first two, the time from
   the trial whose slot it took recording its end (result.json) to its own process starting. Target: <= 1 s.
3. Asking and telling through the journal storage (a file and its lock), per trial, in one process.

    python benchmarks/tune.py [--trials 16] [--steps 60] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPACE = ["trainer.lr=tag(log,interval(1e-4,0.3))", "trainer.weight_decay=interval(0.0,0.2)"]


def study(sweep_dir: Path, trials: int, steps: int, *overrides: str) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "xtrain", "-m", f"run_dir={sweep_dir}", "hydra/sweeper=xtrain_optuna",
                    "hydra.sweeper.seed=0", f"hydra.sweeper.n_trials={trials}", *SPACE, f"trainer.max_steps={steps}",
                    f"trainer.eval_every={steps // 6}", f"trainer.log_every={steps // 6}", f"trainer.save_every={steps}",
                    *overrides], check=True, capture_output=True, cwd=REPO)
    wall = time.perf_counter() - start
    points = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    return wall, [json.loads((sweep_dir / p["dir"] / "result.json").read_text()) for p in points]


def best(results: list[dict]) -> float:
    return min(r["val_loss"] for r in results if r["status"] == "completed")


def idle_gaps(results: list[dict], slots: int) -> list[float]:
    spans = sorted((r["first_step_at"] - r["time_to_first_step_s"], r["first_step_at"] - r["time_to_first_step_s"]
                    + r["wall_time_s"]) for r in results)
    gaps = []
    for i, (start, _) in enumerate(spans[slots:], slots):
        freed = sorted(end for _, end in spans[:i])[i - slots]
        gaps.append(start - freed)
    return gaps


def ask_and_tell(tmp: Path, n: int = 200) -> float:
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = str(tmp / "overhead.journal")
    storage = optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))
    s = optuna.create_study(storage=storage, sampler=optuna.samplers.TPESampler(seed=0))
    space = {"lr": FloatDistribution(1e-4, 0.3, log=True)}
    start = time.perf_counter()
    for i in range(n):
        trial = s.ask(fixed_distributions=space)
        for step in (10, 20, 30):  # what a trial's trainer does at each eval
            trial.report(1.0 / (i + 1), step)
            trial.should_prune()
        s.tell(trial, 1.0 / (i + 1))
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows = {"median": [], "none": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for pruner in rows:
                settings = ["hydra.sweeper.pruner_settings.n_startup_trials=4",
                            f"hydra.sweeper.pruner_settings.n_warmup_steps={args.steps // 6}"] if pruner == "median" else []
                wall, results = study(Path(tmp) / f"{pruner}-{repeat}", args.trials, args.steps,
                                      f"hydra.sweeper.pruner={pruner}", *settings)
                rows[pruner].append({"wall": wall, "steps": sum(r["steps"] for r in results), "best": best(results),
                                     "pruned": sum(r["status"] == "pruned" for r in results)})
        print(f"{args.trials} trials of up to {args.steps} steps, TPE seed 0, median of {args.repeats}")
        print("| pruner | optimizer steps | wall time | best val loss | trials pruned |")
        print("| --- | --- | --- | --- | --- |")
        med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rows.items()}
        for pruner, m in med.items():
            print(f"| {pruner} | {m['steps']:.0f} | {m['wall']:.1f} s | {m['best']:.4f} | {m['pruned']:.0f} |")
        print(f"steps: {med['none']['steps'] / med['median']['steps']:.2f}x fewer with the median pruner; wall time "
              f"{med['none']['wall'] / med['median']['wall']:.2f}x shorter; best val loss within "
              f"{abs(med['median']['best'] / med['none']['best'] - 1) * 100:.2f} %")

        _, results = study(Path(tmp) / "parallel", 6, args.steps // 3, "hydra.sweeper.pruner=none", "hydra.sweeper.n_jobs=2")
        gaps = idle_gaps(results, 2)
        print(f"idle between trials, n_jobs=2: median {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s "
              f"(from a trial's recorded end to the next one's process start); time to first step in a new "
              f"process: median {statistics.median(r['time_to_first_step_s'] for r in results):.1f} s")
        print(f"ask + 3 x (report, should_prune) + tell through the journal file: {ask_and_tell(Path(tmp)) * 1e3:.1f} ms a trial")


if __name__ == "__main__":
    main()
