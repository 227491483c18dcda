"""Evaluation at `trainer.eval_every`: the task's val loss over the whole val split (per trained token, position or
example), its metrics, and the model's greedy answers to `trainer.sample_prompts`, logged and sent to the trackers.
A metric whose value is an array (a confusion matrix, a curve) is saved per eval in the run dir (`evals/`)."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from xtrain.config.schema import RunConfig, TrainerConfig
from xtrain.core.files import write_atomic
from xtrain.core.rundir import EVALS, checkpoint_name
from xtrain.parallel import tensor_parallel
from xtrain.engine import sampler
from xtrain.engine.result import Evals
from xtrain.tasks import metrics
from xtrain.tasks.base import Task

log = logging.getLogger("xtrain")


def perplexity(loss: float) -> float:
    """exp(loss); infinite past what a float holds (a finite loss above ~709.8: math.exp raises there)."""
    return math.exp(loss) if loss < math.log(sys.float_info.max) else math.inf


@torch.no_grad()
def evaluate(accelerator: Accelerator, task: Task, model, loader, keep_outputs: bool = False, parallelism=None):
    """The task's eval loss per trained token (per example), and its metrics, over the whole split: every rank's
    part, gathered without the samples a distributed sampler pads in. A metric's value is a float, or a nested list
    (an array). Returns (the values, the gathered outputs where there are metrics or `keep_outputs` asks, else
    None). `parallelism`: the run's, where the model is one it spreads over ranks its own way (pipeline stages)."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    outputs, targets = [], []
    with_outputs = bool(task.metrics) or (keep_outputs and hasattr(task, "eval_outputs"))
    for batch in loader:
        if with_outputs:
            sums, counts, out, target = tensor_parallel.gather_data_parallel(accelerator, task.eval_outputs(model, batch))
            outputs.append(out.cpu())
            targets.append(target.cpu())
        else:
            sums, counts = (parallelism.eval_losses(accelerator, task, model, batch) if parallelism is not None else
                            tensor_parallel.gather_data_parallel(accelerator, task.eval_losses(model, batch)))
        total, count = total + sums.double().sum().cpu(), count + int(counts.sum())
    model.train()
    values = {"loss": (total / count).item()}
    if task.perplexity:
        values["ppl"] = perplexity(values["loss"])
    gathered = metrics.Outputs(torch.cat(outputs), torch.cat(targets), task.problem) if with_outputs else None
    if task.metrics:
        values.update(metrics.compute_all(task.metrics, gathered))
    return values, gathered


def run_eval(accelerator: Accelerator, cfg: RunConfig, c, step: int, evals: Evals, run_dir: Path) -> float:
    """Evaluate, log, record the values in `evals` (the latest and the best of each), save the arrays, answer the
    sample prompts, and add the time it took to this attempt's. Returns the val loss."""
    from xtrain.engine import reporting

    start = time.perf_counter()
    values, _ = evaluate(accelerator, c.task, c.model, c.val_loader, parallelism=c.parallelism)
    scalars = {name: value for name, value in values.items() if metrics.is_scalar(value)}
    epoch = sampler.epochs(step, cfg.trainer.grad_accum, c.train_loader)
    accelerator.log({**{f"val/{name}": value for name, value in scalars.items()}, "epoch": epoch}, step=step)
    evals.record(scalars, c.task.directions(), cfg.trainer.monitor)
    evals.step = step
    arrays = {name: value for name, value in values.items() if name not in scalars}
    if arrays and accelerator.is_main_process:
        evals.files = save_arrays(run_dir, step, arrays)
    log.info("step %d | %s", step, reporting.eval_text(evals.latest))
    if cfg.trainer.sample_prompts:
        log_samples(accelerator, cfg.trainer, c, step)
    evals.add_time(time.perf_counter() - start)
    return values["loss"]


def run_test(accelerator: Accelerator, c, step: int, run_dir: Path) -> dict:
    """The test split on the model as it is at `step` (the one `model/` is about to hold): its values as
    `test_<name>`, and `step`; its arrays saved as `evals/test_<name>/`."""
    values, _ = evaluate(accelerator, c.task, c.model, c.test_loader, parallelism=c.parallelism)
    arrays = {f"test_{name}": value for name, value in values.items() if not metrics.is_scalar(value)}
    if arrays and accelerator.is_main_process:
        save_arrays(run_dir, step, arrays)
    return {"step": step, **{f"test_{name}": value for name, value in values.items() if metrics.is_scalar(value)}}


def report_test(accelerator: Accelerator, kept_test: dict, step: int) -> dict:
    """At the end: the kept model's test values (`test_<name>`, for result.json), in metrics.jsonl and the trackers
    (`test/<name>`, at the last step), and a log line."""
    tested = {key: value for key, value in kept_test.items() if key != "step"}
    accelerator.log({f"test/{key[len('test_'):]}": value for key, value in tested.items()}, step=step)
    text = " | ".join(f"{key.replace('_', ' ', 1)} {value:.4f}" for key, value in tested.items())
    log.info("step %d | %s (the model of step %d)", step, text, kept_test["step"])
    return tested


def save_arrays(run_dir: Path, step: int, arrays: dict) -> dict[str, list[str]]:
    """`evals/<name>/step_N.json` for each array this eval computed (and `.png` for a square matrix); every eval
    file in the run dir, by metric, as result.json lists them."""
    for name, value in arrays.items():
        where = run_dir / EVALS / name
        where.mkdir(parents=True, exist_ok=True)
        write_atomic(where / f"{checkpoint_name(step)}.json", json.dumps({"step": step, name: value}) + "\n")
        tensor = torch.tensor(value) if _rectangular(value) else None
        if tensor is not None and tensor.dim() == 2 and tensor.shape[0] == tensor.shape[1]:
            write_atomic(where / f"{checkpoint_name(step)}.png", matrix_png(tensor, f"{name}, step {step}"))
    return eval_files(run_dir)


def eval_files(run_dir: Path) -> dict[str, list[str]]:
    root = run_dir / EVALS
    return {d.name: sorted(str(f.relative_to(run_dir)) for f in d.iterdir() if f.suffix in (".json", ".png"))
            for d in sorted(root.iterdir()) if d.is_dir()} if root.is_dir() else {}


def _rectangular(value) -> bool:
    try:
        torch.tensor(value)
        return True
    except (ValueError, TypeError):
        return False


def matrix_png(matrix: torch.Tensor, title: str) -> bytes:
    """A square matrix (a confusion matrix: rows the targets, columns the predictions) as a labelled heatmap."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = matrix.shape[0]
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * n, 1 + 0.45 * n))
    image = ax.imshow(matrix.double().numpy(), cmap="Blues")
    if n <= 20:
        middle = float(matrix.double().max()) / 2
        for i in range(n):
            for j in range(n):
                value = matrix[i, j].item()
                ax.text(j, i, f"{value:g}", ha="center", va="center", fontsize=8,
                        color="white" if value > middle else "black")
    ax.set(xlabel="predicted", ylabel="target", title=title)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


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
