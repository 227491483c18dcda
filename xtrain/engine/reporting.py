"""What a run reports as it trains: the train rows (metrics.jsonl, the trackers, a log line) and the eval's text,
in the task's throughput unit (tokens for language models, examples for the others)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("xtrain")


@dataclass
class Window:
    """Train loss and throughput since the last log line: the time of its optimizer steps alone (not the evals,
    sample answers and checkpoint saves between them)."""

    loss_sum: float = 0.0
    steps: int = 0
    count: int = 0  # in the task's unit (tokens, examples)
    train_s: float = 0.0
    lr: float = 0.0  # the learning rate of the window's last step


def log_train(accelerator, window: Window, step: int, seen: int, skipped: int, unit: str) -> float:
    """Log the window's mean train loss (over every rank), the rate its last step used and its throughput; returns
    the loss."""
    train_loss = window.loss_sum / window.steps
    metrics = {
        "train/loss": train_loss,
        "train/lr": window.lr,
        f"train/{unit}_per_s": window.count / window.train_s if window.train_s > 0 else 0.0,
        f"train/{unit}_seen": seen,
        "train/skipped_steps": skipped,  # optimizer steps the fp16 loss scaler skipped (overflow), so far
    }
    accelerator.log(metrics, step=step)
    log.info("step %d | loss %.4f | lr %.2e | %s %s/s", step, train_loss, metrics["train/lr"],
             rate(metrics[f"train/{unit}_per_s"]), unit)
    return train_loss


def rate(per_s: float) -> str:
    """A throughput as the log shows it: whole numbers, 3 significant digits below 100."""
    return f"{per_s:.0f}" if per_s >= 100 else f"{per_s:.3g}"


def eval_text(values: dict, final: bool = False) -> str:
    """`val loss 4.6078 | val ppl 100.3` (at the end: `val loss 4.6078 (ppl 100.3)`), or
    `val loss 0.2110 | val accuracy 0.9611 | val f1_macro 0.9603`."""
    text = f"val loss {values['val_loss']:.4f}"
    if "val_ppl" in values:
        text += f" (ppl {values['val_ppl']:.1f})" if final else f" | val ppl {values['val_ppl']:.1f}"
    names = [k for k in values if k.startswith("val_") and k not in ("val_loss", "val_ppl")]
    return text + "".join(f" | val {name[4:]} {values[name]:.4f}" for name in names)
