"""One optimizer step: its micro-batches, each one's loss averaged over what the whole step trains on (the task's
`weight`, across micro-batches and ranks: `grad_accum=k` trains as a k times larger batch), and the one all-reduce
after it by which every rank agrees on its loss, its count and whether to stop."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from xtrain.config.schema import TrainerConfig
from xtrain.core import stopping
from xtrain.core.errors import Diverged
from xtrain.parallel import tensor_parallel
from xtrain.tasks.base import Task


def optimizer_step(accelerator: Accelerator, c, batches, grad_accum: int, max_grad_norm: float):
    """One optimizer step over `grad_accum` micro-batches of the loop's components `c`; returns their summed loss,
    this rank's count of the task's unit (tokens, examples) and the learning rate the step used. The loss is averaged
    over what the whole step trains on, across its micro-batches and ranks (the task's `weight`: trained tokens,
    examples), so `grad_accum=k` trains as a k times larger batch does. The schedule counts optimizer steps taken: a
    step the loss scaler skipped (fp16 overflow) does not advance it."""
    micro = [next(batches) for _ in range(grad_accum)]
    per = per_micro_batch(accelerator, c.task, micro)
    lr = c.optimizer.param_groups[0]["lr"]  # (a resume with a new lr set it there, not in the schedule's record)
    loss_sum, count = c.parallelism.train_step(accelerator, c, micro, per, max_grad_norm)
    return loss_sum, count, lr


def per_micro_batch(accelerator: Accelerator, task: Task, micro: list):
    """What one micro-batch's loss is divided by: the step's total weight (over its micro-batches and every rank) per
    micro-batch and rank. Accelerate divides each loss by grad_accum and DDP averages gradients over ranks, so the
    step's gradient is that of the summed loss over the total. Weights the task counts without looking (examples,
    full blocks) are the same on every rank: no collective."""
    weights = [task.weight(batch) for batch in micro]
    if not any(torch.is_tensor(w) for w in weights):
        return sum(weights) / len(micro)
    total = torch.stack([torch.as_tensor(w, device=accelerator.device) for w in weights]).sum().double()
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(total)
        total = total / accelerator.num_processes
    return (total / len(micro)).float()


def agree_on_step(accelerator: Accelerator, loss_sum: torch.Tensor, count: int,
                  saving: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor | float, int, bool, bool, bool]:
    """After each step: its loss summed over micro-batches (every rank's mean), the units every rank trained on,
    whether any rank was asked to stop, and whether every rank's files of the save in flight are written and
    published (`saving`: this rank's, saving.Saver.flags). Several ranks agree in one all-reduce, read at once (each
    must know whether to stop). One process reads nothing: its loss stays on the device for `read_losses`, since a
    read waits for the device to finish the step, which then idles until the host has issued the next one."""
    asked = stopping.requested() is not None
    if accelerator.num_processes == 1:
        return loss_sum, count, asked, saving[0] == 1.0, saving[1] == 1.0
    own = torch.stack([loss_sum.float(), *torch.tensor([float(asked), float(count), *saving], device=loss_sum.device)])
    mean_loss_sum, stop, mean_count, written, published = accelerator.reduce(own, "mean").tolist()
    return (mean_loss_sum, round(mean_count * tensor_parallel.data_parallel_size(accelerator)), stop > 0,
            written == 1.0, published == 1.0)


def read_losses(unread: list[tuple[int, torch.Tensor | float]], last_finite: tuple[int, float] | None,
                trainer: TrainerConfig) -> list[tuple[int, float]]:
    """The steps' losses (`agree_on_step`'s sums, over `trainer.grad_accum`) in one read, in step order. A NaN or
    infinite one ends the run, naming its step and the last finite loss before it (`last_finite`)."""
    on_device = [value for _, value in unread if torch.is_tensor(value)]
    read = iter(torch.stack(on_device).tolist() if on_device else [])
    losses = []
    for step, value in unread:
        loss = (next(read) if torch.is_tensor(value) else value) / trainer.grad_accum
        if not math.isfinite(loss):
            before = (f"last finite loss {last_finite[1]:.4f} at step {last_finite[0]}" if last_finite
                      else "the first step")
            raise Diverged(
                f"step {step}: the loss is {loss} ({before}); training diverged: lower trainer.lr "
                f"(now {trainer.lr:g}) or raise trainer.warmup_steps (now {trainer.warmup_steps})"
            )
        losses.append((step, loss))
        last_finite = (step, loss)
    return losses
