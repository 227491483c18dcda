"""The local backend: runs on this machine, in this process or in N worker processes under torchrun;
a sweep's points one after another in the driver, or several at once, each in a process of its own.

`python -m xtrain.backends.local RUN_DIR` trains a run dir that was written already (a parallel sweep
point). Exit 0 done, 1 failed, 2 a config error, 130 interrupted, 128+N stopped by signal N at a step
boundary (resumable).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from xtrain.config import schema
from xtrain.config.point import Point
from xtrain.config.schema import RunConfig
from xtrain.parallel import strategies
from xtrain.core import machine, rundir, runlock, stopping
from xtrain.core.errors import ConfigError, Stopped, one_line
from xtrain.launch import hardware, plan, preflight, supervisor

log = logging.getLogger("xtrain")


def resolve(cfg: RunConfig) -> RunConfig:
    """Nothing to resolve beyond `num_processes`: this machine is the cluster."""
    return cfg


def check(cfg: RunConfig) -> None:
    """Nothing beyond `preflight.preflight`: this machine is the cluster."""


def describe(cfg: RunConfig, script: bool = True) -> str:
    """A dry run: every check the real run makes (but what this machine's hardware cannot run, which the plan
    says), then the plan. Nothing is written or started."""
    preflight.check_free(cfg)
    preflight.preflight(cfg, planning=True)
    refusal = hardware.refusal(cfg) or preflight.launch_refusal(cfg)
    return plan.render(plan.for_this_machine(cfg, refusal))


def scripts(points: list[Point], sweep_dir: Path, **options) -> list[str]:
    """A sweep's job scripts (a dry run shows them): none here."""
    return []


def run(cfg: RunConfig) -> dict:
    """The CLI's single run: check, write the run dir, train (or print the plan: dry_run)."""
    if cfg.dry_run:
        print(describe(cfg))
        return {"dry_run": True}
    with runlock.holding(cfg.run_dir, take=cfg.cluster.node_rank == 0):  # (from before anything is written)
        prepared = preflight.preflight(cfg)
        prepare_data(cfg, prepared.task)  # before the run dir is written: data that cannot be prepared leaves none behind
        with preflight.taken_back_if_refused(Path(cfg.run_dir)):  # (refused by a worker before it started)
            return run_here(cfg, preflight.write_or_wait(prepared), data_ready=True)


def prepare_data(cfg: RunConfig, task=None) -> None:
    """The run's data, prepared in this process before any worker starts (or found prepared): workers only
    read it, so no rank waits in a collective while a corpus is tokenized (`task`: the run's, where it has one)."""
    from xtrain.tasks.registry import task_for

    prepared = (task or task_for(cfg)).prepare()
    if prepared is not None and not prepared.fresh:
        log.info("data: prepared on %s earlier: %s (%s)", prepared.meta["prepared_on"], prepared.describe(),
                 prepared.path)


def run_here(cfg: RunConfig, path: Path, data_ready: bool = False) -> dict:
    """Train a written run dir on this node: in this process, or N workers under torchrun. The data is prepared
    first unless `data_ready`. A run stopped on request (SIGTERM, SIGUSR1/2) at a step boundary raises `Stopped`."""
    with runlock.holding(path, take=cfg.cluster.node_rank == 0):
        return _run_here(cfg, path, data_ready)


def _run_here(cfg: RunConfig, path: Path, data_ready: bool) -> dict:
    log.info("run dir: %s", path)
    if not data_ready:
        prepare_data(cfg)
    # In-process (no spawn cost) only for DDP: Accelerate sets up FSDP and DeepSpeed only under a
    # launcher's environment; in-process it would silently drop FSDP, and DeepSpeed would look for MPI.
    if strategies.of(cfg).trains_in_process(cfg.cluster.world_size):
        from xtrain.engine.loop import train

        with stopping.on(stopping.GRACEFUL):
            result = train(path)
    else:
        log.info(
            "launching %d x %d processes (node %d), %d CPU threads each",
            cfg.cluster.nodes, cfg.cluster.processes_per_node, cfg.cluster.node_rank,
            supervisor.threads_per_process(cfg.cluster.processes_per_node),
        )
        result = supervisor.run(cfg.cluster, path)
    stop = result.get("stop") if result.get("status") == rundir.Status.interrupted else None
    if stop:
        raise Stopped(
            f"stopped by {stop['signal']} at step {stop['step']} with a checkpoint; to continue, run the same command with "
            f"run_dir={path} resume=auto", getattr(signal.Signals, stop["signal"], signal.SIGTERM),
        )
    return result


def run_recorded(cfg: RunConfig, path: Path) -> dict:
    """`run_here`, and whatever ends it is in result.json (a run that fails before training starts writes none)."""
    try:
        return run_here(cfg, path)
    except BaseException as err:
        interrupted = isinstance(err, KeyboardInterrupt) or getattr(err, "exit_code", 1) >= 128
        rundir.record_end(path, rundir.Status.interrupted if interrupted else rundir.Status.failed, one_line(err))
        raise


# ---------------------------------------------------------------- a sweep's points


def check_points(points: list[Point], *, n_jobs: int = 1, setting: str = "hydra.launcher.n_jobs") -> None:
    check_parallel(points, n_jobs, machine.visible_gpus() if n_jobs > 1 else 0, setting)


def check_parallel(points: list[Point], n_jobs: int, gpus: int, setting: str = "hydra.launcher.n_jobs") -> None:
    """With GPUs, N points at once each get gpus // N of them: refuse what would not fit (never run on fewer).
    `setting`: where N comes from (a study's is hydra.sweeper.n_jobs)."""
    if n_jobs < 1:
        raise ConfigError(f"{setting}={n_jobs}: must be >= 1")
    if n_jobs == 1 or not gpus:
        return
    if n_jobs > gpus:
        raise ConfigError(f"{setting}={n_jobs}: this machine has {gpus} GPU(s); run at most {gpus} points at once")
    for point in points:
        if point.cfg.cluster.processes_per_node > gpus // n_jobs:
            raise ConfigError(
                f"point {point.num} ({point.label}): cluster.num_processes={point.cfg.cluster.num_processes}: "
                f"with {setting}={n_jobs} each point gets {gpus // n_jobs} of the {gpus} GPUs; "
                f"set cluster.num_processes<={gpus // n_jobs} or lower {setting}"
            )


def run_points(points: list[Point] | Callable[[], Point | None], sweep_dir: Path, on_end: Callable[[Point], None], *,
               n_jobs: int = 1) -> bool:
    """Run already-written points, `on_end` each as it ends (its outcome is in its result.json). A point that
    fails is recorded and the others go on; a signal to this driver stops them (KeyboardInterrupt). `points`
    may be a source instead, asked for the next point whenever a slot is free (None: none now; a study's)."""
    if n_jobs > 1:
        log.info("%d points at a time", n_jobs)
    # What is alive now (modules, configs) lives as long as the sweep: leave it out of the collections
    # that free each point's memory after it (a full collection over it costs ~0.2 s a point)
    gc.freeze()
    take = points if callable(points) else functools.partial(next, iter(points), None)
    of = f"/{len(points)}" if hasattr(points, "__len__") else ""
    if n_jobs == 1:
        i = 0
        while (point := take()) is not None:
            i += 1
            log.info("point %d (%d%s): %s", point.num, i, of, point.label)
            try:
                run_in_driver(point)
            except Exception as err:  # recorded in its result.json; the sweep goes on, unless stopped
                if getattr(err, "exit_code", 1) >= 128:  # its workers were stopped by a signal
                    raise KeyboardInterrupt from err
            on_end(point)
    else:
        with stopping.on(stopping.GRACEFUL):
            _run_parallel(take, on_end, n_jobs)
    return True


def run_in_driver(point: Point) -> None:
    """Train the point in this process, then free what it held before the next one."""
    os.environ["XTRAIN_LAUNCH_TIME"] = str(time.time())  # its wall time and time to first step: its own
    try:
        run_recorded(point.cfg, point.path)
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


def _slots(n_jobs: int) -> list[dict]:
    """Each parallel slot's own GPUs (CUDA_VISIBLE_DEVICES) or, without GPUs, its own share of the cores."""
    ids = machine.visible_gpu_ids()
    if ids:
        return [{"gpus": share} for share in gpu_shares(ids, n_jobs)]
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // n_jobs)
    return [{"cores": cores[(i * per) % len(cores):][:per]} for i in range(n_jobs)]


def gpu_shares(ids: list[str], n_jobs: int) -> list[list[str]]:
    """This process's GPUs (their CUDA_VISIBLE_DEVICES names) split between `n_jobs` slots, equally."""
    per = len(ids) // n_jobs
    return [ids[i * per:(i + 1) * per] for i in range(n_jobs)]


def start_in_slot(point: Point, slot: dict) -> subprocess.Popen:
    """The point in a process of its own (`python -m xtrain.backends.local RUN_DIR`), pinned to its slot."""
    env = {**os.environ, "XTRAIN_LAUNCH_TIME": str(time.time())}  # its wall time and time to first step
    preexec = None
    if "gpus" in slot:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(slot["gpus"])
    else:
        env["OMP_NUM_THREADS"] = str(len(slot["cores"]))
        preexec = functools.partial(os.sched_setaffinity, 0, slot["cores"])

    log_path = point.path / rundir.LOGS / "point.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as out:
        return subprocess.Popen([sys.executable, "-m", "xtrain.backends.local", str(point.path)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=preexec, start_new_session=True)


def _run_parallel(take: Callable[[], Point | None], on_end: Callable[[Point], None], n_jobs: int) -> None:
    """Each free slot gets the next point as soon as it is free; until `take` has none and none runs."""
    free, running = _slots(n_jobs), {}
    exiting: list[subprocess.Popen] = []  # points that ended, their processes still shutting down
    forwarded = False
    try:
        while True:
            if stopping.requested() and not forwarded:  # each running point stops at a step boundary
                forwarded = True
                for proc in running:
                    proc.send_signal(signal.SIGTERM)
            more = not forwarded
            while more and free:
                point = take()
                if point is None:
                    more = False
                    break
                slot = free.pop(0)
                log.info("point %d started (%s): %s", point.num, slot, point.label)
                running[start_in_slot(point, slot)] = (point, slot)
            if not running:
                break
            time.sleep(0.05)  # a slot's idle time between points: this, and asking, composing and writing the next
            exiting = [p for p in exiting if p.poll() is None]
            for proc in [p for p in running if slot_is_free(p, *running[p])]:
                point, slot = running.pop(proc)
                if proc.returncode is not None:  # what its process did not record (killed, crashed), it could not
                    rundir.record_end(point.path, rundir.Status.failed, ended_without_record(proc.returncode))
                free.append(slot)
                exiting.append(proc)
                on_end(point)
        for proc in exiting:
            proc.wait()
        if forwarded:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        for proc, (point, _) in running.items():
            supervisor.stop_tree(proc)
            rundir.record_end(point.path, rundir.Status.interrupted, "sweep interrupted")
        raise


def slot_is_free(proc: subprocess.Popen, point: Point, slot: dict) -> bool:
    """The point's process has exited; or, on a slot of CPU cores, its run has recorded how it ended (completed,
    or pruned), and the next point need not wait the ~1.5 s of its interpreter's shutdown. A slot of GPUs waits for
    the exit: until then the process holds their memory."""
    if proc.poll() is not None:
        return True
    return "cores" in slot and rundir.read_result(point.path).get("status") in (rundir.Status.completed,
                                                                               rundir.Status.pruned)


def ended_without_record(code: int) -> str:
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"its process {how} before the run recorded an end"


def main() -> None:
    from xtrain.launch.worker import configure_logging, on_sigterm

    configure_logging()
    signal.signal(signal.SIGTERM, on_sigterm)
    path = Path(sys.argv[1])
    try:
        run_recorded(schema.load(str(path / rundir.RUN_CONFIG)), path)
    except ConfigError as err:
        print(f"xtrain: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Stopped as err:
        print(f"xtrain: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except Exception as err:
        print(f"xtrain: error: {one_line(err)}", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 1))


if __name__ == "__main__":
    main()
