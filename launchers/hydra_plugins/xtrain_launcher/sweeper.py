"""`hydra/sweeper=xtrain_optuna`: an Optuna study over xtrain runs, its trials pruned from inside training.

    python -m xtrain -m hydra/sweeper=xtrain_optuna hydra.sweeper.n_trials=20 \
        'trainer.lr=tag(log,interval(1e-5,1e-2))' 'trainer.batch_size=choice(8,16)'

Hydra glue only: the study (asking, points, telling, resume) is `xtrain.sweeps.study`, the Optuna side `xtrain.engine.study_settings`,
the search space `xtrain.sweeps.search_space`. The trials run on this machine (`n_jobs` at a time), or with
`cluster=slurm` in `n_jobs` SLURM workers that ask for trials themselves (`xtrain.sweeps.study_on_slurm`). This module imports no Optuna: Hydra imports every
plugin at every start.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, List

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.xtrain_launcher.config import OptunaSweeperConf


SETTINGS = [f.name for f in fields(OptunaSweeperConf) if f.name not in ("_target_", "_recursive_", "defaults")]


class OptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        self.settings = settings

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )
        self.sweep_dir = Path(str(config.hydra.sweep.dir))

    def sweep(self, arguments: List[str]) -> None:
        from hydra.core.utils import configure_log

        from xtrain.engine import study_settings
        from xtrain.sweeps import search_space, study
        from xtrain.config.schema import setting_names
        from xtrain.commands.cli import CONFIG_GROUPS
        from xtrain.core.errors import ConfigError

        if not getattr(self.launcher, "runs_xtrain", False):
            raise ConfigError("hydra/sweeper=xtrain_optuna runs xtrain's own runs (python -m xtrain) only")
        if self.launcher.options.get("n_jobs", 1) != 1:
            raise ConfigError(f"hydra.launcher.n_jobs={self.launcher.options['n_jobs']}: a study runs "
                              "hydra.sweeper.n_jobs trials at once; set that instead")
        configure_log(self.config.hydra.job_logging, self.config.hydra.verbose)  # xtrain's lines, as in one run
        unknown = sorted(set(self.settings) - set(SETTINGS))
        if unknown:  # (added with a plus)
            raise ConfigError(f"hydra.sweeper.{unknown[0]}: no such setting of hydra/sweeper=xtrain_optuna; it has "
                              f"{', '.join(SETTINGS)}")
        s = dict(self.settings)
        params = s.pop("params")
        params = OmegaConf.to_container(params, resolve=True) if isinstance(params, DictConfig) else dict(params or {})
        composed = OmegaConf.to_container(self.config, resolve=False)
        composed.pop("hydra", None)
        known = {*setting_names(), *CONFIG_GROUPS, "experiment", *flat(composed)}  # a model's own arguments too
        space = search_space.parse([f"{k}={v}" for k, v in flat(params).items()] + list(arguments), known)
        if not space.distributions:
            raise ConfigError("hydra.sweeper.params: no search space; give at least one setting to sample, e.g. "
                              "'trainer.lr=tag(log,interval(1e-5,1e-2))'")
        sampler = study_settings.sampler_spec(s.pop("sampler"), s.pop("seed"))
        study_settings.make_sampler(sampler)
        pruner_settings = s.pop("pruner_settings")
        settings = study_settings.validated(study_settings.StudySettings(
            storage=study_settings.storage_path(s.pop("storage"), self.sweep_dir),
            study_name=s.pop("study_name") or self.sweep_dir.name,
            sampler=sampler,
            pruner_settings={k: v for k, v in dict(pruner_settings or {}).items() if v is not None},
            **s,
        ))
        run = study.Study(settings, space, self.sweep_dir, self.launcher.compose, self.launcher.backend(),
                         resume=self.config.get("resume") == "auto", hooks=self.launcher.job_hooks)
        run.check()
        if run.on_slurm:
            from xtrain.sweeps import study_on_slurm

            study_on_slurm.check(run)
        if self.config.get("dry_run"):
            run.dry_run()
            return
        run.open()
        if run.on_slurm:  # its workers: a job array, each asking for trials and running them
            study_on_slurm.run(run)
        else:
            run.run()


def flat(params: dict, prefix: str = "") -> dict:
    """{"trainer": {"lr": "interval(...)"}} (`+hydra.sweeper.params.trainer.lr=...`) as {"trainer.lr": ...};
    a config file's dotted keys stay as they are."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
