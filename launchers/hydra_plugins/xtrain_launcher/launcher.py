"""`hydra/launcher=xtrain` (local; xtrain's default), `hydra/launcher=xtrain_slurm` (one SLURM job array) and
`hydra/launcher=xtrain_ray` (each point a Ray run).

For xtrain's own runs each hands the points to `xtrain.sweeps.sweep` with its backend
(`xtrain.backends.local`, `xtrain.backends.slurm.backend`, `xtrain.backends.ray_cluster`): every point is composed and validated and its run
dir written before the first one runs or is queued; failures are recorded and the sweep goes on; the
sweep dir gets its summary after every point. They differ only in the backend, where a point runs. Any other Hydra app under `xtrain_slurm` runs as hydra-submitit-launcher
runs it: each job on one node, through submitit; under `xtrain`, as Hydra's basic launcher runs it (job after job,
here); `xtrain_ray` refuses it in one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict


class _XtrainLauncher(Launcher):
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        if self.runs_xtrain:
            from xtrain.sweeps import sweep_dir

            sweep_dir.note(self.sweep_dir)

    @property
    def runs_xtrain(self) -> bool:
        return getattr(self.task_function, "__module__", None) == "xtrain.commands.cli"

    @property
    def compose(self) -> "Composer":
        return Composer(self.hydra_context, self.config)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from xtrain.sweeps import sweep
        from xtrain.core.errors import ConfigError

        configure_log(self.config.hydra.job_logging, self.config.hydra.verbose)  # xtrain's lines, as in a single run
        overrides = [list(o) for o in job_overrides]
        points = sweep.plan_points(overrides, self.compose, self.sweep_dir, initial_job_idx,
                                   parallel=self.options.get("n_jobs", 1) if self.cluster_kind == "local" else 1)
        for point in points:
            if point.cfg.cluster.kind.value != self.cluster_kind:
                raise ConfigError(f"point {point.num} ({point.label}): cluster.kind={point.cfg.cluster.kind.value} "
                                  f"under hydra/launcher={self.name}, {self.wrong_kind}")
        backend = self.backend()
        backend.check_points(points, **self.options)
        if points and points[0].cfg.dry_run:
            sweep.dry_run(points, self.sweep_dir, backend, **self.options)
            return [JobReturn(overrides=o, cfg=self.config, working_dir=str(p.path), task_name="xtrain",
                              status=JobStatus.COMPLETED, _return_value=None) for o, p in zip(overrides, points)]
        todo = sweep.prepare_all(points, self.sweep_dir, backend)
        sweep.run(points, todo, self.sweep_dir, backend, **self.options)  # raises SweepFailed if any point failed
        return [JobReturn(overrides=o, cfg=self.config, working_dir=str(p.path), task_name="xtrain",
                          status=JobStatus.COMPLETED, _return_value=sweep.kept_score(p.path))
                for o, p in zip(overrides, points)]


def _refuse(why: str) -> None:
    """A plain Hydra app's launch refused: one line, exit 2 (its own CLI is Hydra's, not xtrain's)."""
    import sys

    print(f"error: {why}", file=sys.stderr)
    sys.exit(2)


class Composer:
    """One point's run config from its overrides (the `hydra` node removed), as a plain container. It travels
    (pickled) to a SLURM node, where a study's worker composes the trials it asks for."""

    def __init__(self, hydra_context: HydraContext, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.state, self.pid = Singleton.get_state(), os.getpid()

    def __call__(self, overrides: list[str]) -> dict:
        if os.getpid() != self.pid:  # unpickled in another process: Hydra's config search path, as here
            Singleton.set_state(self.state)
            self.pid = os.getpid()
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(sweep_config):
            del sweep_config["hydra"]
        return OmegaConf.to_container(sweep_config, resolve=True)


class LocalLauncher(_XtrainLauncher):
    name, cluster_kind = "xtrain", "local"
    wrong_kind = "which runs points here; use cluster=slurm (it selects hydra/launcher=xtrain_slurm)"

    def __init__(self, n_jobs: int = 1) -> None:
        self.options = {"n_jobs": n_jobs}

    def backend(self):
        from xtrain.backends import local

        return local

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        if self.runs_xtrain:
            return super().launch(job_overrides, initial_job_idx)
        # Any other Hydra app: its task function, job after job, as Hydra's basic launcher runs it
        from hydra._internal.core_plugins.basic_launcher import BasicLauncher

        if self.options["n_jobs"] != 1:
            _refuse(f"hydra.launcher.n_jobs={self.options['n_jobs']}: hydra/launcher=xtrain runs another app's jobs one "
                    "after another; drop it, or use hydra/launcher=joblib for jobs at once")

        basic = BasicLauncher()
        basic.setup(hydra_context=self.hydra_context, task_function=self.task_function, config=self.config)
        return basic.launch(job_overrides, initial_job_idx)


class RayLauncher(_XtrainLauncher):
    """cluster=ray's: each point a Ray run of its own nodes, `n_jobs` at once."""
    name, cluster_kind = "xtrain_ray", "ray"
    wrong_kind = "which runs on Ray; use cluster=ray"

    def __init__(self, n_jobs: int = 1) -> None:
        self.options = {"n_jobs": n_jobs}

    def backend(self):
        from xtrain.backends import ray_cluster

        return ray_cluster

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        if not self.runs_xtrain:
            _refuse(f"hydra/launcher=xtrain_ray runs xtrain's own runs (python -m xtrain) only; for "
                    f"{getattr(self.task_function, '__module__', 'this app')}'s jobs use hydra/launcher=xtrain (here, "
                    "job after job), xtrain_slurm, or hydra-ray-launcher")
        return super().launch(job_overrides, initial_job_idx)


class SlurmLauncher(_XtrainLauncher):
    name, cluster_kind = "xtrain_slurm", "slurm"
    wrong_kind = "which submits to SLURM; use cluster=slurm"

    def __init__(self, array_parallelism: int = 256) -> None:
        self.options = {"array_parallelism": array_parallelism}

    def backend(self):
        from xtrain.backends.slurm import backend as slurm

        return slurm

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        if self.runs_xtrain:
            return super().launch(job_overrides, initial_job_idx)
        return self._launch_hydra_app(job_overrides, initial_job_idx)

    def _launch_hydra_app(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Any other Hydra app: each job runs its task function on one node (a job array), like
        hydra-submitit-launcher; the job's outcome comes back through submitit's result files."""
        import logging

        from xtrain.backends.slurm import submit

        log = logging.getLogger(__name__)
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        params = {"job_name": str(self.config.hydra.job.name), "nodes": 1, "ntasks_per_node": 1,
                  "array_parallelism": self.options["array_parallelism"], "stderr_to_stdout": True}
        args = []
        for idx, overrides in enumerate(job_overrides, initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            args.append((list(overrides), idx, Singleton.get_state()))
        executor = submit.executor(self.sweep_dir / "logs", params)
        jobs = executor.map_array(_HydraJob(self.hydra_context, self.task_function, self.config), *zip(*args))
        return [job.results()[0] for job in jobs]


class _HydraJob:
    """One job of a plain Hydra app, on a node (pickled by submitit)."""

    def __init__(self, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def __call__(self, overrides: list[str], job_num: int, singleton_state: dict[Any, Any]) -> JobReturn:
        import submitit

        Singleton.set_state(singleton_state)
        setup_globals()
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config.hydra.job) as job:
            job.id = submitit.JobEnvironment().job_id
            job.num = job_num
        return run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=sweep_config,
                       job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
