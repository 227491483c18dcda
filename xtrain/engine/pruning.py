"""Inside a run that is one trial of a study (its run dir holds `trial.json`): at each eval the main process
reports the objective to the study and asks the pruner; every rank gets that one answer (a broadcast), and
a pruned trial stops at this step boundary as a stop request would: every rank saves the step's checkpoint,
and the run ends `pruned`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from accelerate import Accelerator

from xtrain.engine import study_settings

log = logging.getLogger("xtrain")

PRUNER = "the pruner"  # the `signal` of a pruned run's stop record: no signal asked for it


class Pruning:
    def __init__(self, run_dir: Path, main: bool, examples_per_step: int) -> None:
        record = study_settings.read_trial_file(run_dir)
        self.active = record is not None
        self.trial = None
        # where the study's trials differ in batch size, each reports at the optimizer steps of its smallest batch
        # that see as many examples: the pruner compares trials at equal examples seen
        self.examples_per_step = examples_per_step
        self.reference = (record or {}).get("study", {}).get("examples_per_step") or examples_per_step
        if record is not None and main:
            import optuna

            settings = study_settings.StudySettings(**record["study"])
            self.objective, self.pruner = settings.objective, settings.pruner
            self.trial = optuna.trial.Trial(study_settings.load(settings), record["trial_id"])

    def decide(self, accelerator: Accelerator, step: int, result: dict) -> bool:
        """Report this eval's objective and ask the pruner (main process); the same answer on every rank."""
        if not self.active:
            return False
        prune = self.trial is not None and self._ask(step, result)
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            prune = bool(broadcast(torch.tensor([float(prune)], device=accelerator.device), from_process=0).item())
        return prune

    def _ask(self, step: int, result: dict) -> bool:
        value = result.get(self.objective)
        if value is None:
            return False
        self.trial.report(float(value), step * self.examples_per_step // self.reference)
        if not self.trial.should_prune():
            return False
        log.info("step %d | %s %.4f: pruned by the %s pruner", step, self.objective, value, self.pruner)
        return True
