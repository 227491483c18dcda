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
    collate: object = None  # the loaders' collate_fn (None: stack the items)
    test_set: object = None  # where the run has a test split


class Task(Protocol):
    throughput_unit: str  # what throughput counts: "tokens" (language models) or "examples"
    batch_unit: str  # what the effective batch counts: "sequences" or "examples"
    perplexity: bool  # eval adds `ppl`, exp(loss)
    metrics: list  # the metrics each eval computes beside the loss (tasks/metrics.py)
    problem: str | None  # what the metrics' inputs are read as (tasks/metrics.py); None: from the outputs' shapes

    def directions(self) -> dict:
        """Each eval value (`val_loss`, `val_<metric>`) and whether higher or lower is better (`maximize`,
        `minimize`, or None where it is not known)."""

    def check(self) -> None:
        """On the driver, before anything launches: what the config cannot say is wrong (files, imports, a model's
        config); raises ConfigError."""

    def identity(self) -> dict:
        """What a checkpoint must match to be resumed into this task's model."""

    def prepare(self):
        """The data prepared once, outside the ranks (the driver, a SLURM job before torchrun, xtrain.prepare)."""

    def on_meta(self):
        """The model on the meta device: its parameters counted and its blocks found without memory."""

    def data(self) -> TaskData:
        """The datasets and their collate, without a model (`model` None): what `xtrain.eval` evaluates."""

    def build(self, accelerator) -> TaskData:
        """The model and the train/val (and test) sets. Every rank calls it; data preparation happens once (main
        first)."""

    def weight(self, batch):
        """What the micro-batch's loss averages over (trained tokens, positions, examples): an int where it is the
        same on every rank without looking (examples, full blocks), else a tensor."""

    def loss(self, model, batch, per):
        """The training loss of a micro-batch: its summed loss over `per` (a scalar tensor), the weight one
        micro-batch of the optimizer step holds on average over its micro-batches and ranks."""

    def eval_losses(self, model, batch):
        """Per example of a validation batch, its summed loss and the number of tokens it covers: the eval loss
        is their ratio over the whole split (each token weighs the same)."""

    def eval_outputs(self, model, batch):
        """For tasks with `metrics`: `eval_losses`' two tensors, then each example's outputs (fp32) and target."""

    def count(self, batch) -> int:
        """How much of `throughput_unit` the batch trains on (throughput, `train/<unit>_seen`)."""

    def export(self, model, state_dict: dict, out: Path) -> None:
        """Write the trained model (unwrapped, with its full state dict) into `out` on the main process: each
        directory there (`model`, ...) replaces the run dir's of that name."""

    def samples(self, model, prompts: list[str], max_tokens: int) -> list[str]:
        """The model's answers to `prompts` (every rank calls it)."""
