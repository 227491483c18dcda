"""Where runs run: `local` (this machine) and `slurm` (a SLURM cluster), chosen by `cluster.kind`.

Each backend module has the same entry points, and takes run dirs that launch/preflight.py wrote already:

- `resolve(cfg) -> cfg`: its automatic settings made concrete (SLURM: what a node of the partition has);
- `check(cfg)`: what only this backend can check (a SLURM partition's nodes), before `preflight.preflight`;
- `run(cfg) -> dict`: one run (the CLI's): check, write the run dir, run it, return its result;
- `check_points(points, **options)` and `run_points(points, sweep_dir, on_end, **options) -> bool`: a sweep's
  written points, `on_end(point)` as each ends; False where they were left running (not waited for).

registry.py picks a backend for a config. A sweep (sweeps/sweep.py) drives `run_points`.

May import: core, config, data, distributed, tasks, engine, launch.
"""
