"""What a run reports as it trains: the train rows (metrics.jsonl, the trackers, a log line) and the eval's text,
in the task's throughput unit (tokens for language models, examples for the others)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("xtrain")


@dataclass
class Window:
    """Train loss and throughput since the last log line."""

    loss_sum: float = 0.0
    steps: int = 0
    count: int = 0  # in the task's unit (tokens, examples)
    start: float = field(default_factory=time.perf_counter)


def log_train(accelerator, window: Window, step: int, scheduler, seen: int, skipped: int, unit: str) -> float:
    """Log the window's mean train loss (over every rank), lr and throughput; returns the loss."""
    train_loss = window.loss_sum / window.steps
    metrics = {
        "train/loss": train_loss,
        "train/lr": scheduler.get_last_lr()[0],
        f"train/{unit}_per_s": window.count / (time.perf_counter() - window.start),
        f"train/{unit}_seen": seen,
        "train/skipped_steps": skipped,  # optimizer steps the fp16 loss scaler skipped (overflow), so far
    }
    accelerator.log(metrics, step=step)
    log.info("step %d | loss %.4f | lr %.2e | %.0f %s/s", step, train_loss, metrics["train/lr"],
             metrics[f"train/{unit}_per_s"], unit)
    return train_loss


def eval_text(values: dict, final: bool = False) -> str:
    """`val loss 4.6078 | val ppl 100.3` (at the end: `val loss 4.6078 (ppl 100.3)`), or
    `val loss 0.2110 | val accuracy 0.9611 | val f1_macro 0.9603`."""
    text = f"val loss {values['val_loss']:.4f}"
    if "val_ppl" in values:
        text += f" (ppl {values['val_ppl']:.1f})" if final else f" | val ppl {values['val_ppl']:.1f}"
    names = [k for k in values if k.startswith("val_") and k not in ("val_loss", "val_ppl")]
    return text + "".join(f" | val {name[4:]} {values[name]:.4f}" for name in names)
