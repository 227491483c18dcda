"""The task of a run config: `task.name` → its class."""

from __future__ import annotations

from xtrain.config.schema import RunConfig, TaskKind
from xtrain.tasks.base import Task


def task_for(cfg: RunConfig) -> Task:
    """The task `task.name` selects."""
    if cfg.task.name is TaskKind.custom:
        from xtrain.tasks.custom import Custom

        return Custom(cfg)
    if cfg.task.name is TaskKind.image_cls:
        from xtrain.tasks.image_cls import ImageCls

        return ImageCls(cfg)
    if cfg.task.name is TaskKind.seq_cls:
        from xtrain.tasks.seq_cls import SeqCls

        return SeqCls(cfg)
    from xtrain.tasks.causal_lm.task import CausalLM

    return CausalLM(cfg)
