"""The launchers' and the sweeper's configs, registered under `hydra/launcher` and `hydra/sweeper` when Hydra
discovers the plugin."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from xtrain.config.optuna_names import SAMPLERS


@dataclass
class LocalLauncherConf:
    _target_: str = "hydra_plugins.xtrain_launcher.launcher.LocalLauncher"
    n_jobs: int = 1
    """Points run at once, each with its own GPUs (CUDA_VISIBLE_DEVICES) or its own share of the cores."""


@dataclass
class SlurmLauncherConf:
    _target_: str = "hydra_plugins.xtrain_launcher.launcher.SlurmLauncher"
    array_parallelism: int = 256
    """Points of the job array that run at once (sbatch --array=...%N)."""


@dataclass
class RayLauncherConf:
    _target_: str = "hydra_plugins.xtrain_launcher.launcher.RayLauncher"
    n_jobs: int = 1
    """Points run at once, each a Ray run of its own nodes (the cluster must hold them all)."""


ConfigStore.instance().store(group="hydra/launcher", name="xtrain", node=LocalLauncherConf, provider="xtrain")
ConfigStore.instance().store(group="hydra/launcher", name="xtrain_ray", node=RayLauncherConf, provider="xtrain")
ConfigStore.instance().store(group="hydra/launcher", name="xtrain_slurm", node=SlurmLauncherConf, provider="xtrain")


@dataclass
class PrunerSettings:
    """The chosen Optuna pruner's own arguments; unset ones keep Optuna's defaults. Each pruner takes some:
    median and percentile the first five, successive_halving and hyperband the last four."""

    n_startup_trials: Optional[int] = None  # trials that finish before any is pruned
    n_warmup_steps: Optional[int] = None  # steps of a trial before it can be pruned
    interval_steps: Optional[int] = None
    n_min_trials: Optional[int] = None
    percentile: Optional[float] = None
    min_resource: Optional[Any] = None  # steps (an int, or "auto")
    max_resource: Optional[Any] = None
    reduction_factor: Optional[int] = None
    bootstrap_count: Optional[int] = None


@dataclass
class OptunaSweeperConf:
    """`hydra/sweeper=xtrain_optuna` (sweeper.py): hydra-optuna-sweeper's keys where they mean the same."""

    _target_: str = "hydra_plugins.xtrain_launcher.sweeper.OptunaSweeper"
    _recursive_: bool = False  # (the sampler's node is built by the study, with hydra.sweeper.seed)
    defaults: List[Any] = field(default_factory=lambda: ["_self_", {"sampler": "tpe"}])
    sampler: Any = "tpe"  # hydra/sweeper/sampler=NAME (its node: {_target_: optuna.samplers.<Name>, seed}), a name
    # (hydra.sweeper.sampler=random: xtrain.config.optuna_names.SAMPLERS), or a node of your own
    seed: Optional[int] = None  # the sampler's seed, where its node sets none
    direction: str = "minimize"
    objective: str = "val_loss"  # what a trial is judged by: its final value, reported at each eval
    study_name: Optional[str] = None  # default: the sweep dir's name
    storage: Optional[str] = None  # default: a journal file in the sweep dir (safe on a shared filesystem)
    n_trials: int = 20
    n_jobs: int = 1  # trials at once, each in its own slot of this machine
    max_retries: int = 0  # a failed trial runs again from its checkpoint, up to this many times
    pruner: str = "median"  # xtrain.config.optuna_names.PRUNERS
    pruner_settings: PrunerSettings = field(default_factory=PrunerSettings)
    params: Dict[str, Any] = field(default_factory=dict)  # the search space: {setting: "interval(...)", ...}


ConfigStore.instance().store(group="hydra/sweeper", name="xtrain_optuna", node=OptunaSweeperConf, provider="xtrain")
for _name, _sampler in SAMPLERS.items():  # hydra-optuna-sweeper's form: hydra/sweeper/sampler=tpe
    ConfigStore.instance().store(group="hydra/sweeper/sampler", name=_name, provider="xtrain",
                                 node={"_target_": f"optuna.samplers.{_sampler}", "seed": None})
