"""The optimizer and its schedule: AdamW, linear warmup, cosine decay (trainer.* settings)."""

from __future__ import annotations

import math

import torch

from xtrain.config.schema import Offload, RunConfig, TrainerConfig
from xtrain.distributed.cpu_seams import zero_on_cpu


def build_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on biases, norms). Under ZeRO-Offload, DeepSpeed's
    DeepSpeedCPUAdam (vectorized C++ on the host copy; torch's AdamW there is several times slower), except
    in the CPU test seam, whose DeepSpeed is told to accept torch's (cpu_seams.accept_torch_adamw_offloaded)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = {id(p) for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2}  # ZeRO-3 params are flat 1-d shards
    groups = [
        {"params": [p for p in params if id(p) in matrix], "weight_decay": cfg.trainer.weight_decay},
        {"params": [p for p in params if id(p) not in matrix], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]  # LoRA trains matrices only; DeepSpeed drops an empty group
    hyper = dict(lr=cfg.trainer.lr, betas=(0.9, 0.95), eps=1e-8)
    if cfg.strategy.offload_optimizer is not Offload.none and not zero_on_cpu(cfg.strategy):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **hyper)
    return torch.optim.AdamW(groups, **hyper, fused=cfg.trainer.fused_optimizer or None)


def lr_factor(step: int, trainer: TrainerConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `max_steps`."""
    t = trainer
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_hyperparameters(optimizer, scheduler, cfg: RunConfig) -> None:
    """A restored optimizer and schedule take run.yaml's learning rate and weight decay (a resume with
    resume_changes=apply); the schedule's shape (warmup, max_steps, min_lr_ratio) is run.yaml's already."""
    schedule = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper
    schedule.base_lrs = [cfg.trainer.lr] * len(schedule.base_lrs)
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.trainer.lr
        group["lr"] = cfg.trainer.lr * lr_factor(schedule.last_epoch, cfg.trainer)
        first = group["params"][0]
        if len(getattr(first, "ds_shape", first.shape)) >= 2:  # the matrices' group (build_optimizer)
            group["weight_decay"] = cfg.trainer.weight_decay
