"""From a validated RunConfig to a running training: preflight checks, run dir, workers.

The driver checks everything it can before anything starts, creates the run dir and
writes `run.yaml`; workers only ever read that file.
"""

from __future__ import annotations

import logging

from xtrain import checkpoint, data, hardware, model, run_dir
from xtrain.config import ModelSource, RunConfig

log = logging.getLogger("xtrain")


def preflight(cfg: RunConfig) -> None:
    """Checks of the world outside the config (files, models, checkpoints); raise ConfigError."""
    hardware.check(cfg)
    data.check(cfg.data)
    if cfg.model.source is ModelSource.pretrained:
        model.pretrained_config(cfg.model)
    checkpoint.resolve(cfg.resume, cfg.run_dir, model.identity(cfg.model))


def launch(cfg: RunConfig) -> dict:
    preflight(cfg)
    path = run_dir.prepare(cfg)
    log.info("run dir: %s", path)
    from xtrain.trainer import train

    return train(path)
