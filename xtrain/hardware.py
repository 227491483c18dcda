"""What this machine can run: checked before launch, so a request is never silently downgraded.

Accelerate 1.15 runs FSDP and DeepSpeed only on accelerators: on a CPU it silently wraps
an FSDP model in DDP, and DeepSpeed fails on a batch-size assertion. fp16 on a CPU is
silently fp32. xtrain refuses each of these before anything starts.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, replace

from xtrain.cluster_config import ClusterKind
from xtrain.config import BaseQuantization, Fp8Backend, Precision, RunConfig, Strategy
from xtrain.cpu_seams import fp16_on_cpu, fsdp_on_cpu, zero_on_cpu
from xtrain.errors import ConfigError

FP8_PACKAGES = {
    Fp8Backend.te: ("transformer_engine", "pip install transformer-engine[pytorch]"),
    Fp8Backend.torchao: ("torchao", "pip install torchao"),
    Fp8Backend.msamp: ("msamp", "see github.com/Azure/MS-AMP"),
}


NODE_SIDE = "XTRAIN_SLURM_NODE"  # set by xtrain on a SLURM job's nodes (slurm/node.py), for their processes


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


def submitting_to_slurm(cfg: RunConfig) -> bool:
    """This process submits the run to SLURM: its nodes, not this machine, are what must run it. (A process
    inside someone's allocation, an salloc shell or a batch job, submits too: only xtrain marks its nodes.)"""
    return cfg.cluster.kind is ClusterKind.slurm and os.environ.get(NODE_SIDE) != "1"


def node_gpus(cfg: RunConfig) -> int:
    """GPUs of a node that runs the workers: the ones SLURM is asked for, or the ones visible here."""
    return cfg.cluster.gpus if submitting_to_slurm(cfg) else visible_gpus()


def resolve_processes(cfg: RunConfig, parallel: int = 1) -> RunConfig:
    """`cluster.num_processes=auto` → one per GPU of a node (of its share, where `parallel` runs share this
    machine's GPUs: a sweep's points at once), else 1; written resolved into run.yaml."""
    if cfg.cluster.num_processes != "auto":
        return cfg
    cluster = replace(cfg.cluster, num_processes=str(max(1, node_gpus(cfg) // max(1, parallel))))
    return replace(cfg, cluster=cluster)


def local_gpu_gb() -> float | None:
    found = gpus()
    return found[0].memory_bytes / 1e9 if found else None


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


def refusal(cfg: RunConfig) -> str | None:
    """Why this machine cannot run the request, or None."""
    if submitting_to_slurm(cfg):  # the nodes' GPUs are checked on the nodes, before their workers start
        cuda = cfg.cluster.gpus > 0
        if cuda:
            return None
    else:
        cuda = bool(gpus())
        if cfg.cluster.kind is ClusterKind.slurm and cfg.cluster.gpus > len(gpus()):
            return (
                f"cluster.gpus_per_node={cfg.cluster.gpus}: the job was given GPUs on {socket.gethostname()} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}), and CUDA sees "
                f"{len(gpus())} of them there; check the node's driver and the job's GPU binding, "
                "or ask for none (cluster.gpus_per_node=0: train on the nodes' CPUs)"
            )
    strategy, precision = cfg.strategy.name, cfg.precision.name
    if strategy is not Strategy.ddp and not cuda and not zero_on_cpu(cfg) and not fsdp_on_cpu(cfg):
        kind = "FSDP" if strategy is Strategy.fsdp else "DeepSpeed ZeRO"
        return (
            f"strategy={strategy.value}: {kind} needs CUDA GPUs and this machine has none (Accelerate would "
            f"{'silently train plain DDP' if strategy is Strategy.fsdp else 'fail inside DeepSpeed'}); "
            "use strategy=ddp here, or run on GPU machines (dry_run=true shows the plan anywhere)"
        )
    if cfg.model.lora.quantize_base is not BaseQuantization.none and not cuda:
        return (
            f"model.lora.quantize_base={cfg.model.lora.quantize_base.value}: QLoRA's 4-bit base needs a CUDA GPU "
            "(bitsandbytes kernels) and this machine has none; use model.lora.quantize_base=none (LoRA on the "
            "full-precision base)"
        )
    if precision is Precision.fp16 and not cuda and not fp16_on_cpu(cfg):
        return (
            "precision=fp16: needs a CUDA GPU (Accelerate would silently train this CPU run in fp32); "
            "use precision=bf16 (autocast, fast on CPUs with bf16 units) or precision=fp32"
        )
    oldest = min(gpus(), key=lambda g: g.capability) if cuda and gpus() else None
    if precision is Precision.bf16 and oldest and oldest.capability < (8, 0):
        return (
            f"precision=bf16: {oldest.name} (compute capability {oldest.capability[0]}.{oldest.capability[1]}) has "
            "no bf16 units (needs >= 8.0, e.g. A100, H100; torch would emulate it, slowly); "
            "use precision=fp16 or precision=fp32"
        )
    if precision is Precision.fp8:
        if not cuda:
            return "precision=fp8: needs a GPU with FP8 units (compute capability >= 8.9, e.g. H100, L4) and this machine has none; use precision=bf16"
        if oldest and oldest.capability < (8, 9):
            return (
                f"precision=fp8: {oldest.name} (compute capability {oldest.capability[0]}.{oldest.capability[1]}) "
                "has no FP8 units (needs >= 8.9, e.g. H100, L4); use precision=bf16"
            )
        module, install = FP8_PACKAGES[cfg.precision.fp8_backend]
        if importlib.util.find_spec(module) is None:
            return (
                f"precision.fp8_backend={cfg.precision.fp8_backend.value}: {module} is not installed ({install}); "
                "install it or choose another precision.fp8_backend (te, torchao, msamp)"
            )
    variable, names = ("CC", ["gcc", "clang", "cc"]) if cuda else ("CXX", ["g++"])
    if cfg.trainer.compile and not any(shutil.which(n) for n in ([os.environ[variable]] if os.environ.get(variable) else names)):
        # inductor builds its kernels: on GPUs Triton's launchers in C, on CPUs C++ source
        return (
            f"trainer.compile=true: torch.compile builds its kernels with {os.environ.get(variable) or ' or '.join(names)}"
            f" ({variable}), which is not on this machine; install a compiler (e.g. apt-get install g++) or use "
            "trainer.compile=false"
        )
    return None


def check(cfg: RunConfig) -> None:
    reason = refusal(cfg)
    if reason:
        raise ConfigError(reason)
