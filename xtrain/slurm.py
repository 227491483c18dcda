"""cluster=slurm: check a run against the cluster, submit it (a sweep: one job array), follow it to its end.

The submitting machine validates every run and writes its run dir with run.yaml; only then does
submitit submit it. Each node runs one task, `run_node`: it takes its topology from SLURM (node
rank, the allocation's first node as rendezvous, a port derived from the job id) and runs that
node's workers through the launch module, as a local multi-process run does. SLURM's output and
the submitted sbatch script go to `logs/` (a sweep's: the sweep dir's `logs/`); the job's id is
in the run dir's `slurm.json`. The submitting command follows the job (its states, rank 0's
lines) and ends with the run's own outcome.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from xtrain import run_dir as rundir
from xtrain.config import ClusterConfig, ConfigError, RunConfig, time_limit_minutes
from xtrain.files import write_atomic

log = logging.getLogger("xtrain")

SLURM_FILE = "slurm.json"
LOGS = "logs"
POLL_S = 0.5
PORT_BASE, PORT_SPAN = 20000, 10000  # rendezvous ports: below Linux's ephemeral range
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"}
ENDED_AS = {"COMPLETED": "completed", "CANCELLED": "cancelled", "TIMEOUT": "timeout", "PREEMPTED": "interrupted"}


# ---------------------------------------------------------------- checks on the submitting machine


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    gpus_per_node: int
    default: bool


def _query(args: list[str]) -> str:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        first = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}").splitlines()[0]
        raise ConfigError(f"cluster=slurm: `{' '.join(args[:2])}` failed: {first}")
    return proc.stdout


@functools.lru_cache(maxsize=1)
def partitions() -> dict[str, Partition]:
    """The cluster's partitions, from sinfo (one query per process)."""
    found: dict[str, Partition] = {}
    for line in _query(["sinfo", "-h", "-o", "%P|%D|%G"]).splitlines():
        name, nodes, gres = line.split("|")
        default = name.endswith("*")
        name = name.rstrip("*")
        gpus = max((int(n) for n in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres)), default=0)
        before = found.get(name)
        if before:  # one line per kind of node: add the nodes up, keep the largest GPU count
            found[name] = Partition(name, before.nodes + int(nodes), max(before.gpus_per_node, gpus), default)
        else:
            found[name] = Partition(name, int(nodes), gpus, default)
    return found


def check(cfg: RunConfig) -> None:
    """What the submitting machine can know about the request: SLURM is here, the partition has the nodes."""
    c = cfg.cluster
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "cluster=slurm: sbatch is not on PATH; submit from a SLURM login node (load its module first), "
            "or use cluster=local"
        )
    found = partitions()
    if c.partition is None:
        default = [p for p in found.values() if p.default]
        if not default:
            raise ConfigError(f"cluster.partition is empty and this cluster has no default partition; "
                              f"choose one of {', '.join(sorted(found))}")
        part = default[0]
    elif c.partition not in found:
        raise ConfigError(f"cluster.partition={c.partition}: no such partition; this cluster has "
                          f"{', '.join(sorted(found))}")
    else:
        part = found[c.partition]
    if c.nodes > part.nodes:
        raise ConfigError(f"cluster.nodes={c.nodes}: partition {part.name} has {part.nodes} node(s); "
                          f"use cluster.nodes<={part.nodes}")
    job = recorded_job(Path(cfg.run_dir))
    if job is not None:
        live = live_states([job.job_id])
        if job.job_id in live:
            raise ConfigError(f"run_dir={cfg.run_dir}: SLURM job {job.job_id} is still {describe(*live[job.job_id])} "
                              f"there; wait for it (python -m xtrain.status {cfg.run_dir}) or scancel {job.job_id}")
    if c.gpus_per_node > part.gpus_per_node:
        raise ConfigError(f"cluster.gpus_per_node={c.gpus_per_node}: the nodes of partition {part.name} have "
                          f"{part.gpus_per_node} GPU(s); use cluster.gpus_per_node<={part.gpus_per_node}")


# ---------------------------------------------------------------- the job


def srun_arguments(c: ClusterConfig) -> list[str]:
    """One task per node; a task that fails ends the others at once (not at the collective timeout)."""
    args = ["--kill-on-bad-exit=1"]
    if c.container_image:
        args.append(f"--container-image={c.container_image}")
        if c.container_mounts:
            args.append(f"--container-mounts={c.container_mounts}")
    return args + list(c.srun_args)


def job_parameters(cfg: RunConfig) -> dict:
    """submitit's SlurmExecutor parameters for this run (the #SBATCH lines, the setup, the srun line)."""
    from submitit.slurm.slurm import _convert_mem

    c = cfg.cluster
    params: dict = {
        "job_name": c.job_name, "nodes": c.nodes, "ntasks_per_node": 1, "time": time_limit_minutes(c.time_limit),
        "setup": list(c.setup), "srun_args": srun_arguments(c), "stderr_to_stdout": True,
        # --signal=USR2@lead: the warning before the time limit; --requeue: SLURM may requeue the job
        # (scontrol requeue, a node failure), and so may the job itself, after a warning
        "signal_delay_s": c.signal_lead_s, "additional_parameters": {"requeue": True, **c.sbatch_args},
    }
    for name in ("partition", "account", "qos", "constraint", "exclude", "cpus_per_task"):
        if getattr(c, name) is not None:
            params[name] = getattr(c, name)
    if c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    if c.mem_gb is not None:
        params["mem"] = _convert_mem(c.mem_gb)
    return params


def executor(folder: Path, params: dict):
    import submitit

    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
    ex.update_parameters(**params)
    return ex


def sbatch_script(cfg: RunConfig, folder: Path) -> str:
    """The script `submit` would hand to sbatch (for dry_run)."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = f"{sys.executable} -u -m submitit.core._submit {folder}"
    return _make_sbatch_string(command=command, folder=folder, **job_parameters(cfg))


@dataclass
class Job:
    job_id: str
    path: Path  # its run dir
    log: Path  # the output of its first node's task (rank 0's lines)
    label: str = ""


def _sbatch_refusal(err: Exception) -> ConfigError:
    """submitit's error for a failed sbatch call → sbatch's own message, one line."""
    text = str(err)
    lines = list(dict.fromkeys(line.split("sbatch: error:", 1)[1].strip() for line in text.splitlines()
                               if "sbatch: error:" in line))
    message = "; ".join(lines) if lines else " ".join(text.split())[:300]
    return ConfigError(f"cluster=slurm: sbatch refused the job: {message}")


def submit(groups: list[tuple[dict, list[Path]]], folder: Path) -> list[Job]:
    """Submit each group of run dirs (same job parameters) as one job, or one job array; record the ids."""
    from submitit.core.utils import FailedJobError

    jobs = []
    for params, paths in groups:
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # submitit repeats sbatch's complaint there
                submitted = executor(folder, params).map_array(run_node, [str(p) for p in paths])
        except (FailedJobError, subprocess.CalledProcessError) as err:
            cancel(jobs)  # a sweep's earlier arrays: all of it is queued, or none
            raise _sbatch_refusal(err) from None
        for job, path in zip(submitted, paths):
            out = Job(job.job_id, path, folder / f"{job.job_id}_0_log.out")
            script = next(iter(folder.glob(f"{job.job_id.split('_')[0]}_*submission.sh")), None)
            write_atomic(path / SLURM_FILE, json.dumps({
                "job_id": job.job_id, "log": str(out.log), "script": str(script) if script else None,
                "submitted": time.time(),
            }, indent=2) + "\n")
            jobs.append(out)
    return jobs


def recorded_job(path: Path) -> Job | None:
    try:
        entry = json.loads((path / SLURM_FILE).read_text())
    except FileNotFoundError:
        return None
    return Job(entry["job_id"], path, Path(entry["log"]))


# ---------------------------------------------------------------- on every node


def rendezvous_port(job_id: str) -> int:
    return PORT_BASE + int(job_id) % PORT_SPAN


def node_topology(cfg: RunConfig) -> RunConfig:
    """This node's place in the job, from SLURM: node rank, the first node as rendezvous, the job's port."""
    import submitit

    env = submitit.JobEnvironment()
    cluster = replace(cfg.cluster, node_rank=env.node, main_process_ip=env.hostnames[0],
                      main_process_port=rendezvous_port(os.environ["SLURM_JOB_ID"]))
    return replace(cfg, cluster=cluster)


def run_node(run_dir: str) -> dict:
    """One node's task: its workers train the prepared run dir. Runs in submitit's process on the node.

    A stop signal (SLURM's warning before the time limit, `scancel --signal=USR2`) ends training at a step
    boundary with a checkpoint on every node; node 0 then requeues the job, which resumes in the same run
    dir (trainer.resume_setting). A job requeued without warning resumes from its newest checkpoint."""
    import logging.config
    from importlib.resources import files

    import yaml

    from xtrain import config, hardware, launch, stopping
    from xtrain.multiprocess import LaunchFailed, threads_per_process

    logging.config.dictConfig(yaml.safe_load((files("xtrain.conf") / "hydra/job_logging/xtrain.yaml").read_text()))
    logging.getLogger("submitit").propagate = False  # it has a handler of its own
    path = Path(run_dir)
    cfg = node_topology(config.load(str(path / rundir.RUN_CONFIG)))
    first = cfg.cluster.node_rank == 0
    if first:
        log.info("job %s on %s; rendezvous %s:%d%s", os.environ.get("SLURM_JOB_ID"),
                 os.environ.get("SLURM_JOB_NODELIST"), cfg.cluster.main_process_ip, cfg.cluster.main_process_port,
                 f"; restart {restart_count()}" if restart_count() else "")
    # from here on, submitit's own handlers (requeue at once, with no checkpoint) are replaced; a warning
    # that comes after the run ended is ignored (not the default action, which ends the task: FAILED)
    for signum in stopping.IN_WORKERS:
        signal.signal(signum, signal.SIG_IGN)
    with stopping.on(stopping.GRACEFUL):
        try:
            import torch

            torch.set_num_threads(threads_per_process(cfg.cluster.processes_per_node))  # the cores SLURM gave
            hardware.check(cfg)  # this node's own GPUs
            return (launch.run_recorded if first else launch.run)(cfg, path)
        except stopping.Stopped:
            if first:
                requeue_or_end(cfg, path)
            return {"status": "stopped"}
        except LaunchFailed as err:
            if err.exit_code < 128:
                raise
            log.info("%s", err)  # SLURM ended this allocation (scancel, scontrol requeue): no traceback
            return {"status": "interrupted"}
        except ConfigError as err:
            if first:
                rundir.record_end(path, "failed", str(err))
            raise


def restart_count() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def requeue_or_end(cfg: RunConfig, path: Path) -> None:
    """After a stop at a step boundary (every rank has saved): requeue this job, unless it has been
    restarted `cluster.max_requeues` times already; then the run ends `interrupted`, resumable by hand.
    After SIGTERM, SLURM's own way of ending a job, what happens next is SLURM's (it may requeue it)."""
    import submitit

    result = json.loads((path / rundir.RESULT).read_text())
    stop, limit, restarts = result["stop"], cfg.cluster.max_requeues, restart_count()
    stopped = f"stopped by {stop['signal']} at step {stop['step']} with a checkpoint"
    if stop["signal"] == "SIGTERM":  # SLURM itself is ending the job (scancel, scontrol requeue, time limit)
        log.info("%s; SLURM is ending the job", stopped)
        return
    if restarts >= limit:
        result["error"] = (f"{stopped}; not requeued: the job has been restarted {restarts} time(s), "
                           f"cluster.max_requeues={limit}; continue with run_dir={path} resume=auto")
        rundir.write_result(path, result)
        log.info("%s", result["error"])
        return
    job_id = submitit.JobEnvironment().job_id  # <array>_<task> for a point of a sweep
    result.update(status="requeued", error=f"{stopped}; requeued (restart {restarts + 1} of at most {limit})")
    rundir.write_result(path, result)
    log.info("%s: requeueing SLURM job %s", stopped, job_id)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # SLURM ends this allocation's processes as it requeues
    _query(["scontrol", "requeue", job_id])


# ---------------------------------------------------------------- following jobs from the submitting machine


def live_states(job_ids: list[str]) -> dict[str, tuple[str, str, str]]:
    """Jobs SLURM still holds: id → (state, reason, nodes)."""
    if not job_ids:
        return {}
    masters = sorted({j.split("_")[0] for j in job_ids})
    proc = subprocess.run(["squeue", "-h", "-r", "-j", ",".join(masters), "-o", "%i|%T|%r|%N"],
                          capture_output=True, text=True)
    states = {}
    for line in proc.stdout.splitlines():
        job_id, state, reason, nodes = line.split("|")
        states[job_id] = (state, reason, nodes)
    return states


def final_states(job_ids: list[str]) -> dict[str, str]:
    """Accounting's state of jobs (e.g. COMPLETED, FAILED, CANCELLED, TIMEOUT); sacct lags a few seconds."""
    if not job_ids:
        return {}
    masters = sorted({j.split("_")[0] for j in job_ids})
    proc = subprocess.run(["sacct", "-n", "-P", "-X", "-j", ",".join(masters), "-o", "JobID,State"],
                          capture_output=True, text=True)
    states = {}
    for line in proc.stdout.splitlines():
        job_id, state = line.split("|")
        states[job_id] = state.split()[0] if state else ""
    return states


def job_state(job: Job) -> str:
    """Where a recorded job stands now (for xtrain.status)."""
    live = live_states([job.job_id])
    if job.job_id in live:
        state, reason, nodes = live[job.job_id]
        return describe(state, reason, nodes)
    return final_states([job.job_id]).get(job.job_id, "unknown")


def describe(state: str, reason: str, nodes: str) -> str:
    if state == "PENDING":
        return f"PENDING ({reason})" if reason not in ("None", "") else "PENDING"
    if state == "RUNNING":
        return f"RUNNING on {nodes}"
    return state


def settle(job: Job, state: str) -> dict:
    """A job that ended: its run's result.json says how, even where no rank could write it."""
    path = job.path
    result = json.loads((path / rundir.RESULT).read_text()) if (path / rundir.RESULT).exists() else {}
    if result.get("status") == "completed":  # the run's own record: a task ending badly after it does not undo it
        if state != "COMPLETED":
            result = {**result, "slurm_state": state}
            rundir.write_result(path, result)
        return result
    if state == "COMPLETED" and result.get("stop"):
        return result  # stopped on request with a checkpoint and not requeued (cluster.max_requeues)
    status = ENDED_AS.get(state, "failed")
    if status == "completed":  # the job ended well, yet the run has no result: nothing trained
        status = "failed"
    if status == "failed" and result.get("status") == "failed":
        error = result["error"]
    else:
        error = _first_rank_error(path) if status == "failed" else None
        error = error or {
            "cancelled": f"SLURM job {job.job_id} was cancelled",
            "timeout": f"SLURM job {job.job_id} reached its time limit (cluster.time_limit)",
            "interrupted": f"SLURM job {job.job_id} was preempted",
        }.get(status, f"SLURM job {job.job_id} ended {state} (its output: {job.log})")
    result = {**result, "status": status, "error": error, "slurm_state": state}
    rundir.write_result(path, result)
    return result


def _first_rank_error(path: Path) -> str | None:
    from xtrain.multiprocess import first_error

    error = first_error(path)
    return f"rank {error['rank']}: {error['summary']}" if error else None


def follow(jobs: list[Job], on_end: Callable[[Job, dict], None], tail: Path | None = None) -> None:
    """Until every job has ended: log state changes (and rank 0's lines from `tail`), `on_end` each job."""
    waiting = {j.job_id: j for j in jobs}
    shown: dict[str, str] = {}
    offset = 0
    unseen_since: dict[str, float] = {}
    while waiting:
        live = live_states(list(waiting))
        gone = [j for j in waiting if j not in live]
        ended = final_states(gone) if gone else {}
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
                if tail is not None:
                    offset = _echo_new_lines(tail, offset)
                del waiting[job_id]
                on_end(job, settle(job, text))
        if tail is not None:
            offset = _echo_new_lines(tail, offset)
        if waiting:
            time.sleep(POLL_S)


def _echo_new_lines(path: Path, offset: int) -> int:
    """Whole lines added to `path` since `offset`, to this terminal."""
    try:
        if path.stat().st_size < offset:  # written anew (a requeued job's output, where not appended)
            offset = 0
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    end = data.rfind(b"\n") + 1
    lines = [line for line in data[:end].decode(errors="replace").splitlines(keepends=True)
             if not line.startswith("submitit ")]  # submitit's own bookkeeping
    if lines:
        sys.stdout.write("".join(lines))
        sys.stdout.flush()
    return offset + end


def cancel(jobs: list[Job]) -> None:
    """scancel, then wait (a little) until SLURM has ended them."""
    ids = [j.job_id for j in jobs]
    if not ids:
        return
    subprocess.run(["scancel", *ids], capture_output=True)
    deadline = time.time() + 30
    while live_states(ids) and time.time() < deadline:
        time.sleep(POLL_S)


# ---------------------------------------------------------------- a single run


def launch(cfg: RunConfig) -> dict:
    """`python -m xtrain cluster=slurm ...`: check, write the run dir, submit one job, follow it."""
    from xtrain import hardware, launch as local, plan
    from xtrain.multiprocess import LaunchFailed

    facts = local.preflight(cfg)
    folder = Path(cfg.run_dir) / LOGS
    if cfg.dry_run:
        print(plan.render(plan.make(cfg, hardware.refusal(cfg), cfg.cluster.gpu_memory_gb)))
        print(f"\nsbatch script (nothing submitted):\n{sbatch_script(cfg, folder)}")
        return {"dry_run": True}
    path = local.write_run_dir(cfg, facts)
    [job] = submit([(job_parameters(cfg), [path])], folder)
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
        from xtrain.stopping import Stopped

        raise Stopped(result["error"], getattr(signal.Signals, result["stop"]["signal"], signal.SIGTERM))
    raise LaunchFailed(f"{result['error']}; its checkpoints stay: continue with run_dir={path} resume=auto", 1)


def _show_failing_rank(path: Path) -> None:
    from xtrain.multiprocess import first_error

    error = first_error(path)
    if error and not error["diverged"] and not error["config_error"]:
        sys.stderr.write(error["traceback"])


# ---------------------------------------------------------------- a sweep: one job array


def run_sweep(points: list, todo: list, sweep_dir: Path, array_parallelism: int) -> None:
    """Submit the points still to run (one array per set of job parameters), follow them, summarize."""
    from xtrain import summary, sweep
    from xtrain.config import SweepFailed

    groups: dict[str, tuple[dict, list[Path]]] = {}
    for point in todo:
        params = {**job_parameters(point.cfg), "array_parallelism": array_parallelism}
        groups.setdefault(json.dumps(params, sort_keys=True), (params, []))[1].append(point.path)
    summary.write(sweep_dir)
    jobs = submit(list(groups.values()), sweep_dir / LOGS) if todo else []
    by_path = {p.path: p for p in todo}
    for job in jobs:
        job.label = f"point {by_path[job.path].num}"
    log.info("sweep: %d points in %s, %d submitted%s", len(points), sweep_dir, len(jobs),
             f" as SLURM job {jobs[0].job_id.split('_')[0]}" if len(groups) == 1 else "")
    if todo and not todo[0].cfg.cluster.wait:
        log.info("not waiting (cluster.wait=false); see it with: python -m xtrain.status %s", sweep_dir)
        return

    def on_end(job: Job, result: dict) -> None:
        sweep.report(by_path[job.path])
        summary.write(sweep_dir)

    try:
        follow(jobs, on_end)
    except KeyboardInterrupt:
        cancel(jobs)
        for job in jobs:
            result = json.loads((job.path / rundir.RESULT).read_text()) if (job.path / rundir.RESULT).exists() else {}
            if result.get("status") in (None, "running"):
                settle(job, "CANCELLED")
        summary.write(sweep_dir)
        ids = " ".join(sorted({j.job_id.split("_")[0] for j in jobs}))
        raise SweepFailed([f"cancelled SLURM job(s) {ids} (Ctrl-C); continue the sweep with run_dir={sweep_dir} "
                           "resume=auto"], 130) from None
    sweep.finish(points, sweep_dir)
