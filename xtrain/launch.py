"""From a validated RunConfig to a running training: preflight checks, run dir, workers.

The driver checks everything it can before anything starts, creates the run dir and
writes `run.yaml`; workers only ever read that file.
"""

from __future__ import annotations

import logging

from xtrain import checkpoint, data, hardware, model, run_dir
from xtrain.config import ConfigError, ModelSource, RunConfig

log = logging.getLogger("xtrain")


def preflight(cfg: RunConfig) -> None:
    """Checks of the world outside the config (files, models, checkpoints); raise ConfigError."""
    hardware.check(cfg)
    data.check(cfg.data)
    if cfg.model.source is ModelSource.pretrained:
        model.pretrained_config(cfg.model)
    resume_from = checkpoint.resolve(cfg.resume, cfg.run_dir, model.identity(cfg.model))
    if resume_from is not None:
        done = checkpoint.read_state(resume_from)["step"]
        if done >= cfg.trainer.max_steps:
            raise ConfigError(
                f"resume={cfg.resume}: {resume_from} has already trained {done} steps; "
                f"trainer.max_steps={cfg.trainer.max_steps} leaves nothing to do: raise trainer.max_steps"
            )


def launch(cfg: RunConfig) -> dict:
    preflight(cfg)
    path = run_dir.prepare(cfg)
    log.info("run dir: %s", path)
    from xtrain.trainer import train

    return train(path)
