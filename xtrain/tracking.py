"""Trackers, all through Accelerate's tracker API: metrics.jsonl always, plus TensorBoard or W&B."""

from __future__ import annotations

import json
import os
from pathlib import Path

from accelerate.tracking import GeneralTracker

from xtrain.config import RunConfig, TrackerKind
from xtrain.run_dir import METRICS

TENSORBOARD_DIR = "tensorboard"


class JsonlTracker(GeneralTracker):
    """One JSON object per `accelerator.log` call, with its step, flushed at once."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self._file = None

    def start(self) -> None:
        self._file = open(self.path, "a")

    @property
    def tracker(self):
        return self._file

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


def wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return os.environ.get("WANDB_MODE", "online")
    try:
        import netrc

        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


def log_with(cfg: RunConfig, run_dir: Path) -> list:
    trackers: list = [JsonlTracker(run_dir / METRICS)]
    if cfg.tracker.kind is TrackerKind.tensorboard:
        trackers.append("tensorboard")
    elif cfg.tracker.kind is TrackerKind.wandb:
        trackers.append("wandb")
    return trackers


def init_kwargs(cfg: RunConfig, run_dir: Path) -> dict:
    if cfg.tracker.kind is TrackerKind.wandb:
        return {"wandb": {"dir": str(run_dir), "mode": wandb_mode(cfg.tracker.wandb_mode), "name": run_dir.name}}
    return {}
