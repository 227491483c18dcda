"""A sweep: many points, each a run dir under the sweep dir, placed by a backend (local or SLURM).

Every point is validated (typed config, the backend's checks, preflight) and its run dir written before
the first one starts; a point that fails while running is recorded and the sweep goes on. The sweep dir
holds `sweep.json` (its points and their overrides) and the summary files derived from the points' own
run dirs (`summary.py`), rewritten after every point. Run again with `resume=auto`, a sweep skips
completed points, continues interrupted ones from their newest checkpoint and runs the rest.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Callable

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from xtrain.backends.registry import resolve_auto
from xtrain.config import schema
from xtrain.config.point import Point
from xtrain.config.schema import TrainerConfig
from xtrain.core import owned, rundir
from xtrain.core.errors import ConfigError, SweepFailed
from xtrain.core.rundir import Status
from xtrain.engine import optim, reporting, resume
from xtrain.launch import preflight
from xtrain.sweeps import summary
from xtrain.sweeps import sweep_dir as sweep_dir_kept
from xtrain.tasks.targets import importable

log = logging.getLogger("xtrain")


def varying_keys(job_overrides: list[list[str]]) -> set[str]:
    """The keys whose value differs between points."""
    values: dict[str, set[str]] = {}
    for overrides in job_overrides:
        for item in overrides:
            key, _, value = item.partition("=")
            values.setdefault(key, set()).add(value)
    return {key for key, seen in values.items() if len(seen) > 1}


def swept_overrides(job_overrides: list[list[str]], swept_keys: set[str] = frozenset()) -> list[list[str]]:
    """Per point, the overrides of `swept_keys` and of the keys whose value differs between points (what names and
    labels a point)."""
    keys = varying_keys(job_overrides) | set(swept_keys)
    return [[o for o in overrides if o.partition("=")[0] in keys] for overrides in job_overrides]


def point_dir_name(num: int, swept: list[str]) -> str:
    """`<num>_<setting=value,...>` (the last part of each key): stable for the same sweep command, and a
    person can tell which point it is. The summary maps it to the full overrides."""
    parts = []
    for override in swept:
        key, _, value = override.partition("=")
        parts.append(f"{key.split('.')[-1]}={value}")
    text = re.sub(r"[^A-Za-z0-9=,._+-]", "_", ",".join(parts))[:80]
    return f"{num}_{text}" if text else str(num)


def plan_points(job_overrides: list[list[str]], compose: Callable[[list[str], int], tuple[dict, str | None]],
                sweep_dir: Path, first_num: int = 0, parallel: int = 1, swept_keys: set[str] = frozenset()) -> list[Point]:
    """Every point's typed config and run dir (`parallel`: points run at once, sharing this machine's GPUs;
    `swept_keys`: keys swept that may not vary in this batch of the sweep); a bad point is a ConfigError that names it."""
    points = [plan_point(first_num + i, overrides, swept, compose, sweep_dir, parallel)
              for i, (overrides, swept) in enumerate(zip(job_overrides, swept_overrides(job_overrides, swept_keys)))]
    check_apart(points)
    return points


def _below(path: Path, folder: Path) -> bool:
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    return path != folder and path.is_relative_to(folder)


def check_apart(points: list[Point], earlier: dict[Path, int] | None = None) -> None:
    """Each point has a run dir of its own (`earlier`: the dirs of an earlier batch's points, by number)."""
    seen = dict(earlier or {})
    for point in points:
        other = seen.setdefault(point.path, point.num)
        if other != point.num:
            raise ConfigError(f"hydra.sweep.subdir: points {other} and {point.num} would share the run dir {point.path}; "
                              "give each its own, e.g. hydra.sweep.subdir='${hydra.job.num}_...'")


def plan_point(num: int, overrides: list[str], swept: list[str],
               compose: Callable[[list[str], int], tuple[dict, str | None]], sweep_dir: Path, parallel: int = 1) -> Point:
    """One point's typed config, its run dir `compose` names (Hydra's `hydra.sweep.subdir`, where one is set) or
    else named by its number and `swept`; a ConfigError names it."""
    try:
        container, subdir = compose(list(overrides), num)
        if subdir is not None and not _below(sweep_dir / subdir, sweep_dir):
            raise ConfigError(f"hydra.sweep.subdir={subdir}: outside the sweep dir {sweep_dir}; give a path inside it")
        container["run_dir"] = str(sweep_dir / (subdir or point_dir_name(num, swept)))
        cfg = resolve_auto(schema.from_container(container), parallel)
    except ConfigError as err:
        raise ConfigError(f"point {num} ({' '.join(swept)}): {err}") from None
    except (HydraException, OmegaConfBaseException) as err:  # a typo, a value of the wrong type
        raise ConfigError(f"point {num} ({' '.join(swept)}): {schema.explained(err)}") from None
    try:
        check_swept_lr(swept, cfg)
    except ConfigError as err:
        raise ConfigError(f"point {num} ({' '.join(swept)}): {err}") from None
    return Point(num, swept, cfg)


def check_swept_lr(swept: list[str], cfg) -> None:
    """A sweep over `trainer.lr` where the rate is set elsewhere would train every point alike: refused."""
    swept_lr = [o for o in swept if o.partition("=")[0].lstrip("+") == "trainer.lr"]
    if not swept_lr:
        return
    importable(cfg.task.code_dir)
    unused = optim.lr_unused(cfg.trainer)
    if unused:
        setting = unused.partition("=")[0]
        raise ConfigError(f"{swept_lr[0]}: swept, but {unused}, so every point would train alike; sweep {setting} "
                          "instead, or leave it unset so that it takes trainer.lr")


def completed(path: Path, trainer: TrainerConfig) -> bool:
    """The point has run to its end: `trainer.max_steps`, or an early stop (the monitor's, or a callback's: a resumed
    sweep leaves it as it is). A
    run completed at fewer steps than `max_steps` asks now (raised with resume_changes=apply) trains on."""
    done = rundir.read_result(path)
    stopped_early = "early_stop" in done or "callback_stop" in done
    max_steps = trainer.max_steps if trainer.max_steps is not None else done.get("max_steps", 0)  # (max_epochs: the run's)
    return done.get("status") == Status.completed and (stopped_early or done.get("steps", 0) >= max_steps)


def check_same_config(point: Point) -> None:
    """A point resumed into its run dir must have the config it was started with (but for when things happen and
    where they run, and with resume_changes=apply the optimizer's settings): never mix two runs."""
    on_disk = point.path / rundir.RUN_CONFIG
    if not on_disk.exists():
        return
    now = schema.to_container(point.cfg)
    found = resume.changes(schema.to_container(schema.load(str(on_disk))), now)
    apply = point.cfg.resume_changes == "apply"
    differ = [f"{c.key}: {c.old!r} on disk vs {c.new!r} now" for c in found
              if c.trains and not (apply and resume.applicable(c.key, now))]
    if differ:
        raise ConfigError(
            f"point {point.num} ({point.label}): run_dir={point.path} holds a run with other settings "
            f"({'; '.join(differ[:3])}); resume with the same command, or choose a new run_dir"
        )


def check_point(point: Point, backend):
    """Every check of a point before its run dir is written, and what they found. A ConfigError names the point."""
    try:
        backend.check(point.cfg)
        return preflight.preflight(point.cfg)
    except ConfigError as err:
        raise ConfigError(err if str(err).startswith("point ") else f"point {point.num} ({point.label}): {err}") from None


def prepare_all(points: list[Point], sweep_dir: Path, backend) -> list[Point]:
    """Validate every point and write its run dir; the points still to run. Nothing starts if one is bad."""
    owned.check_sweep_dir(sweep_dir)
    todo = []  # (point, what its checks found)
    for point in points:
        if point.cfg.resume not in ("none", "auto"):
            raise ConfigError(f"resume={point.cfg.resume}: a sweep resumes with resume=auto (each point its own run dir)")
        try:
            if point.cfg.resume == "auto":
                check_same_config(point)
                if completed(point.path, point.cfg.trainer):
                    continue
            preflight.check_free(point.cfg)
        except ConfigError as err:
            raise ConfigError(err if str(err).startswith("point ") else f"point {point.num} ({point.label}): {err}") from None
        todo.append((point, check_point(point, backend)))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    sweep_dir_kept.keep()
    rundir.add_sweep_points(sweep_dir, points)
    for _, prepared in todo:
        preflight.write_run_dir(prepared)
    return [point for point, _ in todo]


def dry_run(points: list[Point], sweep_dir: Path, backend, **options) -> None:
    """Every point's checks and plan as the sweep would run them (and for SLURM the job arrays' scripts); nothing is
    written, asked or started."""
    owned.check_sweep_dir(sweep_dir)
    for point in points:
        try:
            if point.cfg.resume == "auto":
                check_same_config(point)
                if completed(point.path, point.cfg.trainer):
                    print(f"point {point.num} ({point.label}): completed in {point.path}; a resumed sweep skips it\n")
                    continue
            text = backend.describe(point.cfg, script=False)
        except ConfigError as err:
            raise ConfigError(err if str(err).startswith("point ") else f"point {point.num} ({point.label}): {err}") from None
        print(f"point {point.num} ({point.label}): {point.path}\n{text}\n")
    for script in backend.scripts(points, sweep_dir, **options):
        print(f"sbatch script (nothing submitted):\n{script}")
    print(f"sweep: {len(points)} points in {sweep_dir} (dry run: nothing was written or started)")
    sweep_dir_kept.restore()


def run(points: list[Point], todo: list[Point], sweep_dir: Path, backend, on_start: Callable[[Point], None] = None,
        on_end: Callable[[Point], None] = None, **options) -> bool:
    """Run the points still to do on the backend, `on_start` each as it starts (is submitted, on SLURM); after each,
    its outcome is logged, the summary rewritten and `on_end` called. SweepFailed names every point that did not
    complete (or says the sweep was interrupted). False where they were left running (cluster.wait=false)."""
    log.info("sweep: %d points in %s, %d to run", len(points), sweep_dir, len(todo))
    summary.write(sweep_dir)
    def ended(point: Point) -> None:
        report(point)
        summary.write(sweep_dir)
        if on_end:
            on_end(point)

    try:
        waited = backend.run_points(Starting(todo, on_start), sweep_dir, ended, **options)
    except KeyboardInterrupt:
        summary.write(sweep_dir)
        raise SweepFailed([f"sweep interrupted; continue it with run_dir={sweep_dir} resume=auto"], 130) from None
    except SweepFailed:
        summary.write(sweep_dir)
        raise
    if waited:
        finish(points, sweep_dir)
    return waited


class Starting:
    """The points to run as a backend asks for them (a source, with a length), `on_start` each as it is taken."""

    def __init__(self, points: list[Point], on_start: Callable[[Point], None] | None) -> None:
        self.waiting, self.on_start, self.count = iter(points), on_start, len(points)

    def __len__(self) -> int:
        return self.count

    def __call__(self) -> Point | None:
        point = next(self.waiting, None)
        if point is not None and self.on_start:
            self.on_start(point)
        return point


def finish(points: list[Point], sweep_dir: Path) -> None:
    """The sweep's outcome: SweepFailed with one line per point that did not complete."""
    failed = []
    for point in points:
        result = rundir.read_result(point.path)
        if result.get("status") != Status.completed:
            failed.append(f"point {point.num} ({point.label}) {result.get('status', 'not run')}: {result.get('error', '')}")
    if failed:
        raise SweepFailed(failed + [f"{len(failed)} of {len(points)} points failed; summary: {sweep_dir / summary.MARKDOWN}"], 1)
    log.info("sweep done: %d points; summary: %s", len(rundir.sweep_points(sweep_dir)), sweep_dir / summary.MARKDOWN)


def report(point: Point) -> None:
    result = rundir.read_result(point.path)
    if result.get("status") == Status.completed:
        log.info("point %d completed: %s (%s)", point.num, reporting.eval_text(result), point.label)
    else:
        log.info("point %d %s: %s", point.num, result.get("status", "not run"), result.get("error", ""))


def kept_score(path: Path) -> float | None:
    """What Hydra's sweepers optimise: the point's `trainer.monitor` as the model it kept scored it."""
    result = rundir.read_result(path)
    return rundir.kept_value(result, (result.get("monitor") or {}).get("name", "val_loss"))
