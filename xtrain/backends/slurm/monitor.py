"""Following SLURM jobs from the submitting machine: their states (squeue, then sacct), rank 0's output,
cancelling them, and settling a job that ended into its run's result.json.

Also the one helper that runs a SLURM command (`query`) and the job record each run dir keeps (`slurm.json`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from xtrain.core import rundir
from xtrain.core.errors import ConfigError
from xtrain.core.rundir import SLURM_FILE, Status

log = logging.getLogger("xtrain")

# How often the follower asks SLURM (squeue, then sacct for jobs that left the queue): often while a job is
# queued or starting, and as it ends (its result.json changed); seldom while it runs. Rank 0's lines reach
# the terminal every TICK_S, from the log file, without asking SLURM.
POLL_STARTING_S = 2.0
POLL_RUNNING_S = 20.0
TICK_S = 1.0
HEAD_BYTES = 256  # of an output file, to tell it was written anew
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"}
ENDING = {Status.completed, Status.failed, Status.interrupted, Status.requeued}  # the run says its job ends
ENDED_AS = {"COMPLETED": Status.completed, "CANCELLED": Status.cancelled, "TIMEOUT": Status.timeout,
            "PREEMPTED": Status.interrupted}


def query(args: list[str]) -> str:
    """A SLURM command's output; a failure is a ConfigError with its first line."""
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        first = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}").splitlines()[0]
        raise ConfigError(f"cluster=slurm: `{' '.join(args[:2])}` failed: {first}")
    return proc.stdout


@dataclass
class Job:
    job_id: str
    path: Path  # its run dir
    log: Path  # the output of its first node's task (rank 0's lines)
    label: str = ""


def recorded_job(path: Path) -> Job | None:
    try:
        entry = json.loads((path / SLURM_FILE).read_text())
    except FileNotFoundError:
        return None
    return Job(entry["job_id"], path, Path(entry["log"]))


class Unreachable(Exception):
    """squeue or sacct failed (the controller or the accounting daemon is away): the jobs' state is unknown."""


def _ask(args: list[str]) -> str:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        first = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}").splitlines()[0]
        raise Unreachable(f"{args[0]}: {first}")
    return proc.stdout


def live_states(job_ids: list[str]) -> dict[str, tuple[str, str, str]]:
    """Jobs SLURM still holds: id → (state, reason, nodes). Unreachable where squeue fails."""
    if not job_ids:
        return {}
    masters = sorted({j.split("_")[0] for j in job_ids})
    out = _ask(["squeue", "-h", "-r", "-j", ",".join(masters), "-o", "%i|%T|%r|%N"])
    states = {}
    for line in out.splitlines():
        job_id, state, reason, nodes = line.split("|")
        states[job_id] = (state, reason, nodes)
    return states


def final_states(job_ids: list[str]) -> dict[str, str]:
    """Accounting's state of jobs (e.g. COMPLETED, FAILED, CANCELLED, TIMEOUT); sacct lags a few seconds.
    Unreachable where sacct fails."""
    if not job_ids:
        return {}
    masters = sorted({j.split("_")[0] for j in job_ids})
    out = _ask(["sacct", "-n", "-P", "-X", "-j", ",".join(masters), "-o", "JobID,State"])
    states = {}
    for line in out.splitlines():
        job_id, state = line.split("|")
        states[job_id] = state.split()[0] if state else ""
    return states


def job_state(job: Job) -> str:
    """Where a recorded job stands now (for xtrain.status)."""
    try:
        live = live_states([job.job_id])
        if job.job_id in live:
            return describe(*live[job.job_id])
        return final_states([job.job_id]).get(job.job_id, "unknown")
    except Unreachable as err:
        return f"unknown: SLURM does not answer ({err})"


def describe(state: str, reason: str, nodes: str) -> str:
    if state == "PENDING":
        return f"PENDING ({reason})" if reason not in ("None", "") else "PENDING"
    if state == "RUNNING":
        return f"RUNNING on {nodes}"
    return state


def settle(job: Job, state: str) -> dict:
    """A job that ended: its run's result.json says how, even where no rank could write it."""
    path = job.path
    result = rundir.read_result(path)
    if result.get("status") == Status.completed:  # the run's own record: a task ending badly after it does not undo it
        if state != "COMPLETED":
            log.info("slurm job %s: its run had completed (result.json) before SLURM ended it %s", job.job_id, state)
            result = rundir.update_result(path, {"slurm_state": state})
        return result
    if state == "COMPLETED" and result.get("stop"):
        return result  # stopped on request with a checkpoint and not requeued (cluster.max_requeues)
    status = ENDED_AS.get(state, Status.failed)
    if status is Status.completed:  # the job ended well, yet the run has no result: nothing trained
        status = Status.failed
    if status is Status.failed and result.get("status") == Status.failed:
        error = result["error"]
    else:
        first = rundir.first_rank_error(path) if status is Status.failed else None
        error = f"rank {first['rank']}: {first['summary']}" if first else {
            Status.cancelled: f"SLURM job {job.job_id} was cancelled",
            Status.timeout: f"SLURM job {job.job_id} reached its time limit (cluster.time_limit)",
            Status.interrupted: f"SLURM job {job.job_id} was preempted",
        }.get(status, f"SLURM job {job.job_id} ended {state} (its output: {job.log})")
    return rundir.update_result(path, {"status": status.value, "error": error, "slurm_state": state})


def follow(jobs: list[Job], on_end: Callable[[Job, dict], None], tail: Path | None = None,
           tick: Callable[[], None] | None = None) -> None:
    """Until every job has ended: log state changes (and rank 0's lines from `tail`), `on_end` each job,
    `tick()` every TICK_S. A controller that does not answer leaves the jobs' state unknown, never ended:
    one line says so."""
    waiting = {j.job_id: j for j in jobs}
    shown: dict[str, str] = {}
    echo = Tail(tail) if tail is not None else None
    unseen_since: dict[str, float] = {}
    away: str | None = None  # why SLURM does not answer, while it does not
    marks = {job_id: _mark(job) for job_id, job in waiting.items()}
    next_ask = 0.0
    while waiting:
        now = {job_id: _mark(job) for job_id, job in waiting.items()}
        if time.time() >= next_ask or now != {k: marks[k] for k in now}:  # (a run that writes result.json ends soon)
            marks.update(now)
            try:
                live = live_states(list(waiting))
                gone = [j for j in waiting if j not in live]
                ended = final_states(gone) if gone else {}
            except Unreachable as err:
                if away is None:
                    log.info("slurm: %s; the job's state is unknown, still following it", err)
                away = str(err)
                next_ask = time.time() + POLL_STARTING_S
                live = None
            if live is not None:
                if away is not None:
                    log.info("slurm: answering again")
                    away = None
                for job_id, job in list(waiting.items()):
                    if job_id in live:
                        text = describe(*live[job_id])
                    elif ended.get(job_id, "PENDING") not in ACTIVE:
                        text = ended[job_id]
                    else:  # left the queue, not yet in accounting: sacct lags
                        unseen_since.setdefault(job_id, time.time())
                        if time.time() - unseen_since[job_id] < 60:
                            continue
                        text = "UNKNOWN"
                    if shown.get(job_id) != text:
                        shown[job_id] = text
                        log.info("slurm job %s%s: %s", job_id, f" ({job.label})" if job.label else "", text)
                    if job_id not in live:
                        if echo is not None:
                            echo.echo_new_lines()
                        del waiting[job_id]
                        on_end(job, settle(job, text))
                steady = (live and all(state == "RUNNING" for state, _, _ in live.values()) and not unseen_since
                          and not any(rundir.read_result(job.path).get("status") in ENDING for job in waiting.values()))
                next_ask = time.time() + (POLL_RUNNING_S if steady else POLL_STARTING_S)
        if echo is not None:
            echo.echo_new_lines()
        if tick is not None:
            tick()
        if waiting:
            time.sleep(TICK_S)


def _mark(job: Job) -> float | None:
    """When the job's run last wrote its result.json (it does as it starts, stops and ends)."""
    try:
        return (job.path / rundir.RESULT).stat().st_mtime
    except FileNotFoundError:
        return None


@dataclass
class Tail:
    """Where the echo of a job's output file stands. A requeued job's output is written anew (SLURM truncates
    it): its first bytes then differ from those seen, even where it has grown past the old end between looks."""

    path: Path
    offset: int = 0
    head: bytes = b""

    def echo_new_lines(self) -> None:
        """Whole lines added since the last look, to this terminal."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(HEAD_BYTES)
                common = min(len(head), len(self.head))
                if os.fstat(f.fileno()).st_size < self.offset or head[:common] != self.head[:common]:
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.head = head
        end = data.rfind(b"\n") + 1
        lines = [line for line in data[:end].decode(errors="replace").splitlines(keepends=True)
                 if not line.startswith("submitit ")]  # submitit's own bookkeeping
        if lines:
            sys.stdout.write("".join(lines))
            sys.stdout.flush()
        self.offset += end


def cancel(jobs: list[Job]) -> None:
    """scancel, then wait (a little) until SLURM has ended them."""
    ids = [j.job_id for j in jobs]
    if not ids:
        return
    subprocess.run(["scancel", *ids], capture_output=True)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if not live_states(ids):
                return
        except Unreachable:
            return
        time.sleep(0.5)
