"""The interface between the training loop and what it trains."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass
class TaskData:
    """What `Task.build` gives the loop: the model to train (on CPU, in fp32) and its datasets."""

    model: object  # torch.nn.Module
    train_set: object  # a map-style dataset of dicts of tensors
    val_set: object
    unit: str = "examples"  # what one dataset item is, for the log: "blocks"
    unit_note: str = ""  # e.g. " of 128 tokens"


class Task(Protocol):
    def build(self, accelerator) -> TaskData:
        """The model and the train/val sets. Every rank calls it; data preparation happens once (main first)."""

    def loss(self, model, batch):
        """The training loss of a micro-batch (a scalar tensor)."""

    def eval_losses(self, model, batch):
        """One loss per example of a validation batch: the eval loss is their mean over the whole split."""

    def tokens(self, batch) -> int:
        """Tokens the batch trains on (throughput, `train/tokens_seen`)."""

    def export(self, model, state_dict: dict, path: Path) -> None:
        """Write the trained model (unwrapped, with its full state dict) to `path`, on the main process."""
