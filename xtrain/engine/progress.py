"""The loop's counters as it trains, and where they start: the checkpoint a requeued job resumes, the first batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator

from xtrain.core import machine
from xtrain.engine import checkpoint, reporting
from xtrain.engine.monitor import Monitor
from xtrain.engine.result import Result


@dataclass
class Progress:
    """The loop's counters; `seen` (in the task's unit) and `skipped` travel in checkpoints."""

    step: int
    seen: int
    skipped: int  # optimizer steps the fp16 loss scaler skipped
    window: reporting.Window = field(default_factory=reporting.Window)
    last_finite: tuple[int, float] | None = None
    unread: list = field(default_factory=list)  # (step, loss) of steps whose loss is still on the device
    pruned: bool = False  # a study's pruner asked this trial to stop
    best: dict = field(default_factory=dict)  # best_val_<metric> so far (travels in checkpoints)
    monitor: Monitor | None = None  # trainer.monitor's best so far (travels in checkpoints)
    early_stop: bool = False  # trainer.early_stop_patience evals without improvement
    callback_stop: str | None = None  # a callback asked to stop (its reason)


def resume_setting(resume: str, run_dir: Path) -> str:
    """`resume` as run.yaml has it, except in a run its scheduler restarted (a requeued SLURM job, a Ray run after a
    lost node): that continues its own newest checkpoint."""
    restarted = machine.restart_count() > 0
    return "auto" if restarted and checkpoint.newest(run_dir) is not None else resume


def recording_first_batch(batches, accelerator: Accelerator, record: Result):
    """Record which data each rank got first (the sum of its ids): the shards must differ."""
    batch = next(batches)
    ids = sum(value.sum() for value in (batch.values() if isinstance(batch, dict) else batch) if torch.is_tensor(value))
    record.first_batch_sums = accelerator.gather(ids.reshape(1)).tolist()
    yield batch
    yield from batches
