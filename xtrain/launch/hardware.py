"""What this machine can run: checked before launch, so a request is never silently downgraded.

Accelerate 1.15 runs FSDP and DeepSpeed only on accelerators: on a CPU it silently wraps
an FSDP model in DDP, and DeepSpeed fails on a batch-size assertion. fp16 on a CPU is
silently fp32. xtrain refuses each of these before anything starts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import socket
from dataclasses import replace

from xtrain.config.cluster import ClusterConfig, ClusterKind
from xtrain.config.precision import FP8_RECIPES
from xtrain.config.schema import BaseQuantization, Fp8Backend, Precision, RunConfig
from xtrain.config.task import given
from xtrain.core import machine
from xtrain.core.errors import ConfigError
from xtrain.core import seams
from xtrain.parallel import strategies

FP8_PACKAGES = {
    Fp8Backend.te: ("transformer_engine", "pip install transformer-engine[pytorch]"),
    Fp8Backend.torchao: ("torchao", "pip install torchao"),
    Fp8Backend.msamp: ("msamp", "see github.com/Azure/MS-AMP"),
}


def submitting_to_slurm(cluster: ClusterConfig) -> bool:
    """This process submits the run to SLURM: its nodes, not this machine, are what must run it. (A process
    inside someone's allocation, an salloc shell or a batch job, submits too: only xtrain marks its nodes.)"""
    return cluster.kind is ClusterKind.slurm and os.environ.get(machine.NODE_SIDE) != "1"


def node_gpus(cfg: RunConfig) -> int:
    """GPUs of a node that runs the workers: the ones SLURM is asked for, or the ones visible here."""
    return cfg.cluster.gpus if submitting_to_slurm(cfg.cluster) else machine.visible_gpus()


def resolve_processes(cfg: RunConfig, parallel: int = 1) -> RunConfig:
    """`cluster.num_processes=auto` → one per GPU of a node (of its share, where `parallel` runs share this
    machine's GPUs: a sweep's points at once), else 1; written resolved into run.yaml."""
    if cfg.cluster.num_processes != "auto":
        return cfg
    cluster = replace(cfg.cluster, num_processes=str(max(1, node_gpus(cfg) // max(1, parallel))))
    return replace(cfg, cluster=cluster)


def resolve_fused(cfg: RunConfig) -> RunConfig:
    """`trainer.fused_optimizer=auto` → true where xtrain's AdamW steps on GPUs (DDP; FSDP without CPU offload),
    else false (ZeRO's engine steps it; a user's optimizer has its own setting; on CPUs it does not pay)."""
    t = cfg.trainer
    if t.fused_optimizer != "auto":
        return cfg
    fused = node_gpus(cfg) > 0 and given(t.optimizer) is None and strategies.of(cfg).steps_fused(cfg)
    return replace(cfg, trainer=replace(t, fused_optimizer=fused))


def resolve_async_save(cfg: RunConfig) -> RunConfig:
    """`trainer.async_save=auto` → true wherever the strategy's checkpoints can be written behind training exactly,
    else false; `true` where they cannot is refused (`async_save_refusal`)."""
    t = cfg.trainer
    why = strategies.of(cfg).async_save_refusal(cfg)
    if t.async_save is True and why:
        raise ConfigError(f"trainer.async_save=true: {why}; use trainer.async_save=false (or auto)")
    if t.async_save != "auto":
        return cfg
    return replace(cfg, trainer=replace(t, async_save=why is None))


def refusal(cfg: RunConfig) -> str | None:
    """Why this machine cannot run the request, or None."""
    if submitting_to_slurm(cfg.cluster):  # the nodes' GPUs are checked on the nodes, before their workers start
        cuda = cfg.cluster.gpus > 0
        if cuda:
            return None
    else:
        cuda = bool(machine.gpus())
        if cfg.cluster.kind is ClusterKind.slurm and cfg.cluster.gpus > len(machine.gpus()):
            return (
                f"cluster.gpus_per_node={cfg.cluster.gpus}: the job was given GPUs on {socket.gethostname()} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}), and CUDA sees "
                f"{len(machine.gpus())} of them there; check the node's driver and the job's GPU binding, "
                "or ask for none (cluster.gpus_per_node=0: train on the nodes' CPUs)"
            )
    precision = cfg.precision.name
    if reason := strategies.of(cfg).refusal(cfg, cuda):
        return reason
    if cfg.model.lora.quantize_base is not BaseQuantization.none and not cuda:
        return (
            f"model.lora.quantize_base={cfg.model.lora.quantize_base.value}: QLoRA's 4-bit base needs a CUDA GPU "
            "(bitsandbytes kernels) and this machine has none; use model.lora.quantize_base=none (LoRA on the "
            "full-precision base)"
        )
    if precision is Precision.fp16 and not cuda and not seams.first("runs_on_cpu", "fp16", cfg):
        return (
            "precision=fp16: needs a CUDA GPU (Accelerate would silently train this CPU run in fp32); "
            "use precision=fp32 (or precision=bf16: autocast, fast on CPUs with AMX units)"
        )
    oldest = min(machine.gpus(), key=lambda g: g.capability) if cuda and machine.gpus() else None
    if precision is Precision.bf16 and oldest and oldest.capability < (8, 0):
        return (
            f"precision=bf16: {oldest.name} (compute capability {oldest.capability[0]}.{oldest.capability[1]}) has "
            "no bf16 units (needs >= 8.0, e.g. A100, H100; torch would emulate it, slowly); "
            "use precision=fp16 or precision=fp32"
        )
    if precision is Precision.fp8:
        if not cuda and not seams.first("runs_on_cpu", "fp8", cfg):
            return "precision=fp8: needs a GPU with FP8 units (compute capability >= 8.9, e.g. H100, L4) and this machine has none; use precision=bf16"
        if oldest and oldest.capability < (8, 9):
            return (
                f"precision=fp8: {oldest.name} (compute capability {oldest.capability[0]}.{oldest.capability[1]}) "
                "has no FP8 units (needs >= 8.9, e.g. H100, L4); use precision=bf16"
            )
        if not hasattr(importlib.import_module("accelerate.utils"), FP8_RECIPES[cfg.precision.fp8_backend]):
            return (f"precision.fp8_backend={cfg.precision.fp8_backend.value}: this Accelerate "
                    f"({importlib.metadata.version('accelerate')}) has no such backend (MS-AMP's ended with 1.15); "
                    "use precision.fp8_backend=te or torchao")
        module, install = FP8_PACKAGES[cfg.precision.fp8_backend]
        if importlib.util.find_spec(module) is None:
            return (
                f"precision.fp8_backend={cfg.precision.fp8_backend.value}: {module} is not installed ({install}); "
                "install it or choose another precision.fp8_backend (te, torchao, msamp)"
            )
    if cfg.trainer.compile_tuning and not cuda:
        return ("trainer.compile_tuning=true: inductor tunes the Triton kernels it generates for GPUs, and this "
                "machine has none (its compiled CPU kernels are C++, untuned); use trainer.compile_tuning=false")
    variable, names = ("CC", ["gcc", "clang", "cc"]) if cuda else ("CXX", ["g++"])
    if cfg.trainer.compile and not any(shutil.which(n) for n in ([os.environ[variable]] if os.environ.get(variable) else names)):
        # inductor builds its kernels: on GPUs Triton's launchers in C, on CPUs C++ source
        return (
            f"trainer.compile=true: torch.compile builds its kernels with {os.environ.get(variable) or ' or '.join(names)}"
            f" ({variable}), which is not on this machine; install a compiler (e.g. apt-get install g++) or use "
            "trainer.compile=false"
        )
    return None


def slow_precision(cfg: RunConfig) -> str | None:
    """What makes the run's precision slower than fp32 on this machine's CPU, where it trains there (a warning:
    it runs as asked)."""
    if cfg.precision.name is not Precision.bf16 or submitting_to_slurm(cfg.cluster) or machine.gpus():
        return None
    flags = machine.cpu_flags()
    if flags is None or "amx_bf16" in flags:
        return None
    return ("precision=bf16 on this CPU: it has no AMX units (no amx_bf16 flag), and bf16 autocast on such CPUs "
            "trains slower than fp32 (0.57x measured on a Xeon with AVX-512 bf16 instructions); precision=fp32 is "
            "likely faster here")


def check(cfg: RunConfig) -> None:
    reason = refusal(cfg)
    if reason:
        raise ConfigError(reason)
