"""Submitting to SLURM: what the submitting machine checks (SLURM is here, the partition has the nodes),
the job's parameters and sbatch script (through submitit), and the submission, recorded in each run dir.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from xtrain.backends.slurm.monitor import Job, Unreachable, cancel, describe, live_states, query, recorded_job
from xtrain.backends.elastic import check_fewer
from xtrain.backends.slurm.node import run_node
from xtrain.config.cluster import ClusterConfig, time_limit_minutes
from xtrain.config.schema import RunConfig
from xtrain.core.errors import ConfigError
from xtrain.core.files import write_atomic
from xtrain.core.machine import NODE_SIDE
from xtrain.core.rundir import SLURM_FILE


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    gpus_per_node: int  # the most a node has (one line of sinfo per kind of node)
    cpus_per_node: int  # the fewest a node has: a request for all of them fits on any node
    default: bool


def slurm_here() -> bool:
    return shutil.which("sbatch") is not None and shutil.which("sinfo") is not None


ASSUMED = "the default partition, no GPU (gpus_per_node=auto), all of this machine's CPUs per node (cpus_per_task=all)"


def assumed(cfg: RunConfig) -> RunConfig:
    """A dry run where SLURM is not: the request's `auto`s as ASSUMED says (numbers given are kept)."""
    import os

    c = cfg.cluster
    gpus = "0" if c.gpus_per_node == "auto" else c.gpus_per_node
    cpus = str(os.cpu_count() or 1) if c.cpus_per_task == "all" else c.cpus_per_task
    return replace(cfg, cluster=replace(c, gpus_per_node=gpus, cpus_per_task=cpus))


def require_slurm() -> None:
    """SLURM's commands are on this machine: else one line that says where to submit from."""
    if not slurm_here():
        raise ConfigError(
            "cluster=slurm: sbatch is not on PATH; submit from a SLURM login node (load its module first), "
            "or use cluster=local"
        )


@functools.lru_cache(maxsize=1)
def partitions() -> dict[str, Partition]:
    """The cluster's partitions, from sinfo (one query per process)."""
    require_slurm()
    found: dict[str, Partition] = {}
    for line in query(["sinfo", "-h", "-o", "%P|%D|%G|%c"]).splitlines():
        name, nodes, gres, cpus = line.split("|")
        default = name.endswith("*")
        name = name.rstrip("*")
        gpus = max((int(n) for n in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres)), default=0)
        before = found.get(name)
        if before:
            found[name] = Partition(name, before.nodes + int(nodes), max(before.gpus_per_node, gpus),
                                    min(before.cpus_per_node, int(cpus)), default)
        else:
            found[name] = Partition(name, int(nodes), gpus, int(cpus), default)
    return found


def partition_of(c: ClusterConfig) -> Partition:
    """The partition a job of this config goes to: the one named, or the cluster's default."""
    found = partitions()
    if c.partition is None:
        default = [p for p in found.values() if p.default]
        if not default:
            raise ConfigError(f"cluster.partition is empty and this cluster has no default partition; "
                              f"choose one of {', '.join(sorted(found))}")
        return default[0]
    if c.partition not in found:
        raise ConfigError(f"cluster.partition={c.partition}: no such partition; this cluster has "
                          f"{', '.join(sorted(found))}")
    return found[c.partition]


def resolve_request(cfg: RunConfig) -> RunConfig:
    """`gpus_per_node=auto` and `cpus_per_task=all` → the partition's numbers, written resolved into run.yaml."""
    c = cfg.cluster
    if c.gpus_per_node != "auto" and c.cpus_per_task != "all":
        return cfg
    part = partition_of(c)
    gpus = str(part.gpus_per_node) if c.gpus_per_node == "auto" else c.gpus_per_node
    cpus = str(part.cpus_per_node) if c.cpus_per_task == "all" else c.cpus_per_task
    return replace(cfg, cluster=replace(c, gpus_per_node=gpus, cpus_per_task=cpus))


def check(cfg: RunConfig) -> None:
    """What the submitting machine can know about the request: SLURM is here, the partition has the nodes."""
    c = cfg.cluster
    require_slurm()
    part = partition_of(c)
    if c.nodes > part.nodes:
        raise ConfigError(f"cluster.nodes={c.nodes}: partition {part.name} has {part.nodes} node(s); "
                          f"use cluster.nodes<={part.nodes}")
    check_not_running(Path(cfg.run_dir), Path(cfg.run_dir))
    check_fewer(cfg)  # each allocation it may get keeps the effective batch
    if c.gpus > part.gpus_per_node:
        raise ConfigError(f"cluster.gpus_per_node={c.gpus}: the nodes of partition {part.name} have "
                          f"{part.gpus_per_node} GPU(s); use cluster.gpus_per_node<={part.gpus_per_node}")
    if int(c.cpus_per_task) > part.cpus_per_node:
        raise ConfigError(f"cluster.cpus_per_task={c.cpus_per_task}: the nodes of partition {part.name} have "
                          f"{part.cpus_per_node} CPUs; use cluster.cpus_per_task<={part.cpus_per_node} (or all)")


def check_not_running(path: Path, run_dir: Path) -> None:
    """The SLURM job recorded in `path` (a run dir, a study's worker dir) has ended: else a ConfigError."""
    job = recorded_job(path)
    if job is None:
        return
    try:
        live = live_states([job.job_id])
    except Unreachable as err:
        raise ConfigError(f"cluster=slurm: {err}; try again once the SLURM controller answers") from None
    if job.job_id in live:
        raise ConfigError(f"run_dir={run_dir}: SLURM job {job.job_id} is still {describe(*live[job.job_id])} "
                          f"there; wait for it (python -m xtrain.status {run_dir}) or scancel {job.job_id}")


def request_line(cluster: ClusterConfig) -> str:
    """What the job asks SLURM for, in words (the plan's line; `on CPUs` where it asks for no GPU)."""
    c = cluster
    gpus = f"{c.gpus} GPU(s)" if c.gpus else "no GPU: on CPUs"
    partition = partition_of(c).name if slurm_here() else (c.partition or "(the default)")
    return (f"slurm request: {c.nodes} node(s) of partition {partition}, each one task of "
            f"{c.cpus_per_task} CPUs and {gpus}, running {c.processes_per_node} worker process(es)")


def srun_arguments(c: ClusterConfig) -> list[str]:
    """One task per node with every CPU the job has there (srun does not inherit sbatch's --cpus-per-task on
    SLURM 22.05-23.02); a task that fails ends the others at once (not at the collective timeout)."""
    args = [f"--cpus-per-task={c.cpus_per_task}", "--kill-on-bad-exit=1"]
    if c.container_image:
        args.append(f"--container-image={c.container_image}")
        if c.container_mounts:
            args.append(f"--container-mounts={c.container_mounts}")
    return args + list(c.srun_args)


def interpreter(c: ClusterConfig) -> str:
    """What runs each node's task: the image's python3 (xtrain installed there), else this interpreter."""
    if c.container_python:
        return c.container_python
    return "python3" if c.container_image else shlex.quote(sys.executable)


def job_parameters(cluster: ClusterConfig) -> dict:
    """submitit's SlurmExecutor parameters for this run (the #SBATCH lines, the setup, the srun line)."""
    from submitit.slurm.slurm import _convert_mem

    c = cluster
    params: dict = {
        "job_name": c.job_name, "nodes": c.nodes, "ntasks_per_node": 1, "time": time_limit_minutes(c.time_limit),
        # one task a node, of the nodes this allocation has (a requeued job may have fewer: node.nodes_to_ask)
        "setup": [*c.setup, "export SLURM_NTASKS=$SLURM_JOB_NUM_NODES SLURM_NPROCS=$SLURM_JOB_NUM_NODES"],
        "srun_args": srun_arguments(c), "stderr_to_stdout": True,
        # --signal=USR2@lead: the warning before the time limit; --requeue: SLURM may requeue the job
        # (scontrol requeue, a node failure), and so may the job itself, after a warning
        "signal_delay_s": c.signal_lead_s, "additional_parameters": {"requeue": True, **c.sbatch_args},
        "python": interpreter(c),
    }
    for name in ("partition", "account", "qos", "constraint", "exclude"):
        if getattr(c, name) is not None:
            params[name] = getattr(c, name)
    params["cpus_per_task"] = int(c.cpus_per_task)
    if c.gpus:
        params["gpus_per_node"] = c.gpus
    if c.mem_gb is not None:
        params["mem"] = _convert_mem(c.mem_gb)
    return params


def executor(folder: Path, params: dict):
    import submitit

    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=0, python=params.get("python"))  # None: this one
    ex.update_parameters(**{k: v for k, v in params.items() if k != "python"})
    return ex


@contextlib.contextmanager
def as_from_a_login_node():
    """Inside an allocation (an salloc shell, a batch job), SLURM's variables of that job would reach the new
    job through sbatch's exported environment, and srun there reads some as its own options: drop them."""
    own = {k: v for k, v in os.environ.items() if k.startswith("SLURM_") and k != "SLURM_CONF" or k == NODE_SIDE}
    for key in own:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(own)


def sbatch_script(cfg: RunConfig, folder: Path, array: int | None = None, array_parallelism: int = 256) -> str:
    """The script `submit` would hand to sbatch (for dry_run): one job, or a job array of `array` tasks."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = job_parameters(cfg.cluster)
    command = f"{params.pop('python')} -u -m submitit.core._submit {folder}"
    if array is not None:
        params.update(map_count=array, array_parallelism=array_parallelism)
    return _make_sbatch_string(command=command, folder=folder, **params)


def _sbatch_refusal(err: Exception) -> ConfigError:
    """submitit's error for a failed sbatch call → sbatch's own message, one line."""
    text = str(err)
    lines = list(dict.fromkeys(line.split("sbatch: error:", 1)[1].strip() for line in text.splitlines()
                               if "sbatch: error:" in line))
    message = "; ".join(lines) if lines else " ".join(text.split())[:300]
    return ConfigError(f"cluster=slurm: sbatch refused the job: {message}")


def submit(groups: list[tuple[dict, list[Path]]], folder: Path, function: Callable[[str], dict] = run_node) -> list[Job]:
    """Submit each group of run dirs (same job parameters) as one job, or one job array, each task
    `function(its dir)` (a run's: `run_node`; a study's workers have their own); record the ids."""
    from submitit.core.utils import FailedJobError

    jobs = []
    for params, paths in groups:
        try:
            with contextlib.redirect_stderr(io.StringIO()), as_from_a_login_node():  # (submitit repeats sbatch's complaint)
                submitted = executor(folder, params).map_array(function, [str(p) for p in paths])
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
