"""Evaluation at `trainer.eval_every`: the task's val loss over the whole val split (per trained token), and
the model's greedy answers to `trainer.sample_prompts`, logged and sent to the trackers."""

from __future__ import annotations

import logging
import math
import sys
import time

import torch
from accelerate import Accelerator

from xtrain.config.schema import RunConfig, TrainerConfig
from xtrain.tasks.base import Task

log = logging.getLogger("xtrain")


def perplexity(loss: float) -> float:
    """exp(loss); infinite past what a float holds (a finite loss above ~709.8: math.exp raises there)."""
    return math.exp(loss) if loss < math.log(sys.float_info.max) else math.inf


@torch.no_grad()
def evaluate(accelerator: Accelerator, task: Task, model, loader) -> dict[str, float]:
    """The task's eval loss per trained token (per example), and its metrics, over the whole validation split:
    every rank's part, gathered without the samples a distributed sampler pads in."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    preds, targets = [], []
    for batch in loader:
        if task.metrics:
            sums, counts, pred, target = accelerator.gather_for_metrics(task.eval_outputs(model, batch))
            preds.append(pred.cpu())
            targets.append(target.cpu())
        else:
            sums, counts = accelerator.gather_for_metrics(task.eval_losses(model, batch))
        total, count = total + sums.double().sum().cpu(), count + int(counts.sum())
    model.train()
    values = {"loss": (total / count).item()}
    if task.perplexity:
        values["ppl"] = perplexity(values["loss"])
    if task.metrics:
        pred, target = torch.cat(preds), torch.cat(targets)
        values.update({metric.name: metric.compute(pred, target) for metric in task.metrics})
    return values


def run_eval(accelerator: Accelerator, cfg: RunConfig, c, step: int, result: dict) -> float:
    """Evaluate, log, record `val_<name>` (and the best so far, `best_val_<name>`) in `result`, answer the sample
    prompts, and add the time it took to `eval_time_s` (this attempt's). Returns the val loss."""
    from xtrain.engine import reporting
    from xtrain.tasks.metrics import MAXIMIZED

    start = time.perf_counter()
    values = evaluate(accelerator, c.task, c.model, c.val_loader)
    accelerator.log({f"val/{name}": value for name, value in values.items()}, step=step)
    for name, value in values.items():
        result[f"val_{name}"] = value
        best, pick = result.get(f"best_val_{name}"), max if name in MAXIMIZED else min
        result[f"best_val_{name}"] = value if best is None else pick(best, value)
    log.info("step %d | %s", step, reporting.eval_text(result))
    if cfg.trainer.sample_prompts:
        log_samples(accelerator, cfg.trainer, c, step)
    result["eval_time_s"] = round(result.get("eval_time_s", 0.0) + time.perf_counter() - start, 3)
    return values["loss"]


def log_samples(accelerator: Accelerator, trainer: TrainerConfig, c, step: int) -> None:
    """The task's greedy answers to `trainer.sample_prompts`: a log line each, and `sample/<i>` in metrics.jsonl
    and the trackers (text)."""
    model = accelerator.unwrap_model(c.model)
    model.eval()
    answers = c.task.samples(model, trainer.sample_prompts, trainer.sample_max_tokens)
    model.train()
    accelerator.log({f"sample/{i}": f"{prompt} -> {answer}"
                     for i, (prompt, answer) in enumerate(zip(trainer.sample_prompts, answers))}, step=step)
    for prompt, answer in zip(trainer.sample_prompts, answers):
        log.info("step %d | sample | %s -> %s", step, prompt, answer)
