"""`trainer.monitor`: after each eval, whether the monitored value improved on its best so far. The loop exports
the model at each improvement (`trainer.export=best`) and stops at a step boundary once `trainer.early_stop_patience`
evals in a row have not improved it. The best value, its step and the count travel in checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from xtrain.config.schema import TrainerConfig, monitor_direction
from xtrain.tasks.metrics import better

log = logging.getLogger("xtrain")

EARLY_STOP = "early stop"  # the `signal` of a run's stop record when `early_stop_patience` ended it


@dataclass
class Monitor:
    name: str
    direction: str  # maximize | minimize
    best: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0

    @classmethod
    def of(cls, trainer: TrainerConfig, known: str | None, saved: dict | None = None) -> "Monitor":
        """A fresh one, or the checkpoint's (`saved`) where it watched the same value the same way. `known`: the
        monitored value's direction as the task knows it."""
        monitor = cls(trainer.monitor, monitor_direction(trainer, known))
        if saved and saved.get("name") == monitor.name and saved.get("direction") == monitor.direction:
            monitor = cls(**saved)
        return monitor

    def state(self) -> dict:
        return asdict(self)

    def judge(self, accelerator, step: int, result: dict, trainer: TrainerConfig) -> tuple[bool, bool]:
        """(improved, stop early) after the eval at `step`: the same answer on every rank (rank 0's, broadcast). A
        NaN never improves on anything, nor becomes the best."""
        value = result[self.name]
        improved = better(self.direction, value, self.best, trainer.early_stop_min_delta)
        if improved:
            self.best, self.best_step, self.evals_without_improvement = value, step, 0
        else:
            self.evals_without_improvement += 1
        patience = trainer.early_stop_patience
        stop = bool(patience) and self.evals_without_improvement >= patience
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            agreed = broadcast(torch.tensor([float(improved), float(stop)], device=accelerator.device), from_process=0)
            improved, stop = bool(agreed[0].item()), bool(agreed[1].item())
        if stop:
            best = "nothing finite" if self.best is None else f"{self.best:.4f} (step {self.best_step})"
            log.info("step %d | %s has not improved on %s in the last %d eval(s): early stop", step, self.name, best,
                     patience)
        return improved, stop
