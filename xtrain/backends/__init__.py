"""Where runs run: `local` (this machine), `slurm` (a SLURM cluster) and `ray_cluster` (a Ray cluster's nodes),
chosen by `cluster.kind`. `ray_job.py`: a Ray run placed and followed; `elastic.py`: a run continued on fewer nodes
(SLURM's and Ray's); `kuberay.py`: the RayCluster manifest of a dry run under cluster=ray.

Each backend module provides the functions of the `Backend` protocol (base.py): `resolve`, `check`, `describe`,
`run`, and for sweeps `scripts`, `check_points` and `run_points`.

registry.py picks a backend for a config. A sweep (sweeps/sweep.py) drives `run_points`.

May import: core, config, data, parallel, tasks, engine, launch.
"""
