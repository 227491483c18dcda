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

import copy
import os
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write


class _XtrainLauncher(Launcher):
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        self.composer = Composer(hydra_context, config)
        self.swept_keys = swept_on_command_line(config)  # with the keys seen varying in earlier batches
        self.dirs: dict[Path, int] = {}  # earlier batches' points' run dirs
        if self.runs_xtrain:
            from xtrain.sweeps import sweep_dir

            sweep_dir.note(self.sweep_dir)

    @property
    def runs_xtrain(self) -> bool:
        return getattr(self.task_function, "__module__", None) == "xtrain.commands.cli"

    @property
    def compose(self) -> "Composer":
        return self.composer

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from xtrain.sweeps import sweep
        from xtrain.core.errors import ConfigError

        configure_log(self.config.hydra.job_logging, self.config.hydra.verbose)  # xtrain's lines, as in a single run
        overrides = [list(o) for o in job_overrides]
        self.swept_keys |= sweep.varying_keys(overrides)  # a batched sweeper's batch: its points named as the first's
        points = sweep.plan_points(overrides, self.compose, self.sweep_dir, initial_job_idx,
                                   parallel=self.options.get("n_jobs", 1) if self.cluster_kind == "local" else 1,
                                   swept_keys=self.swept_keys)
        sweep.check_apart(points, self.dirs)
        for point in points:
            self.dirs[point.path] = point.num
            if point.cfg.cluster.kind.value != self.cluster_kind:
                raise ConfigError(f"point {point.num} ({point.label}): cluster.kind={point.cfg.cluster.kind.value} "
                                  f"under hydra/launcher={self.name}, {self.wrong_kind}")
        backend = self.backend()
        backend.check_points(points, **self.options)
        if points and points[0].cfg.dry_run:
            sweep.dry_run(points, self.sweep_dir, backend, **self.options)
            return [self.job_hooks.job_return(p, ran=False) for p in points]
        todo = sweep.prepare_all(points, self.sweep_dir, backend)
        hooks = self.job_hooks
        waited = sweep.run(points, todo, self.sweep_dir, backend, on_start=hooks.start, on_end=hooks.end,
                           **self.options)  # raises SweepFailed if any point failed
        return [hooks.job_return(p, ran=waited) for p in points]  # (not waited for: launched, no score yet)

    @property
    def job_hooks(self) -> "JobHooks":
        return JobHooks(self.composer, self.task_function, self.hydra_context.callbacks)


class JobHooks:
    """Hydra's callbacks (`hydra.callbacks`) for each point, as Hydra's launchers call them for each job:
    `on_job_start` as it starts, `on_job_end` with its `JobReturn` as it ends. Pickled to a SLURM study's workers,
    which build the callbacks again there."""

    def __init__(self, composer: "Composer", task_function: TaskFunction, callbacks=None) -> None:
        self.composer, self.task_function, self.callbacks = composer, task_function, callbacks

    def __getstate__(self) -> dict:  # (built again where it is unpickled: xtrain's task function and the callbacks)
        return {**self.__dict__, "callbacks": None, "task_function": None}

    def _callbacks(self):
        if self.callbacks is None:
            from hydra._internal.callbacks import Callbacks

            self.callbacks = Callbacks(self.composer.config)
        return self.callbacks

    def knows(self, point) -> bool:
        return point.num in self.composer.jobs

    def start(self, point) -> None:
        if self.task_function is None:
            from xtrain.commands import cli

            self.task_function = cli.hydra_main.__wrapped__  # (what Hydra's decorator wraps)
        self._callbacks().on_job_start(config=self.composer.job_config(point), task_function=self.task_function)

    def end(self, point) -> None:
        self._callbacks().on_job_end(config=self.composer.job_config(point), job_return=self.job_return(point))

    def job_return(self, point, ran: bool = True) -> JobReturn:
        """What Hydra's launchers return for a job: its config (the `hydra` node apart), Hydra's node, its overrides
        and outcome (completed: the score Hydra's sweepers optimise; else the failure, raised where it is read).
        `ran=False` (a dry run, or points left running): completed, without a score."""
        from xtrain.core import rundir
        from xtrain.sweeps import sweep

        config = self.composer.job_config(point)
        task_cfg = copy.deepcopy(config)
        with open_dict(task_cfg):
            del task_cfg["hydra"]
        result = rundir.read_result(point.path) if ran else {"status": "completed"}
        completed = result.get("status") in (rundir.Status.completed, rundir.Status.pruned)  # (a study's trial, stopped)
        value = (sweep.kept_score(point.path) if ran else None) if completed else RuntimeError(
            f"point {point.num} ({point.label}) {result.get('status', 'not run')}: {result.get('error', '')}")
        return JobReturn(overrides=OmegaConf.to_container(config.hydra.overrides.task), cfg=task_cfg,
                         hydra_cfg=OmegaConf.masked_copy(config, "hydra"), working_dir=os.getcwd(),
                         task_name=str(config.hydra.job.name), _return_value=value,
                         status=JobStatus.COMPLETED if completed else JobStatus.FAILED)


def swept_on_command_line(config: DictConfig) -> set[str]:
    """The keys a sweep's command line (`a=1,2`, `a=range(3)`) or `hydra.sweeper.params` sweeps."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(OmegaConf.to_container(config.hydra.overrides.task))
    keys = {o.input_line.partition("=")[0] for o in parsed if o.is_sweep_override()}
    params = OmegaConf.select(config, "hydra.sweeper.params")
    return keys | set(params or {}) if isinstance(params, DictConfig) else keys


def _refuse(why: str) -> None:
    """A plain Hydra app's launch refused: one line, exit 2 (its own CLI is Hydra's, not xtrain's)."""
    import sys

    print(f"error: {why}", file=sys.stderr)
    sys.exit(2)


class Composer:
    """One point's run config from its overrides and number (the `hydra` node removed, `${hydra:job.num}` and the
    like resolved as Hydra's launchers resolve them), as a plain container, with `hydra.sweep.subdir` where a config
    or the command line sets it (None: xtrain's own `<num>_<swept>`). It travels (pickled) to a SLURM node, where a
    study's worker composes the trials it asks for."""

    def __init__(self, hydra_context: HydraContext, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.state, self.pid = Singleton.get_state(), os.getpid()
        subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
        self.own_subdir = subdir not in (None, "${hydra.job.num}")  # (xtrain's conf/config.yaml sets that)
        self.jobs: dict[int, DictConfig] = {}  # each point's job config, for Hydra's callbacks and JobReturn

    def __getstate__(self) -> dict:
        return {**self.__dict__, "jobs": {}}

    def __call__(self, overrides: list[str], num: int) -> tuple[dict, str | None]:
        from hydra.core.hydra_config import HydraConfig

        if os.getpid() != self.pid:  # unpickled in another process: Hydra's config search path, as here
            Singleton.set_state(self.state)
            self.pid = os.getpid()
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = num
            config.hydra.job.num = num
        HydraConfig.instance().set_config(config)  # (as Hydra's run_job does for a job)
        subdir = str(config.hydra.sweep.subdir) if self.own_subdir else None
        if num >= 0:
            self.jobs[num] = config
        job = copy.deepcopy(config)
        with open_dict(job):
            del job["hydra"]
        return OmegaConf.to_container(job, resolve=True), subdir

    def job_config(self, point) -> DictConfig:
        """The point's config as Hydra's callbacks get a job's (`hydra` node and all; `run_dir` and
        `hydra.runtime.output_dir` its run dir), Hydra's config set to it."""
        from hydra.core.hydra_config import HydraConfig

        config = self.jobs[point.num]
        with open_dict(config):
            config.run_dir = str(point.path)
        with read_write(config.hydra.runtime):
            config.hydra.runtime.output_dir = os.path.abspath(point.path)
        HydraConfig.instance().set_config(config)
        return config


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
