"""Callbacks of a user project (`'trainer.callbacks=[{_target_: mycallbacks.ConfusionMatrix}]'`): hooks named as
Lightning's, each given the run's state (xtrain/engine/callbacks.py)."""

import json

import torch

from tables import Table


class ConfusionMatrix:
    """The val split's confusion matrix after each eval, in <run dir>/confusion/step_N.json (rows: the targets)."""

    def __init__(self, name: str = "wine", classes: int = 3):
        self.val, self.classes = Table(name, "val"), classes

    def on_validation_end(self, state, metrics):
        model = state.model
        model.eval()
        with torch.no_grad():
            predicted = model(torch.tensor(self.val.features, dtype=torch.float32)).argmax(dim=1)
        model.train()
        matrix = torch.zeros(self.classes, self.classes, dtype=torch.long)
        for target, guess in zip(self.val.targets.tolist(), predicted.tolist()):
            matrix[target, guess] += 1
        where = state.run_dir / "confusion"
        where.mkdir(exist_ok=True)
        (where / f"step_{state.step}.json").write_text(json.dumps(matrix.tolist()) + "\n")


class StopWhen:
    """Stops the run (at this step boundary, with a checkpoint) once an eval value reaches `at`."""

    def __init__(self, value: str = "val_accuracy", at: float = 0.95):
        self.value, self.at = value, at

    def on_validation_end(self, state, metrics):
        if state.step > 0 and metrics[self.value] >= self.at:
            state.request_stop(f"{self.value} {metrics[self.value]:.4f} >= {self.at}")
