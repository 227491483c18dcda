"""The SLURM backend: a run, or a sweep's points, submitted to SLURM (one job; one job array per set of job
parameters) and followed to their end from the submitting machine.

Every run dir is validated and written here before anything is queued (launch/preflight.py); on the nodes,
`xtrain.backends.slurm.node.run_node` trains it. SLURM's output and the submitted sbatch script go to `logs/`
(a sweep's: the sweep dir's `logs/`); the job's id is in the run dir's `slurm.json`. The submitting command
follows the job (its states, rank 0's lines) and ends with the run's own outcome.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import Callable

from xtrain.backends.slurm.monitor import cancel, follow, settle
from xtrain.backends.slurm.submit import (ASSUMED, assumed, check, job_parameters, request_line, resolve_request, sbatch_script,
                                 slurm_here, submit)
from xtrain.config.point import Point
from xtrain.config.schema import RunConfig
from xtrain.core import rundir
from xtrain.core.errors import ConfigError, LaunchFailed, Stopped, SweepFailed
from xtrain.core.rundir import LOGS
from xtrain.launch import hardware, plan, preflight

log = logging.getLogger("xtrain")


def resolve(cfg: RunConfig) -> RunConfig:
    """On the submitting machine: GPUs and CPUs per node from the partition (on a node: resolved already). A dry
    run where SLURM is not assumes what `assumed` says."""
    if not hardware.submitting_to_slurm(cfg.cluster):
        return cfg
    return assumed(cfg) if cfg.dry_run and not slurm_here() else resolve_request(cfg)


def describe(cfg: RunConfig, script: bool = True) -> str:
    """A dry run: every check the real submission makes (SLURM's own where it is here), the plan, the request and
    (`script`) the sbatch script. Nothing is written or submitted."""
    lines = []
    if slurm_here():
        check(cfg)
    else:
        lines.append(f"slurm: not on this machine (no sbatch on PATH); assumed {ASSUMED}: set cluster.partition, "
                     "cluster.gpus_per_node and cluster.cpus_per_task to plan the request you will make")
    preflight.check_free(cfg)
    preflight.preflight(cfg, planning=True)
    lines += [plan.render(plan.for_job(cfg, hardware.refusal(cfg))), request_line(cfg.cluster)]
    if script:
        lines.append(f"\nsbatch script (nothing submitted):\n{sbatch_script(cfg, Path(cfg.run_dir) / LOGS)}")
    return "\n".join(lines)


def run(cfg: RunConfig) -> dict:
    """`python -m xtrain cluster=slurm ...`: check, write the run dir, submit one job, follow it."""
    if cfg.dry_run:
        print(describe(cfg))
        return {"dry_run": True}
    check(cfg)
    prepared = preflight.preflight(cfg)
    folder = Path(cfg.run_dir) / LOGS
    # sbatch refused (or the controller went away since the checks): the run dir as it was
    with preflight.taken_back_if_refused(Path(cfg.run_dir)):
        path = preflight.write_run_dir(prepared)
        log.info("%s", request_line(cfg.cluster))
        [job] = submit([(job_parameters(cfg.cluster), [path])], folder)
    log.info("submitted SLURM job %s: run dir %s", job.job_id, path)
    if not cfg.cluster.wait:
        log.info("not waiting (cluster.wait=false); see it with: python -m xtrain.status %s", path)
        return {"job_id": job.job_id}
    results: list[dict] = []
    try:
        follow([job], lambda _, result: results.append(result), tail=job.log)
    except KeyboardInterrupt:
        cancel([job])
        settle(job, "CANCELLED")
        raise LaunchFailed(f"cancelled SLURM job {job.job_id} (Ctrl-C); continue it with run_dir={path} resume=auto",
                           130) from None
    result = results[0]
    if result["status"] == "completed":
        return result
    if result["status"] == "failed":
        _show_failing_rank(path)
        raise LaunchFailed(f"{result['error']}\nevery rank's output: {path / LOGS}", 1)
    if result["status"] == "interrupted" and result.get("stop"):  # not requeued: the line says how to continue
        raise Stopped(result["error"], getattr(signal.Signals, result["stop"]["signal"], signal.SIGTERM))
    raise LaunchFailed(f"{result['error']}; its checkpoints stay: continue with run_dir={path} resume=auto", 1)


def _show_failing_rank(path: Path) -> None:
    error = rundir.first_rank_error(path)
    if error and not error["diverged"] and not error["config_error"]:
        sys.stderr.write(error["traceback"])


def arrays(points: list[Point], array_parallelism: int) -> list[tuple[dict, list[Point]]]:
    """The points in job arrays: one per set of job parameters."""
    groups: dict[str, tuple[dict, list[Point]]] = {}
    for point in points:
        params = {**job_parameters(point.cfg.cluster), "array_parallelism": array_parallelism}
        groups.setdefault(json.dumps(params, sort_keys=True), (params, []))[1].append(point)
    return list(groups.values())


def scripts(points: list[Point], sweep_dir: Path, *, array_parallelism: int = 256) -> list[str]:
    """The sbatch script of each job array the sweep's points would be submitted as (a dry run shows them)."""
    return [sbatch_script(group[0].cfg, sweep_dir / LOGS, array=len(group), array_parallelism=array_parallelism)
            for _, group in arrays(points, array_parallelism)]


def check_points(points: list[Point], *, array_parallelism: int = 256) -> None:
    if array_parallelism < 1:
        raise ConfigError(f"hydra.launcher.array_parallelism={array_parallelism}: must be >= 1")


def run_points(points: list[Point] | Callable[[], Point | None], sweep_dir: Path, on_end: Callable[[Point], None], *,
               array_parallelism: int = 256) -> bool:
    """Submit already-written points (one job array per set of job parameters; a source of points is asked for
    all of them at once) and follow them, `on_end` each as it ends; False if they were left queued
    (cluster.wait=false). Ctrl-C cancels them: SweepFailed."""
    points = list(iter(points, None)) if callable(points) else points
    groups = [(params, [p.path for p in group]) for params, group in arrays(points, array_parallelism)]
    jobs = submit(groups, sweep_dir / LOGS) if points else []
    by_path = {p.path: p for p in points}
    for job in jobs:
        job.label = f"point {by_path[job.path].num}"
    log.info("sweep: %d submitted%s", len(jobs), f" as SLURM job {jobs[0].job_id.split('_')[0]}" if len(groups) == 1 else "")
    if points and not points[0].cfg.cluster.wait:
        log.info("not waiting (cluster.wait=false); see it with: python -m xtrain.status %s", sweep_dir)
        return False
    try:
        follow(jobs, lambda job, result: on_end(by_path[job.path]))
    except KeyboardInterrupt:
        cancel(jobs)
        for job in jobs:
            if rundir.read_result(job.path).get("status") in (None, rundir.Status.running):
                settle(job, "CANCELLED")
        ids = " ".join(sorted({j.job_id.split("_")[0] for j in jobs}))
        raise SweepFailed([f"cancelled SLURM job(s) {ids} (Ctrl-C); continue the sweep with run_dir={sweep_dir} "
                           "resume=auto"], 130) from None
    return True


def run_workers(worker: Callable[[str], dict], cfg: RunConfig, sweep_dir: Path, count: int,
                tick: Callable[[], None] | None = None) -> bool:
    """A study's workers: one job array of `count` tasks, each `worker(sweep_dir/workers/<i>)` in an allocation
    of `cfg`'s request, followed to their end (`tick()` every second); False if left queued (cluster.wait=false).
    Ctrl-C cancels them: SweepFailed."""
    paths = [sweep_dir / rundir.WORKERS / str(i) for i in range(count)]
    for path in paths:  # (a resumed study's: what the last array's worker recorded is not this one's)
        path.mkdir(parents=True, exist_ok=True)
        rundir.update_result(path, {"status": rundir.Status.running.value}, fresh=True)
    jobs = submit([({**job_parameters(cfg.cluster), "array_parallelism": count}, paths)], sweep_dir / LOGS, function=worker)
    for i, job in enumerate(jobs):
        job.label = f"worker {i}"
    log.info("study: %d worker(s) as SLURM job %s", count, jobs[0].job_id.split("_")[0])
    if not cfg.cluster.wait:
        log.info("not waiting (cluster.wait=false); see it with: python -m xtrain.status %s", sweep_dir)
        return False
    try:
        follow(jobs, lambda job, result: log.info("%s ended %s%s", job.label, result.get("status"),
                                                  f": {result['error']}" if result.get("error") else ""), tick=tick)
    except KeyboardInterrupt:
        cancel(jobs)
        raise SweepFailed([f"cancelled SLURM job {jobs[0].job_id.split('_')[0]} (Ctrl-C); continue the study with "
                           f"run_dir={sweep_dir} resume=auto"], 130) from None
    return True
