"""What is trained: a task gives the loop its model and data, the loss of a batch, eval, the tokens a batch
holds, and the final export. The loop (loop.py) knows nothing else of the model or the data.

The tasks: causal-LM training (`causal_lm.CausalLM`, the default), sequence classification with a pretrained
transformers model (`seq_cls.SeqCls`), image classification (`image_cls.ImageCls`), and the user's own model, datasets, loss and metrics by `_target_`
(`custom.Custom`); the interface is `Task`, in base.py.
"""

from __future__ import annotations

from xtrain.config import RunConfig, TaskKind
from xtrain.tasks.base import Task, TaskData

__all__ = ["Task", "TaskData", "for_config"]


def for_config(cfg: RunConfig) -> Task:
    if cfg.task.name is TaskKind.custom:
        from xtrain.tasks.custom import Custom

        return Custom(cfg)
    if cfg.task.name is TaskKind.image_cls:
        from xtrain.tasks.image_cls import ImageCls

        return ImageCls(cfg)
    if cfg.task.name is TaskKind.seq_cls:
        from xtrain.tasks.seq_cls import SeqCls

        return SeqCls(cfg)
    from xtrain.tasks.causal_lm import CausalLM

    return CausalLM(cfg)
