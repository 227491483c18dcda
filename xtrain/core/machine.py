"""This machine's facts: its cores, its GPUs, when this process was launched. Nothing here reads a config."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

NODE_SIDE = "XTRAIN_SLURM_NODE"  # set by xtrain on a SLURM job's nodes (slurm/node.py), for their processes
RESTART_ENV = "XTRAIN_RESTART_COUNT"  # set by the Ray backend on the nodes of a run it restarted (ray_cluster.py)


def restart_count() -> int:
    """The times the run's scheduler restarted it (a requeued SLURM job; a Ray run after a lost node): 0 at first."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or os.environ.get(RESTART_ENV) or 0)


def usable_cores() -> int:
    """The cores this process may use: the ones it is bound to (its affinity), and no more than SLURM gave
    this node's task where it says (an allocation that binds nothing)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    allocated = os.environ.get("SLURM_CPUS_ON_NODE")
    return min(cores, int(allocated)) if allocated and allocated.isdigit() else cores


def bound_cores() -> str:
    """The cores this process may run on, as a list like `0-3,8`."""
    if not hasattr(os, "sched_getaffinity"):
        return f"0-{(os.cpu_count() or 1) - 1}"
    cores, spans = sorted(os.sched_getaffinity(0)), []
    for core in cores:
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def visible_gpus() -> int:
    """CUDA devices this process sees (no CUDA context is created: the count comes from the driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_gpu_ids(count: int | None = None) -> list[str]:
    """The ids of the GPUs this process sees, as CUDA_VISIBLE_DEVICES names them for its children: the
    parent's own list where it has one (`4,5,6,7`, GPU UUIDs, MIG instances), else `0..count-1`."""
    count = visible_gpus() if count is None else count
    preset = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return preset[:count] if "CUDA_VISIBLE_DEVICES" in os.environ else [str(i) for i in range(count)]


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    memory_bytes: int


_GPU_FACTS = """
import json, torch
print(json.dumps([{"name": torch.cuda.get_device_name(i), "capability": list(torch.cuda.get_device_capability(i)),
                   "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
                  for i in range(torch.cuda.device_count())]))
"""


@functools.cache
def gpus() -> tuple[Gpu, ...]:
    """The visible GPUs' facts, read in a short subprocess: the driver and a SLURM node's process stay alive
    as the workers' parents for the whole run, and a CUDA context of theirs would take memory from rank 0's GPU."""
    if not visible_gpus():
        return ()
    out = subprocess.run([sys.executable, "-c", _GPU_FACTS], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    return tuple(Gpu(g["name"], tuple(g["capability"]), g["memory_bytes"]) for g in json.loads(out))


def local_gpu_gb() -> float | None:
    found = gpus()
    return found[0].memory_bytes / 1e9 if found else None


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """This machine's CPU flags (`amx_bf16`, `avx512_bf16`, ...), or None where Linux's /proc/cpuinfo is not."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return frozenset(word for line in text.splitlines() if line.startswith("flags") for word in line.split(":", 1)[1].split())


# where a cgroup keeps its memory limit: v2 (`0::/path` in /proc/self/cgroup) and v1 (`N:memory:/path`)
_CGROUP_LIMITS = {"": ("/sys/fs/cgroup", "memory.max"), "memory": ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")}


def ram_bytes() -> int:
    """This machine's memory, or the limit of this process's control group where that is lower (a container's,
    a SLURM job's): the least on the way up its cgroup memory hierarchy."""
    limits = [psutil.virtual_memory().total]
    try:
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        groups = []
    for line in groups:
        _, controllers, path = line.split(":", 2)
        if controllers not in _CGROUP_LIMITS:
            continue
        root, name = _CGROUP_LIMITS[controllers]
        here = Path(root + path)
        for folder in (here, *(p for p in here.parents if p.is_relative_to(root))):
            try:
                text = (folder / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit():
                limits.append(int(text))
    return min(limits)


def name_deepspeed_accelerator() -> None:
    """Without CUDA, name DeepSpeed's accelerator: else it warns each time something probes it."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def async_io_available() -> bool:
    """DeepSpeed's async_io op (NVMe offload): installed prebuilt, or buildable here (libaio headers)."""
    name_deepspeed_accelerator()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    return bool(installed_ops.get("async_io")) or get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(
        verbose=False
    )


def launch_time() -> float:
    """When this run was launched, by the wall clock: XTRAIN_LAUNCH_TIME where a sweep or a launcher set it,
    else this process's start. psutil's create_time counts from /proc/stat's btime, whole seconds, and reads
    up to 1 s early; /proc/uptime has hundredths."""
    if os.environ.get("XTRAIN_LAUNCH_TIME"):
        return float(os.environ["XTRAIN_LAUNCH_TIME"])
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            up = float(uptime.read().split()[0])
        return time.time() - up + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return psutil.Process().create_time()
