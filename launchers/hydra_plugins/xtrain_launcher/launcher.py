"""`hydra/launcher=xtrain`: a multirun sweep as xtrain runs it (`xtrain.sweep`).

Every point is composed and validated before the first one runs; failures are recorded and
the sweep goes on; the sweep dir gets its summary after every point. The heavy lifting is in
`xtrain.sweep`; this class only connects it to Hydra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from hydra.core.utils import JobReturn, JobStatus, configure_log
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict


class LocalLauncher(Launcher):
    def __init__(self, n_jobs: int = 1) -> None:
        self.n_jobs = n_jobs
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        from xtrain import sweep

        sweep.note_sweep_dir(self.sweep_dir)

    def compose(self, overrides: list[str]) -> dict:
        """One point's run config (the `hydra` node removed), as a plain container."""
        assert self.hydra_context is not None and self.config is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config):
            del sweep_config["hydra"]
        return OmegaConf.to_container(sweep_config, resolve=True)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from xtrain import hardware, sweep

        assert self.config is not None
        configure_log(self.config.hydra.job_logging, self.config.hydra.verbose)  # xtrain's lines, as in a single run
        sweep_dir = self.sweep_dir
        overrides = [list(o) for o in job_overrides]
        points = sweep.plan_points(overrides, self.compose, sweep_dir, initial_job_idx)
        sweep.check_parallel(points, self.n_jobs, hardware.visible_gpus())
        todo = sweep.prepare_all(points, sweep_dir)
        sweep.run_all(points, todo, sweep_dir, self.n_jobs)  # raises SweepFailed if any point failed
        return [JobReturn(overrides=o, cfg=self.config, working_dir=str(p.path), task_name="xtrain",
                          status=JobStatus.COMPLETED, _return_value=sweep.final_val_loss(p.path))
                for o, p in zip(overrides, points)]
