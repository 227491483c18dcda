"""Evaluation at `trainer.eval_every`: the task's val loss over the whole val split (per trained token), and
the model's greedy answers to `trainer.sample_prompts`, logged and sent to the trackers."""

from __future__ import annotations

import logging
import math
import sys
import time

import torch
from accelerate import Accelerator

from xtrain import tasks
from xtrain.config import RunConfig

log = logging.getLogger("xtrain")


def perplexity(loss: float) -> float:
    """exp(loss); infinite past what a float holds (a finite loss above ~709.8: math.exp raises there)."""
    return math.exp(loss) if loss < math.log(sys.float_info.max) else math.inf


@torch.no_grad()
def evaluate(accelerator: Accelerator, task: tasks.Task, model, loader) -> float:
    """The task's eval loss per trained token, over the whole validation split (every rank's part)."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for batch in loader:
        sums, counts = accelerator.gather_for_metrics(task.eval_losses(model, batch))
        total, count = total + sums.double().sum().cpu(), count + int(counts.sum())
    model.train()
    return (total / count).item()


def run_eval(accelerator: Accelerator, cfg: RunConfig, c, step: int, result: dict) -> float:
    """Evaluate, log, answer the sample prompts, and add the time it took to `eval_time_s` (this attempt's)."""
    start = time.perf_counter()
    val_loss = evaluate(accelerator, c.task, c.model, c.val_loader)
    accelerator.log({"val/loss": val_loss, "val/ppl": perplexity(val_loss)}, step=step)
    log.info("step %d | val loss %.4f | val ppl %.1f", step, val_loss, perplexity(val_loss))
    if cfg.trainer.sample_prompts:
        log_samples(accelerator, cfg, c, step)
    result["eval_time_s"] = round(result.get("eval_time_s", 0.0) + time.perf_counter() - start, 3)
    return val_loss


def log_samples(accelerator: Accelerator, cfg: RunConfig, c, step: int) -> None:
    """The task's greedy answers to `trainer.sample_prompts`: a log line each, and `sample/<i>` in metrics.jsonl
    and the trackers (text)."""
    model = accelerator.unwrap_model(c.model)
    model.eval()
    answers = c.task.samples(model, cfg.trainer.sample_prompts, cfg.trainer.sample_max_tokens)
    model.train()
    accelerator.log({f"sample/{i}": f"{prompt} -> {answer}"
                     for i, (prompt, answer) in enumerate(zip(cfg.trainer.sample_prompts, answers))}, step=step)
    for prompt, answer in zip(cfg.trainer.sample_prompts, answers):
        log.info("step %d | sample | %s -> %s", step, prompt, answer)
