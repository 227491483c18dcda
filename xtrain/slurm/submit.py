"""Submitting to SLURM: what the submitting machine checks (SLURM is here, the partition has the nodes),
the job's parameters and sbatch script (through submitit), and the submission, recorded in each run dir.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from xtrain.config import ClusterConfig, RunConfig, time_limit_minutes
from xtrain.errors import ConfigError
from xtrain.files import write_atomic
from xtrain.run_dir import SLURM_FILE
from xtrain.slurm.monitor import Job, cancel, describe, live_states, query, recorded_job
from xtrain.slurm.node import run_node


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    gpus_per_node: int
    default: bool


@functools.lru_cache(maxsize=1)
def partitions() -> dict[str, Partition]:
    """The cluster's partitions, from sinfo (one query per process)."""
    found: dict[str, Partition] = {}
    for line in query(["sinfo", "-h", "-o", "%P|%D|%G"]).splitlines():
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
