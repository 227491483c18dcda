"""What a run trains with: the task's model and data, the optimizer and schedule, their loaders, all passed
through `accelerator.prepare` (the model first built on meta and sharded or placed where the strategy asks, split
over the mesh's tp axis where it has one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from xtrain.config.schema import RunConfig
from xtrain.core.errors import ConfigError
from xtrain.parallel import dims, fp8, strategies
from xtrain.parallel.base import Parallelism
from xtrain.engine import sampler
from xtrain.engine.optim import build_optimizer, build_scheduler
from xtrain.tasks.base import Task
from xtrain.tasks.facts import stored_numel


@dataclass
class Components:
    """Everything the loop needs, already passed through `accelerator.prepare`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: DataLoader
    val_loader: DataLoader
    task: Task
    n_params: int
    n_trainable: int | None  # where not every parameter trains (LoRA)
    n_train: int
    n_val: int
    unit: str  # what one example is, for the log line: "blocks of 128 tokens"
    test_loader: DataLoader | None = None  # where the run has a test split
    fp8: fp8.Trained | None = None  # which linear layers train in fp8 (torchao)
    parallelism: Parallelism | None = None  # how the model is spread over the ranks (its step, evals, export)


def build_components(cfg: RunConfig, accelerator: Accelerator, task: Task) -> Components:
    t = cfg.trainer
    built = task.build(accelerator)
    model, (train_set, val_set) = built.model, few_batches(cfg, built.train_set, built.val_set)
    if t.max_epochs is not None:
        steps_in_epochs(cfg, len(train_set), built.unit, accelerator.is_main_process)
    parallelism = strategies.of(cfg)
    model = parallelism.prepare_model(cfg, accelerator, model)
    model.train()
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg.trainer)
    # Own generators: starting an iterator then draws its seed from them, not from the global RNG that
    # dropout uses, so a resume that starts mid-epoch sees the same dropout masks as an unbroken run.
    shuffle = not t.overfit_batches
    train_loader = DataLoader(train_set, batch_size=t.batch_size, shuffle=shuffle, drop_last=True,
                              generator=torch.Generator().manual_seed(t.seed), collate_fn=built.collate)
    val_loader = DataLoader(val_set, batch_size=t.batch_size, generator=torch.Generator().manual_seed(t.seed),
                            collate_fn=built.collate)
    if len(train_loader) == 0:
        raise ConfigError(
            f"trainer.batch_size={t.batch_size}: larger than the {len(train_set)} training {built.unit}; "
            "use a smaller batch"
        )
    counts = {p.requires_grad: 0 for p in model.parameters()}
    for p in model.parameters():
        counts[p.requires_grad] += stored_numel(p)
    n_params, n_trainable = sum(counts.values()), (counts.get(True, 0) if counts.get(False) else None)
    n_params = parallelism.whole_parameters(model, n_params)
    test_loader = None if built.test_set is None else DataLoader(built.test_set, batch_size=t.batch_size,
                                                                  collate_fn=built.collate)
    model, optimizer, train_loader, val_loader, scheduler = parallelism.prepare(
        accelerator, model, optimizer, train_loader, val_loader, scheduler)
    test_loader = test_loader if test_loader is None else parallelism.prepare_loader(accelerator, model, test_loader)
    # the same order at any world size, without a Python list of every epoch
    if shuffle:
        sampler.lean(train_loader, dims.effective_batch(cfg))
    return Components(
        model=model, optimizer=optimizer, scheduler=scheduler, train_loader=train_loader, val_loader=val_loader,
        task=task, n_params=n_params, n_trainable=n_trainable, n_train=len(train_set), n_val=len(val_set), unit=built.unit + built.unit_note,
        test_loader=test_loader, fp8=fp8.trained(model) if fp8.with_torchao(cfg) else None, parallelism=parallelism,
    )


def few_batches(cfg: RunConfig, train_set, val_set) -> tuple:
    """The train and validation sets of a debug run: `trainer.limit_train_batches`, `limit_val_batches` or
    `overfit_batches` micro-batches of each process (the sets' first examples), or the sets as they are."""
    from torch.utils.data import Subset

    t = cfg.trainer
    per_batch = t.batch_size * dims.of(cfg).data_parallel

    def first(dataset, batches: int):
        return Subset(dataset, range(min(len(dataset), batches * per_batch))) if batches else dataset

    if t.overfit_batches:
        fixed = first(train_set, t.overfit_batches)
        return fixed, fixed
    return first(train_set, t.limit_train_batches), first(val_set, t.limit_val_batches)


def steps_in_epochs(cfg: RunConfig, examples: int, unit: str, main: bool) -> None:
    """`trainer.max_epochs` as optimizer steps, now that the train examples are known (an epoch: whole steps of the
    effective batch); the main process logs it and records it in run.yaml."""
    from xtrain.core import rundir

    t, batch = cfg.trainer, dims.effective_batch(cfg)
    per_epoch = examples // batch
    if per_epoch == 0:
        raise ConfigError(f"trainer.max_epochs={t.max_epochs}: an epoch of the {examples} training {unit} is less than "
                          f"one step of {batch}; use a smaller trainer.batch_size or trainer.grad_accum")
    t.with_epochs(per_epoch)
    line = (f"{rundir.EPOCHS}={t.max_epochs}: {t.max_steps} steps ({per_epoch} an epoch: {examples} training {unit}, "
            f"{batch} a step), warmup {t.warmup_steps}")
    if main:
        import logging

        logging.getLogger("xtrain").info("trainer.max_epochs=%d: %d steps (%d an epoch)", t.max_epochs, t.max_steps,
                                         per_epoch)
        rundir.add_history(cfg.run_dir, line)
