"""What is trained: a task gives the loop its model and data, the loss of a batch, eval, the tokens a batch
holds, and the final export. The loop (loop.py) knows nothing else of the model or the data.

Today's one task is causal-LM training (`causal_lm.CausalLM`); the interface (`Task`, in base.py) is the seam for others.
"""

from __future__ import annotations

from xtrain.config import RunConfig
from xtrain.tasks.base import Task, TaskData

__all__ = ["Task", "TaskData", "for_config"]


def for_config(cfg: RunConfig) -> Task:
    from xtrain.tasks.causal_lm import CausalLM

    return CausalLM(cfg)
