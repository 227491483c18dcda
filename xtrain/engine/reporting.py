"""What a run reports as it trains: result.json as the loop starts (and the header line), the train rows
(metrics.jsonl, the trackers, a log line) and the eval's text, in the task's throughput unit (tokens for language
models, examples for the others)."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from xtrain.config.schema import RunConfig
from xtrain.core import machine, memory, rundir
from xtrain.engine.goodput import duration
from xtrain.parallel import compiling, dims, plugins
from xtrain.parallel.estimate import model_state_memory
from xtrain.engine import optim, sampler
from xtrain.engine.accelerator import fsdp_units

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
    began: float = field(default_factory=time.perf_counter)  # (the wall clock: evals and saves included, for the ETA)


def log_train(accelerator, window: Window, step: int, max_steps: int, seen: int, skipped: int, unit: str,
              speed, epoch: float) -> float:
    """Log the window's mean train loss (over every rank), the rate its last step used, its throughput (and MFU
    where known), the epochs, the steps done and the time left at the window's pace (its evals and saves included);
    returns the loss."""
    train_loss = window.loss_sum / window.steps
    per_s = window.count / window.train_s if window.train_s > 0 else 0.0
    metrics = {
        "train/loss": train_loss,
        "train/lr": window.lr,
        f"train/{unit}_per_s": per_s,
        f"train/{unit}_seen": seen,
        "train/skipped_steps": skipped,  # optimizer steps the fp16 loss scaler skipped (overflow), so far
        "epoch": epoch,
    }
    mfu = speed.mfu(per_s)
    if mfu is not None:
        metrics["train/mfu"] = mfu
    accelerator.log(metrics, step=step)
    per_step = (time.perf_counter() - window.began) / max(1, window.steps)
    log.info("step %d | loss %.4f | lr %.2e | %s %s/s%s | epoch %.2f | %d/%d steps, eta %s", step, train_loss,
             metrics["train/lr"], rate(per_s), unit, "" if mfu is None else f" | mfu {mfu:.1%}", epoch, step, max_steps,
             duration((max_steps - step) * per_step))
    return train_loss


def speed_text(result: dict, unit: str) -> str:
    """`14,231 tokens/s steady (9,876 over the whole run) | mfu 41.2%`."""
    text = (f"{rate(result[f'{unit}_per_s'])} {unit}/s steady ({rate(result[f'{unit}_per_s_whole_run'])} over the "
            "whole run)")
    return text if result.get("mfu") is None else f"{text} | mfu {result['mfu']:.1%}"


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


def processes(world: int, strategy: str, layout: dims.ParallelDims | None = None) -> str:
    """`1 process`, `2 processes (DDP)`, `8 processes (FSDP)`, `1 process (ZeRO-3)`, `4 processes (HSDP: 2 replicas x
    2 shards)`."""
    if world == 1 and strategy == "ddp":
        return "1 process"
    name = {"ddp": "DDP", "fsdp": "FSDP"}.get(strategy, strategy.replace("zero", "ZeRO-"))
    if layout is not None and layout.composed:
        name = layout.words()
    return f"{world} process{'es' if world > 1 else ''} ({name})"


def first_result(cfg: RunConfig, accelerator: Accelerator, c, resume_from: Path | None,
                 start_step: int, n_params_meta: int, facts: plugins.ModelFacts) -> dict:
    """The run's facts in result.json as the loop starts, and its header line."""
    t, world, layout = cfg.trainer, accelerator.num_processes, dims.of(cfg)
    trains = f" ({c.n_trainable / 1e6:.2f}M trained)" if c.n_trainable is not None else ""
    per_epoch = sampler.steps_per_epoch(t.grad_accum, c.train_loader)
    log.info(
        "model %.2fM params%s | %d train / %d val %s | %s | effective batch %d %s, %s an epoch",
        c.n_params / 1e6, trains, c.n_train, c.n_val, c.unit, processes(world, cfg.strategy.name.value, layout),
        dims.effective_batch(cfg), c.task.batch_unit, f"{per_epoch} steps" if per_epoch else "less than a step",
    )
    if c.fp8 is not None:
        log.info(c.fp8.words())
    if resume_from is not None:
        log.info("resumed from %s at step %d", resume_from, start_step)
    result = {
        "max_steps": t.max_steps, "world_size": world,
        "precision": cfg.precision.name.value, "autocast": accelerator.native_amp,
        "model_parameters": c.n_params, "resumed_from": str(resume_from) if resume_from else None,
        "model_state_bytes_estimate": model_state_memory(n_params_meta, cfg, c.n_trainable, facts.quantized,
                                                         optimizer_state=optim.state_bytes(cfg)).total,
        "trainable_parameters": c.n_trainable or c.n_params, "process": rundir.this_process(),
        "mesh": layout.as_dict(), "data_parallel_size": layout.data_parallel, "effective_batch": dims.effective_batch(cfg),
        "steps_per_epoch": per_epoch, "examples": {"train": c.n_train, "val": c.n_val},
    }
    # each rank's machine, CPU threads and the cores it may run on (a multi-node run shows its nodes)
    own = (socket.gethostname(), torch.get_num_threads(), machine.bound_cores(), memory.parameter_bytes(c.model))
    every = [own] * world
    if world > 1:
        torch.distributed.all_gather_object(every, own)
    result["hosts"], result["cpu_threads"], result["cpu_cores"], result["parameter_bytes"] = (
        list(column) for column in zip(*every))
    if accelerator.distributed_type is DistributedType.FSDP:
        result["fsdp_units"] = fsdp_units(c.model)
    if c.fp8 is not None:
        result["fp8"] = {"scaling": c.fp8.scaling, "layers": list(c.fp8.converted), "kept_in_bf16": list(c.fp8.kept)}
    if cfg.trainer.compile:
        result["compiled_regions"] = compiling.compiled_regions(c.model)
    if world > 1:
        result["rendezvous"] = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        result["backend"] = torch.distributed.get_backend()  # nccl on GPUs, gloo on CPUs
    return result
