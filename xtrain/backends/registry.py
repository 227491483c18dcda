"""The backend of a run config: `cluster.kind` → its module; `auto` settings made concrete."""

from __future__ import annotations

from xtrain.backends.base import Backend
from xtrain.config.cluster import ClusterKind
from xtrain.config.schema import RunConfig
from xtrain.parallel import dims
from xtrain.engine import checkpoint
from xtrain.launch import hardware


def resolve_auto(cfg: RunConfig, parallel: int = 1) -> RunConfig:
    """Every `auto` of a composed config made concrete, as run.yaml records it: the backend's, then
    `num_processes` (one per GPU of a node; of a `parallel`th of this machine's GPUs for a sweep's points
    run that many at a time), `trainer.fused_optimizer`, `trainer.async_save`, `strategy.dp_replicate` (one replica per
    node); a resume
    on another number of processes: the `trainer.grad_accum` that keeps the checkpoint's effective batch."""
    cfg = hardware.resolve_processes(backend_for(cfg.cluster.kind).resolve(cfg), parallel)
    cfg = dims.resolve(hardware.resolve_async_save(hardware.resolve_fused(cfg)))
    return checkpoint.keep_effective_batch(cfg)


def backend_for(kind: ClusterKind) -> Backend:
    """The backend for `cluster.kind`: a module with the `Backend` protocol's functions."""
    if kind is ClusterKind.slurm:
        from xtrain.backends.slurm import backend as slurm

        return slurm
    if kind is ClusterKind.ray:
        from xtrain.backends import ray_cluster

        return ray_cluster
    from xtrain.backends import local

    return local
