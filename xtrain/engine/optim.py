"""The optimizer and its schedule: AdamW, linear warmup, cosine decay (trainer.* settings), or the user's own by
`_target_` (`trainer.optimizer`, `trainer.scheduler`). `trainer.lr` is the peak rate either way: a schedule that takes
its own peak (`max_lr`: OneCycleLR, CyclicLR) gets it where its node leaves it unset, as `total_steps` gets
`trainer.max_steps`."""

from __future__ import annotations

import logging
import math

import torch

from xtrain.config.schema import RunConfig, TrainerConfig
from xtrain.config.task import given
from xtrain.config.trainer import ADAMW
from xtrain.core import seams
from xtrain.parallel import strategies
from xtrain.tasks.targets import call, importable, resolve, takes

log = logging.getLogger("xtrain")

TOTAL_STEPS = ("total_steps", "num_training_steps", "T_max", "total_iters")  # filled from trainer.max_steps
PEAK_RATES = ("max_lr",)  # a schedule's own peak rate (OneCycleLR, CyclicLR): filled from trainer.lr


def build_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on biases, norms). Under ZeRO-Offload, DeepSpeed's
    DeepSpeedCPUAdam (vectorized C++ on the host copy; torch's AdamW there is several times slower), except
    in the CPU test seam, whose DeepSpeed is told to accept torch's (tests/seams/zero_on_cpu.py)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = decay_groups(model, cfg.trainer.weight_decay)
    node = given(cfg.trainer.optimizer)
    if node is not None or given(cfg.trainer.scheduler):
        importable(cfg.task.code_dir)
    if node is not None:
        return users_optimizer(node, groups, params, cfg.trainer)
    hyper = dict(lr=cfg.trainer.lr, **ADAMW)
    if strategies.of(cfg).optimizer_on_host(cfg) and not seams.first("runs_on_cpu", "zero", cfg):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **hyper)
    return torch.optim.AdamW(groups, **hyper, fused=cfg.trainer.fused_optimizer is True or None)


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trained parameters in two groups: the matrices with `weight_decay`, then the rest (biases, norms) with
    none; an empty group left out (LoRA trains matrices only; DeepSpeed drops an empty group)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = {id(p) for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2}  # ZeRO-3 params are flat 1-d shards
    groups = [
        {"params": [p for p in params if id(p) in matrix], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) not in matrix], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def users_optimizer(node: dict, groups: list, params: list, trainer: TrainerConfig) -> torch.optim.Optimizer:
    """`trainer.optimizer`: the decay/no-decay groups with `trainer.weight_decay` (all parameters in one group where
    the node gives its own `weight_decay`, or the optimizer takes none) and `trainer.lr` unless the node gives one."""
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    target = node["_target_"]
    if "weight_decay" in kwargs or not takes(resolve("trainer.optimizer", target), "weight_decay"):
        groups = [{"params": params}]
    kwargs.setdefault("lr", trainer.lr)
    return call("trainer.optimizer", {"_target_": target, **kwargs}, params=groups)


def build_scheduler(optimizer, trainer: TrainerConfig):
    """`trainer.scheduler` (given the optimizer, and `max_steps` where it takes a total-steps argument), else the
    default: linear warmup, then cosine decay."""
    node = given(trainer.scheduler)
    if node is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, trainer))
    target = resolve("trainer.scheduler", node["_target_"])
    totals = {name: trainer.max_steps for name in TOTAL_STEPS if name not in node and takes(target, name)}
    peaks = {name: trainer.lr for name in PEAK_RATES if name not in node and takes(target, name)}
    return call("trainer.scheduler", node, optimizer=optimizer, **totals, **peaks)


def lr_unused(trainer: TrainerConfig) -> str | None:
    """Why `trainer.lr` does nothing in this run (the rate is set elsewhere), or None where it is the peak rate."""
    node = given(trainer.scheduler)
    if node is not None:
        target = resolve("trainer.scheduler", node["_target_"])
        for name in PEAK_RATES:
            if takes(target, name):
                return f"trainer.scheduler.{name}={node[name]} sets the peak rate" if name in node else None
    node = given(trainer.optimizer)
    if node is not None and "lr" in node:
        return f"trainer.optimizer.lr={node['lr']} sets the rate"
    return None


def check(cfg: RunConfig) -> None:
    """On the driver, before anything launches: the user's optimizer and schedule import and build (on a stand-in
    parameter), so that a wrong `_target_` or argument is one line before any run dir is written."""
    node = given(cfg.trainer.optimizer)
    if node is not None or given(cfg.trainer.scheduler):
        importable(cfg.task.code_dir)
        params = list(torch.nn.Linear(2, 2).parameters())
        optimizer = (users_optimizer(node, [{"params": params}], params, cfg.trainer) if node is not None
                     else torch.optim.AdamW(params, lr=cfg.trainer.lr))
        build_scheduler(optimizer, cfg.trainer)
        unused = lr_unused(cfg.trainer)
        if unused:
            log.warning("trainer.lr=%g is not used: %s", cfg.trainer.lr, unused)


def state_bytes(cfg: RunConfig) -> float | None:
    """The bytes a parameter the run's own optimizer (`trainer.optimizer`) keeps as state: measured on a stand-in
    fp32 parameter after one step (SGD 0, with momentum 4, Adagrad 4, Adam 8). None for the default AdamW (the
    estimate's own figure) and for an optimizer that cannot step so (one that needs a closure: LBFGS)."""
    node = given(cfg.trainer.optimizer)
    if node is None:
        return None
    importable(cfg.task.code_dir)
    weight = torch.nn.Parameter(torch.zeros(64, 64))
    optimizer = users_optimizer(node, [{"params": [weight]}], [weight], cfg.trainer)
    weight.grad = torch.full_like(weight, 1e-3)
    try:
        optimizer.step()
    except Exception:  # (its own error shows when the run steps it)
        return None
    held = [value for state in optimizer.state.values() for value in state.values()  # (not a step counter)
            if torch.is_tensor(value) and value.numel() > 1]
    return sum(value.numel() * value.element_size() for value in held) / weight.numel()


def lr_factor(step: int, trainer: TrainerConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `max_steps`."""
    t = trainer
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_hyperparameters(model: torch.nn.Module, optimizer, scheduler, cfg: RunConfig) -> None:
    """A restored optimizer and schedule take run.yaml's learning rate and weight decay (a resume with
    resume_changes=apply); the schedule's shape (warmup, max_steps, min_lr_ratio) is run.yaml's already. A user's
    optimizer takes its node's arguments (its momentum, its lr) in every group. The groups are known by the model's
    parameters, not the optimizer's: ZeRO's hold flat 1-d partitions (ZeRO-3's none between steps)."""
    node = given(cfg.trainer.optimizer)
    if node is not None:
        for group in optimizer.param_groups:
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in node.items()
                          if k != "_target_" and k in group})
        return
    schedule = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper
    schedule.base_lrs = [cfg.trainer.lr] * len(schedule.base_lrs)
    for group, built in zip(optimizer.param_groups, decay_groups(model, cfg.trainer.weight_decay), strict=True):
        group["initial_lr"] = cfg.trainer.lr
        group["lr"] = cfg.trainer.lr * lr_factor(schedule.last_epoch, cfg.trainer)
        group["weight_decay"] = built["weight_decay"]
