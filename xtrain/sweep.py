"""A sweep: many points, each a run dir under the sweep dir, run by the one launch module.

Every point is validated (typed config, preflight) and its run dir written before the first
one starts; a point that fails while running is recorded and the sweep goes on. The sweep dir
holds `sweep.json` (its points and their overrides) and the summary files derived from the
points' own run dirs (`summary.py`), rewritten after every point. Run again with
`resume=auto`, a sweep skips completed points, continues interrupted ones from their newest
checkpoint and runs the rest.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from xtrain import config, hardware, launch, run_dir as rundir, stopping, summary
from xtrain.config import ConfigError, RunConfig, SweepFailed
from xtrain.files import write_atomic

log = logging.getLogger("xtrain")

SWEEP_FILE = "sweep.json"


_sweep_dir_before: dict = {}


def note_sweep_dir(sweep_dir: Path) -> None:
    """Hydra's sweeper writes multirun.yaml into the sweep dir before any point is checked: remember what
    was there, so that a refused sweep leaves the dir as it found it (`undo_refused_sweep`)."""
    record = sweep_dir / "multirun.yaml"
    _sweep_dir_before.update(dir=sweep_dir, existed=sweep_dir.exists(),
                             record=record.read_bytes() if record.exists() else None)


def undo_refused_sweep() -> None:
    if not _sweep_dir_before:
        return
    sweep_dir, record = _sweep_dir_before["dir"], _sweep_dir_before["record"]
    if record is not None:
        (sweep_dir / "multirun.yaml").write_bytes(record)
    elif not _sweep_dir_before["existed"]:
        shutil.rmtree(sweep_dir, ignore_errors=True)
    _sweep_dir_before.clear()


@dataclass
class Point:
    num: int
    swept: list[str]  # this point's values of the settings that vary between points, as overrides
    cfg: RunConfig

    @property
    def path(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def label(self) -> str:
        return " ".join(self.swept) or "(no swept setting)"


def swept_overrides(job_overrides: list[list[str]]) -> list[list[str]]:
    """Per point, the overrides whose value differs between points (what names and labels a point)."""
    values: dict[str, set[str]] = {}
    for overrides in job_overrides:
        for item in overrides:
            key, _, value = item.partition("=")
            values.setdefault(key, set()).add(value)
    return [[o for o in overrides if len(values[o.partition("=")[0]]) > 1] for overrides in job_overrides]


def point_dir_name(num: int, swept: list[str]) -> str:
    """`<num>_<setting=value,...>` (the last part of each key): stable for the same sweep command, and a
    person can tell which point it is. The summary maps it to the full overrides."""
    parts = []
    for override in swept:
        key, _, value = override.partition("=")
        parts.append(f"{key.split('.')[-1]}={value}")
    text = re.sub(r"[^A-Za-z0-9=,._+-]", "_", ",".join(parts))[:80]
    return f"{num}_{text}" if text else str(num)


def plan_points(job_overrides: list[list[str]], compose: Callable[[list[str]], object], sweep_dir: Path,
                first_num: int = 0) -> list[Point]:
    """Every point's typed config and run dir; a bad point is a ConfigError that names it."""
    points = []
    for i, (overrides, swept) in enumerate(zip(job_overrides, swept_overrides(job_overrides))):
        num = first_num + i
        name = point_dir_name(num, swept)
        try:
            container = compose(list(overrides))
            container["run_dir"] = str(sweep_dir / name)
            cfg = hardware.resolve_processes(config.from_container(container))
        except ConfigError as err:
            raise ConfigError(f"point {num} ({' '.join(swept)}): {err}") from None
        except (HydraException, OmegaConfBaseException) as err:  # a typo, a value of the wrong type
            from xtrain.cli import explain

            raise ConfigError(f"point {num} ({' '.join(swept)}): {explain(err)}") from None
        points.append(Point(num, swept, cfg))
    return points


def completed(path: Path, cfg: RunConfig) -> bool:
    result = path / rundir.RESULT
    if not result.exists():
        return False
    done = json.loads(result.read_text())
    return done.get("status") == "completed" and done.get("steps", 0) >= cfg.trainer.max_steps


def check_same_config(point: Point) -> None:
    """A point resumed into its run dir must have the config it was started with: never mix two runs."""
    on_disk = point.path / rundir.RUN_CONFIG
    if not on_disk.exists():
        return
    old, new = config.to_container(config.load(str(on_disk))), config.to_container(point.cfg)
    differ = [f"{k}: {v!r} on disk vs {b!r} now" for k, v, b in _diff(old, new) if k not in ("resume", "dry_run")]
    if differ:
        raise ConfigError(
            f"point {point.num} ({point.label}): run_dir={point.path} holds a run with other settings "
            f"({'; '.join(differ[:3])}); resume with the same command, or choose a new run_dir"
        )


def _diff(a: dict, b: dict, prefix: str = ""):
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            yield from _diff(x, y, f"{prefix}{key}.")
        elif x != y:
            yield f"{prefix}{key}", x, y


def prepare_all(points: list[Point], sweep_dir: Path) -> list[Point]:
    """Validate every point and write its run dir; the points still to run. Nothing starts if one is bad."""
    todo = []  # (point, its model facts)
    for point in points:
        if point.cfg.resume not in ("none", "auto"):
            raise ConfigError(f"resume={point.cfg.resume}: a sweep resumes with resume=auto (each point its own run dir)")
        try:
            if point.cfg.resume == "auto":
                check_same_config(point)
                if completed(point.path, point.cfg):
                    continue
            rundir.check_free(point.cfg)
            facts = launch.preflight(point.cfg)
        except ConfigError as err:
            raise ConfigError(err if str(err).startswith("point ") else f"point {point.num} ({point.label}): {err}") from None
        todo.append((point, facts))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    # a sweeper may launch its points in several batches: this batch's points join the earlier ones
    known = {e["num"]: e for e in (summary.points(sweep_dir) if (sweep_dir / SWEEP_FILE).exists() else [])}
    known.update({p.num: {"num": p.num, "dir": p.path.name, "overrides": p.swept} for p in points})
    write_atomic(sweep_dir / SWEEP_FILE, json.dumps({"points": [known[n] for n in sorted(known)]}, indent=2) + "\n")
    for point, facts in todo:
        launch.write_run_dir(point.cfg, facts)
    return [point for point, _ in todo]


def run_in_driver(point: Point) -> None:
    """Train the point in this process, then free what it held before the next one."""
    os.environ["XTRAIN_LAUNCH_TIME"] = str(time.time())  # its wall time and time to first step: its own
    try:
        launch.run_recorded(point.cfg, point.path)
    finally:
        del os.environ["XTRAIN_LAUNCH_TIME"]
        release_memory()


def release_memory() -> None:
    import torch
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_parallel(points: list[Point], n_jobs: int, gpus: int) -> None:
    """With GPUs, N points at once each get gpus // N of them: refuse what would not fit (never run on fewer)."""
    if n_jobs < 1:
        raise ConfigError(f"hydra.launcher.n_jobs={n_jobs}: must be >= 1")
    if n_jobs == 1 or not gpus:
        return
    if n_jobs > gpus:
        raise ConfigError(f"hydra.launcher.n_jobs={n_jobs}: this machine has {gpus} GPU(s); "
                          f"run at most {gpus} points at once")
    for point in points:
        if point.cfg.cluster.processes_per_node > gpus // n_jobs:
            raise ConfigError(
                f"point {point.num} ({point.label}): cluster.num_processes={point.cfg.cluster.num_processes}: "
                f"with hydra.launcher.n_jobs={n_jobs} each point gets {gpus // n_jobs} of the {gpus} GPUs; "
                f"set cluster.num_processes<={gpus // n_jobs} or lower hydra.launcher.n_jobs"
            )


def _slots(n_jobs: int) -> list[dict]:
    """Each parallel slot's own GPUs (CUDA_VISIBLE_DEVICES) or, without GPUs, its own share of the cores."""
    gpus = hardware.visible_gpus()
    if gpus:
        per = gpus // n_jobs
        return [{"gpus": list(range(i * per, (i + 1) * per))} for i in range(n_jobs)]
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // n_jobs)
    return [{"cores": cores[(i * per) % len(cores):][:per]} for i in range(n_jobs)]


def start_in_slot(point: Point, slot: dict) -> subprocess.Popen:
    """The point in a process of its own (`python -m xtrain.launch RUN_DIR`), pinned to its slot."""
    env = {k: v for k, v in os.environ.items() if k != "XTRAIN_LAUNCH_TIME"}
    preexec = None
    if "gpus" in slot:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slot["gpus"]))
    else:
        env["OMP_NUM_THREADS"] = str(len(slot["cores"]))
        cores = slot["cores"]

        def preexec():
            os.sched_setaffinity(0, cores)

    log_path = point.path / "logs" / "point.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as out:
        return subprocess.Popen([sys.executable, "-m", "xtrain.launch", str(point.path)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=preexec, start_new_session=True)


def run_all(points: list[Point], todo: list[Point], sweep_dir: Path, n_jobs: int) -> None:
    """Run the points still to do; every outcome lands in the point's result.json and the summary."""
    log.info("sweep: %d points in %s, %d to run%s", len(points), sweep_dir, len(todo),
             f", {n_jobs} at a time" if n_jobs > 1 else "")
    summary.write(sweep_dir)
    # What is alive now (modules, configs) lives as long as the sweep: leave it out of the collections
    # that free each point's memory after it (a full collection over it costs ~0.2 s a point)
    gc.freeze()
    try:
        if n_jobs == 1:
            for i, point in enumerate(todo, 1):
                log.info("point %d (%d/%d): %s", point.num, i, len(todo), point.label)
                try:
                    run_in_driver(point)
                except Exception as err:  # recorded in its result.json; the sweep goes on, unless stopped
                    if getattr(err, "exit_code", 1) >= 128:  # its workers were stopped by a signal
                        raise KeyboardInterrupt from err
                report(point)
                summary.write(sweep_dir)
        else:
            with stopping.on(stopping.GRACEFUL):
                _run_parallel(todo, sweep_dir, n_jobs)
    except KeyboardInterrupt:
        summary.write(sweep_dir)
        raise SweepFailed([f"sweep interrupted; continue it with run_dir={sweep_dir} resume=auto"], 130) from None
    finish(points, sweep_dir)


def finish(points: list[Point], sweep_dir: Path) -> None:
    """The sweep's outcome: SweepFailed with one line per point that did not complete."""
    failed = []
    for point in points:
        result = _result(point.path)
        if result.get("status") != "completed":
            failed.append(f"point {point.num} ({point.label}) {result.get('status', 'not run')}: {result.get('error', '')}")
    if failed:
        raise SweepFailed(failed + [f"{len(failed)} of {len(points)} points failed; summary: {sweep_dir / summary.MARKDOWN}"], 1)
    log.info("sweep done: %d points; summary: %s", len(points), sweep_dir / summary.MARKDOWN)


def _run_parallel(todo: list[Point], sweep_dir: Path, n_jobs: int) -> None:
    from xtrain.multiprocess import stop_tree

    queue, free, running = list(todo), _slots(n_jobs), {}
    forwarded = False
    try:
        while queue or running:
            if stopping.requested() and not forwarded:  # each running point stops at a step boundary
                queue, forwarded = [], True
                for proc in running:
                    proc.send_signal(signal.SIGTERM)
            while queue and free:
                point, slot = queue.pop(0), free.pop(0)
                log.info("point %d started (%s): %s", point.num, slot, point.label)
                running[start_in_slot(point, slot)] = (point, slot)
            time.sleep(0.2)
            for proc in [p for p in running if p.poll() is not None]:
                point, slot = running.pop(proc)
                free.append(slot)
                report(point)
                summary.write(sweep_dir)
        if forwarded:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        for proc, (point, _) in running.items():
            stop_tree(proc)
            rundir.record_end(point.path, "interrupted", "sweep interrupted")
        raise


def _result(path: Path) -> dict:
    try:
        return json.loads((path / rundir.RESULT).read_text())
    except FileNotFoundError:
        return {}


def report(point: Point) -> None:
    result = _result(point.path)
    if result.get("status") == "completed":
        log.info("point %d completed: val loss %.4f (%s)", point.num, result["val_loss"], point.label)
    else:
        log.info("point %d %s: %s", point.num, result.get("status", "not run"), result.get("error", ""))


def final_val_loss(path: Path) -> float | None:
    """What Hydra's sweepers optimise: the point's final val loss."""
    return _result(path).get("val_loss")
