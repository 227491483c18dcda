"""A sweep's point: one composed run config, its number and the swept overrides that name it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xtrain.config.schema import RunConfig


@dataclass
class Point:
    """A sweep's point: its number, the swept settings that name it, its typed config (and so its run dir)."""

    num: int
    swept: list[str]  # this point's values of the settings that vary between points, as overrides
    cfg: RunConfig

    @property
    def path(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def label(self) -> str:
        return " ".join(self.swept) or "(no swept setting)"
