"""Where runs run: `local` (this machine) and `slurm` (a SLURM cluster), chosen by `cluster.kind`.

Each backend module provides the functions of the `Backend` protocol (base.py): `resolve`, `check`, `describe`,
`run`, and for sweeps `scripts`, `check_points` and `run_points`.

registry.py picks a backend for a config. A sweep (sweeps/sweep.py) drives `run_points`.

May import: core, config, data, parallel, tasks, engine, launch.
"""
