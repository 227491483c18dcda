"""The launchers' configs, registered under `hydra/launcher` when Hydra discovers the plugin."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore


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


ConfigStore.instance().store(group="hydra/launcher", name="xtrain", node=LocalLauncherConf, provider="xtrain")
ConfigStore.instance().store(group="hydra/launcher", name="xtrain_slurm", node=SlurmLauncherConf, provider="xtrain")
