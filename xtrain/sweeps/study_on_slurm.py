"""A study on SLURM (`hydra/sweeper=xtrain_optuna` with `cluster=slurm`): `hydra.sweeper.n_jobs` workers as one
job array, each in an allocation of its own. A worker asks the study for a trial, composes, checks and writes
its point, trains it there (`run_node`, as any SLURM run), tells it, and asks again, until `n_trials` are
asked: a new trial starts as soon as any ends, with no barrier between workers. One worker at a time asks (a
lock file beside the journal, safe on a shared filesystem).

A trial may span nodes (`cluster.nodes` > 1): each worker's allocation is then a trial's nodes. Its first node asks
for the trials and names each in the worker dir's `current.json`; every other node trains each named trial as that
trial's node (`run_node`), until the first node says there are none left, or until the first node's process, which
beats every few seconds in the worker dir, has been silent for `SILENT_S` (it died: the others end, not wait out the
job's time limit).

A worker whose job SLURM requeues (time limit, preemption, `scontrol requeue`) continues the trial it was
running, in that trial's own run dir (named by the worker dir's `current.json`): it stays one trial. The
submitting command follows the workers and, as each worker does when it runs out of trials, writes the
summary and Optuna's pictures.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from xtrain.config.point import Point
from xtrain.core import machine, rundir
from xtrain.core.errors import ConfigError
from xtrain.core.files import write_atomic
from xtrain.sweeps.study import TOLD, Study

log = logging.getLogger("xtrain")

LOCK = "study.ask"  # beside the journal: Optuna's own open-exclusive lock, `.lock` appended
LOCK_GRACE_S = 300  # a lock held longer was left by a worker that died while asking: it is taken over
RESOLVED = ("gpus_per_node", "cpus_per_task", "num_processes")  # what the submitting machine resolved
BEAT = "first-node.beat"  # in a worker's dir whose trials span nodes: its first node's process is alive
BEAT_S = 5.0
SILENT_S = 120.0  # the other nodes' patience with a first node whose beat has not changed


def check(run: Study) -> None:
    """What a study on SLURM needs, before anything is queued: one allocation fits every trial (the space
    varies no request); a resumed study's workers are not still running."""
    from xtrain.backends.slurm.submit import check_not_running, job_parameters

    first = run.corners[0]
    for point in run.corners[1:]:
        if job_parameters(point.cfg.cluster) != job_parameters(first.cfg.cluster):
            raise ConfigError(f"the search space's corner {point.label} asks SLURM for another allocation than "
                              f"{first.label}; a study's workers share one request: sample no cluster.* setting")
    for path in sorted((run.sweep_dir / rundir.WORKERS).glob("*")):
        check_not_running(path, run.sweep_dir)


def run(study: Study) -> None:
    """The study's workers, submitted and followed to their end (unless cluster.wait=false)."""
    from xtrain.backends.slurm import backend as slurm

    cfg = study.corners[0].cfg
    study.space = replace(study.space, fixed=[*study.space.fixed,
                                              *(f"cluster.{k}={getattr(cfg.cluster, k)}" for k in RESOLVED)])
    log.info("study %s in %s (%s)", study.s.study_name, study.sweep_dir, study.s.storage)
    study.write_summary()
    count = min(study.s.n_jobs, study.s.n_trials)
    progress = StudyProgress(study)
    if slurm.run_workers(Worker(study), cfg, study.sweep_dir, count, tick=progress):
        progress.show_new()  # told since the last tick
        study.finish()
        study.outcome()


class StudyProgress:
    """On the submitting machine, every few seconds: a line for each trial the workers have told since."""

    EVERY_S = 5.0

    def __init__(self, study: Study) -> None:
        self.study, self.next = study, 0.0
        self.shown = {t.number for t in self.told()}

    def told(self) -> list:
        return [t for t in self.study.optuna.get_trials(deepcopy=False) if t.state.is_finished()]

    def __call__(self) -> None:
        if time.time() < self.next:
            return
        self.next = time.time() + self.EVERY_S
        self.show_new()

    def show_new(self) -> None:
        for trial in self.told():
            if trial.number in self.shown:
                continue
            self.shown.add(trial.number)
            if trial.state.name == "COMPLETE":
                how = f"completed: {self.study.s.objective} {trial.value:.4f}"
            elif trial.state.name == "PRUNED":
                how = f"pruned at step {max(trial.intermediate_values, default=0)}"
            else:
                how = "failed"
            log.info("trial %d %s (%s)", trial.number, how, " ".join(trial.user_attrs.get("overrides", [])))


@contextlib.contextmanager
def claiming(sweep_dir: Path):
    from optuna.storages.journal import JournalFileOpenLock

    lock = JournalFileOpenLock(str(sweep_dir / LOCK), grace_period=LOCK_GRACE_S)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


class NodeChecks:
    """A trial's checks on its worker's node, before its run dir is written: the submitting machine checked
    the request (every corner of the space) already, and run_node checks this node's GPUs."""

    @staticmethod
    def check(cfg) -> None:
        pass


class Worker:
    """One task of the workers' job array, on its node (pickled by submitit): trials until none is left."""

    def __init__(self, study: Study) -> None:
        self.settings, self.space, self.sweep_dir, self.compose = study.s, study.space, study.sweep_dir, study.compose
        self.hooks = study.hooks  # Hydra's callbacks, called here for the trials this worker runs

    def __call__(self, worker_dir: str) -> dict:
        import submitit

        from xtrain.backends import local
        from xtrain.backends.slurm.node import run_node
        from xtrain.launch.worker import configure_logging

        os.environ[machine.NODE_SIDE] = "1"
        configure_logging()
        here, index = Path(worker_dir), int(Path(worker_dir).name)
        if submitit.JobEnvironment().node:
            return trials_named(here)
        if submitit.JobEnvironment().num_nodes > 1:
            beating(here)
        study = Study(self.settings, self.space, self.sweep_dir, self.compose, NodeChecks, resume=True, hooks=self.hooks)
        study.on_slurm = True
        study.claiming = lambda: claiming(self.sweep_dir)
        study.open(worker=index + 1)
        own = self.own_trial(study, here)
        point, ran = study.starting(own) if own else study.next_point(), []
        while point is not None:
            write_atomic(here / rundir.WORKER_TRIAL, json.dumps({"job": array_job(), "restart": machine.restart_count(),
                                                                 "trial": point.num, "dir": str(point.path)}) + "\n")
            log.info("worker %d: trial %d: %s", index, point.num, point.label)
            try:
                outcome = run_node(str(point.path))
            except Exception:  # its result.json says how it failed (run_node recorded it)
                outcome = {}
            finally:
                local.release_memory()
            if outcome.get("status") in ("stopped", "interrupted"):  # this allocation ends (SLURM may requeue it)
                return {"status": "stopped", "trial": point.num}
            study.on_end(point)
            ran.append(point.num)
            point = study.next_point()
        with claiming(self.sweep_dir):
            study.finish()
        write_atomic(here / rundir.WORKER_TRIAL, json.dumps({  # (the other nodes' end; the trial it ran last)
            "job": array_job(), "restart": machine.restart_count(), "trial": ran[-1] if ran else None, "done": True}) + "\n")
        rundir.update_result(here, {"status": rundir.Status.completed.value, "trials": ran})
        return {"status": "completed", "trials": ran}

    @staticmethod
    def own_trial(study: Study, here: Path) -> Point | None:
        """After a requeue of this worker's job: the trial it was running, continued from its checkpoint (or
        told, where it had ended)."""
        try:
            record = json.loads((here / rundir.WORKER_TRIAL).read_text())
        except FileNotFoundError:
            return None
        if record["job"] != array_job() or record.get("done"):  # an earlier array's (a resumed study continues
            return None  # those trials itself), or this worker had none left
        trial = study.optuna.get_trials(deepcopy=False)[record["trial"]]
        if trial.state.name != "RUNNING":
            return None
        point = study.point_of(trial.number)
        if rundir.read_result(point.path).get("status") in TOLD:
            study.on_end(point)
            return None
        log.info("trial %d continues from its checkpoint after a requeue: %s", point.num, point.label)
        return point


def beating(here: Path):
    """The first node's beat, from a thread of its own while its process lives (or until the event returned is set):
    this attempt of the job and a count (the other nodes see it change; no clock is compared between nodes)."""
    import itertools
    import threading

    stop = threading.Event()

    def beat() -> None:
        attempt = f"{array_job()} {machine.restart_count()}"
        for count in itertools.count():
            write_atomic(here / BEAT, f"{attempt} {count}\n")
            if stop.wait(BEAT_S):
                return

    threading.Thread(target=beat, name="xtrain-first-node-beat", daemon=True).start()
    return stop


def trials_named(here: Path) -> dict:
    """A worker's node other than its first, where trials span nodes: each trial the first node names in
    `current.json` (in this attempt of the job), trained as that trial's node, until it names none, or its beat
    stops (its process died)."""
    from xtrain.backends import local
    from xtrain.backends.slurm.node import run_node

    ran: list[int] = []
    beat, heard = None, time.monotonic()
    while True:
        try:
            record = json.loads((here / rundir.WORKER_TRIAL).read_text())
        except (FileNotFoundError, ValueError):
            record = {}
        ours = record.get("job") == array_job() and record.get("restart") == machine.restart_count()
        if ours and record.get("done"):
            return {"status": "completed", "trials": ran}
        if not ours or record.get("trial") in ran:
            with contextlib.suppress(FileNotFoundError):
                if (now := (here / BEAT).read_text()) != beat:
                    beat, heard = now, time.monotonic()
            if time.monotonic() - heard > SILENT_S:
                error = (f"the first node of this worker ({here}) has not been heard from for {SILENT_S:g} s (its "
                         "process ended without saying the study is done); this node stops")
                log.error("%s", error)
                return {"status": "failed", "error": error, "trials": ran}
            time.sleep(0.5)  # (the first node is asking for the next trial, or writing it)
            continue
        try:
            outcome = run_node(record["dir"])
        except Exception:  # (the first node records how the trial failed)
            outcome = {}
        finally:
            local.release_memory()
        if outcome.get("status") in ("stopped", "interrupted"):
            return {"status": "stopped", "trial": record["trial"]}
        ran.append(record["trial"])


def array_job() -> str:
    return os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID", "")
