"""The `tracker` settings: where metrics go besides metrics.jsonl."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from xtrain.config.fields import all_free
from xtrain.core.errors import ConfigError, changed_settings


class TrackerKind(Enum):
    none = "none"
    tensorboard = "tensorboard"
    wandb = "wandb"


@all_free  # (how it is watched)
@dataclass
class TrackerConfig:
    kind: TrackerKind = TrackerKind.none
    """Where metrics go besides metrics.jsonl; each option of the `tracker` group sets it."""
    project: str = "xtrain"
    """Project name for TensorBoard / W&B."""
    wandb_mode: str = "auto"
    """`auto`: online when a W&B API key is configured, else offline (files in the run dir)."""

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("auto", "online", "offline"):
            raise ConfigError(f"tracker.wandb_mode={self.wandb_mode}: must be one of auto, online, offline")
        unused = {TrackerKind.none: ("project", "wandb_mode"), TrackerKind.tensorboard: ("wandb_mode",)}
        for asked in changed_settings(self, "tracker", unused.get(self.kind, ())):
            raise ConfigError(f"{asked}: a setting of {'W&B' if asked.startswith('tracker.wandb') else 'a tracker'}, and "
                              f"this run has tracker={self.kind.value}; add tracker=wandb"
                              f"{'' if asked.startswith('tracker.wandb') else ' or tracker=tensorboard'}, or drop it")
