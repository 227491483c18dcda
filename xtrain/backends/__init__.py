"""Where runs run: `local` (this machine) and `slurm` (a SLURM cluster), chosen by `cluster.kind`.

Each backend module has the same entry points, and takes run dirs that launch.py wrote already:

- `resolve(cfg) -> cfg`: its automatic settings made concrete (SLURM: what a node of the partition has);
- `check(cfg)`: what only this backend can check (a SLURM partition's nodes), before `launch.preflight`;
- `run(cfg) -> dict`: one run (the CLI's): check, write the run dir, run it, return its result;
- `check_points(points, **options)` and `run_points(points, sweep_dir, on_end, **options) -> bool`: a sweep's
  written points, `on_end(point)` as each ends; False where they were left running (not waited for).

The sweep (sweep.py) drives `run_points`; no backend imports the sweep.
"""

from __future__ import annotations

from xtrain import hardware
from xtrain.cluster_config import ClusterKind
from xtrain.config import RunConfig


def resolve(cfg: RunConfig, parallel: int = 1) -> RunConfig:
    """Every `auto` of a composed config made concrete, as run.yaml records it: the backend's, then
    `num_processes` (one per GPU of a node; of a `parallel`th of this machine's GPUs for a sweep's points
    run that many at a time)."""
    return hardware.resolve_processes(for_cluster(cfg.cluster.kind).resolve(cfg), parallel)


def for_cluster(kind: ClusterKind):
    """The backend module for `cluster.kind`."""
    if kind is ClusterKind.slurm:
        from xtrain.backends import slurm

        return slurm
    from xtrain.backends import local

    return local
