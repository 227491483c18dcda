"""The training loop: one Accelerate loop over a run dir's resolved config.

`train(run_dir)` reads `run.yaml` (never composes config), builds the Accelerator (accelerator.py),
the task's model and data (tasks/), the optimizer and schedule, resumes if asked, trains for
`trainer.max_steps` optimizer steps with periodic logging, evaluation and checkpoints, and has the task
export the final model. Every rank runs this same function. What a batch means (its loss, its tokens,
the eval) is the task's: the loop knows nothing of causal LMs.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from xtrain.config import schema
from xtrain.config.schema import Export, Precision, RunConfig, Strategy, TrainerConfig
from xtrain.core import machine, memory, rundir, stopping
from xtrain.core.errors import ConfigError
from xtrain.core.files import replace_dir
from xtrain.core.rundir import Status
from xtrain.distributed import compiling, meta_init, plugins
from xtrain.engine import checkpoint, evaluation, pruning, reporting, resume, sampler, tracking
from xtrain.engine.accelerator import build_accelerator, check_setup, library_notes_quieted
from xtrain.engine.callbacks import CALLBACK_STOP, Callbacks
from xtrain.engine.monitor import EARLY_STOP, Monitor
from xtrain.engine.optim import build_optimizer, build_scheduler, set_hyperparameters
from xtrain.engine.speed import Speed, measure_speed
from xtrain.engine.update import agree_on_step, optimizer_step
from xtrain.tasks.base import Task
from xtrain.tasks.facts import model_facts, stored_numel
from xtrain.tasks.registry import task_for

log = logging.getLogger("xtrain")

# A multi-process run's objects that hold its process group (the DDP reducer, DeepSpeed's engine), kept until its
# worker process ends with os._exit, never torn down: a gloo group destroyed from the main thread while one of the
# group's own threads still disposes of the last collective's work deadlocks (that thread waits for the GIL, the main
# thread holds it and waits for the group's lock). Seen under load: a rank that had saved its stop never exited.
_HELD_UNTIL_EXIT: list = []


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
    pruning: pruning.Pruning | None = None  # where the run is a study's trial
    callbacks: Callbacks | None = None  # trainer.callbacks
    speed: Speed = field(default_factory=Speed)  # the steady rate's windows, MFU's FLOPs and peak


@dataclass
class Progress:
    """The loop's counters; `seen` (in the task's unit) and `skipped` travel in checkpoints."""

    step: int
    seen: int
    skipped: int  # optimizer steps the fp16 loss scaler skipped
    window: reporting.Window = field(default_factory=reporting.Window)
    last_finite: tuple[int, float] | None = None
    pruned: bool = False  # a study's pruner asked this trial to stop
    best: dict = field(default_factory=dict)  # best_val_<metric> so far (travels in checkpoints)
    monitor: Monitor | None = None  # trainer.monitor's best so far (travels in checkpoints)
    early_stop: bool = False  # trainer.early_stop_patience evals without improvement
    callback_stop: str | None = None  # a callback asked to stop (its reason)


def build_components(cfg: RunConfig, accelerator: Accelerator, task: Task) -> Components:
    t = cfg.trainer
    built = task.build(accelerator)
    model, train_set, val_set = built.model, built.train_set, built.val_set
    if meta_init.is_lazy(model):  # FSDP2: sharded now, before the optimizer exists, its shards then filled
        fsdp = cfg.strategy.name is Strategy.fsdp
        model = meta_init.shard(accelerator, model) if fsdp else meta_init.materialize(model, accelerator.device)
    if cfg.trainer.compile and cfg.strategy.name is Strategy.ddp:  # (the others compile in `prepare`)
        compiling.compile_blocks(model)
    model.train()
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg.trainer)
    # Own generators: starting an iterator then draws its seed from them, not from the global RNG that
    # dropout uses, so a resume that starts mid-epoch sees the same dropout masks as an unbroken run.
    train_loader = DataLoader(train_set, batch_size=t.batch_size, shuffle=True, drop_last=True,
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
    test_loader = None if built.test_set is None else DataLoader(built.test_set, batch_size=t.batch_size,
                                                                  collate_fn=built.collate)
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler
    )
    test_loader = test_loader if test_loader is None else accelerator.prepare(test_loader)
    sampler.lean(train_loader)  # the same order, without a Python list of every epoch
    return Components(
        model=model, optimizer=optimizer, scheduler=scheduler, train_loader=train_loader, val_loader=val_loader,
        task=task, n_params=n_params, n_trainable=n_trainable, n_train=len(train_set), n_val=len(val_set), unit=built.unit + built.unit_note,
        test_loader=test_loader,
    )


def restore(accelerator: Accelerator, resume_from: Path | None, run_dir: Path, cfg: RunConfig,
            c: Components) -> tuple[Progress, int, dict]:
    """Load the checkpoint, if any, and cut metrics.jsonl back to it: the loop's counters, on the main process the
    last step logged before the cut, and the settings that changed since the checkpoint (preflight allowed them;
    the optimizer's and the schedule's take effect here)."""
    direction = c.task.directions().get(cfg.trainer.monitor)
    progress = Progress(step=0, seen=0, skipped=0, monitor=Monitor.of(cfg.trainer, direction))
    last_logged, changed = 0, {}
    if resume_from is not None:
        checkpoint.load(accelerator, resume_from, only_trainable=cfg.model.lora.enabled)
        state = checkpoint.read_state(resume_from)
        window = state.get("log_window", {})  # a stop between two log lines: the next one covers both parts
        progress = Progress(step=state["step"], seen=state.get("seen", state.get("tokens_seen", 0)),
                            skipped=state.get("skipped_steps", 0),
                            window=reporting.Window(loss_sum=window.get("loss_sum", 0.0), steps=window.get("steps", 0)),
                            best=state.get("best", {}), monitor=Monitor.of(cfg.trainer, direction, state.get("monitor")))
        found = resume.changes(state["config"], schema.to_container(cfg)) if "config" in state else []
        if any(change.trains for change in found):  # (preflight refused what cannot apply)
            set_hyperparameters(c.optimizer, c.scheduler, cfg)
            log.info("resumed with new settings: %s", ", ".join(str(change) for change in found if change.trains))
        changed = resume.record(found)
    if accelerator.is_main_process:
        if progress.step:
            last_logged = rundir.keep_metrics_until(run_dir, progress.step)
        else:
            (run_dir / rundir.METRICS).unlink(missing_ok=True)
        rundir.keep_evals_until(run_dir, progress.step)
    accelerator.wait_for_everyone()
    return progress, last_logged, changed


def resume_setting(resume: str, run_dir: Path) -> str:
    """`resume` as run.yaml has it, except in a requeued SLURM job: that continues its own newest checkpoint."""
    restarted = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    return "auto" if restarted and checkpoint.newest(run_dir) is not None else resume


def train(run_dir: str | Path) -> dict:
    with library_notes_quieted():
        return _train(Path(run_dir))


def _train(run_dir: Path) -> dict:
    cfg = schema.load(str(run_dir / rundir.RUN_CONFIG))
    t = cfg.trainer
    # from the driver's start when it launched this worker, else from this process's start
    process_start = machine.launch_time()
    machine.name_deepspeed_accelerator()
    memory.reset_peaks()

    n_params_meta, facts = model_facts(cfg)
    accelerator = build_accelerator(cfg, run_dir, facts)
    check_setup(cfg, accelerator.distributed_type, accelerator.num_processes)
    # preflight (hardware.check) refuses what Accelerate would silently run in fp32
    assert cfg.precision.name is Precision.fp32 or accelerator.native_amp or plugins.is_zero(cfg.strategy), "no autocast"
    set_seed(t.seed)
    resume_from = checkpoint.resolve(resume_setting(cfg.resume, run_dir), run_dir, checkpoint.identity(cfg))
    if accelerator.is_main_process:
        checkpoint.remove_partial(run_dir)
    c = build_components(cfg, accelerator, task_for(cfg))
    examples_per_step = t.batch_size * t.grad_accum * accelerator.num_processes
    c.pruning = pruning.Pruning(run_dir, accelerator.is_main_process, examples_per_step)
    model_ready = memory.peaks(accelerator)["peak_rss_bytes"]  # built, placed: before any eval or step

    progress, last_logged, changed = restore(accelerator, resume_from, run_dir, cfg, c)
    start_step = progress.step
    trackers = tracking.init_kwargs(cfg.tracker, run_dir, accelerator.is_main_process, start_step, last_logged)
    accelerator.init_trackers(cfg.tracker.project, config=tracking.hyperparameters(cfg), init_kwargs=trackers)
    result = reporting.first_result(cfg, accelerator, c, resume_from, start_step, n_params_meta, facts)
    result["peak_rss_model_ready_bytes"] = model_ready
    result.update(progress.best, monitor=progress.monitor.state())
    if t.export is Export.best and progress.monitor.best_step is not None:  # model/ holds that eval's model
        kept = rundir.read_result(run_dir) if accelerator.is_main_process else {}
        result["model_step"] = progress.monitor.best_step
        if kept.get("model_step") == progress.monitor.best_step:
            result.update({key: kept[key] for key in ("model_eval", "model_test") if key in kept})
    if accelerator.is_main_process:
        if resume_from is not None and resume_from.parent == rundir.checkpoints_dir(run_dir):
            result.update(rundir.continued(run_dir, start_step, last_logged, changed))
        elif changed:  # resumed from another run's checkpoint
            result["changed_from_checkpoint"] = changed
        rundir.update_result(run_dir, result, fresh=True)  # this attempt's record, from the start

    c.speed = measure_speed(cfg, accelerator, c, c.n_params)
    train_start, seen_at_start = time.time(), progress.seen
    c.callbacks = Callbacks(cfg, accelerator, c.model, run_dir)
    c.callbacks.call("on_train_start", start_step, result)
    if start_step == 0:  # (the first eval also checks, on every task, that each metric can take its inputs)
        result["initial_val_loss"] = evaluation.run_eval(accelerator, cfg, c, 0, result, run_dir)
        judge(accelerator, cfg.trainer, c, progress, result, run_dir)
        c.callbacks.call("on_validation_end", 0, result, val_values(result))
    batches = _recording_first_batch(
        sampler.micro_batches(accelerator, c.train_loader, start_step * t.grad_accum), accelerator, result
    )
    bar = tqdm(
        total=t.max_steps, initial=start_step, desc="train", mininterval=1.0, dynamic_ncols=True,
        disable=not (accelerator.is_main_process and sys.stderr.isatty()),  # log files get the log lines only
    )
    try:
        with logging_redirect_tqdm():
            stop = run_steps(accelerator, cfg, c, batches, progress, result, run_dir, bar, process_start)
        wall = time.time() - train_start
        ended = stop is None or stop["signal"] in (EARLY_STOP, CALLBACK_STOP)
        if ended and t.export is Export.last:
            save_model(accelerator, c, run_dir, progress.step, result)
        if ended and "model_test" in result:  # the test split's values, of the model kept
            evaluation.report_test(accelerator, result, progress.step)
        if ended:
            c.callbacks.call("on_train_end", progress.step, result)
    except BaseException as err:
        stopped = isinstance(err, KeyboardInterrupt) or accelerator.num_processes > 1 and stopping.driver_gone()
        result["status"] = Status.interrupted if stopped else Status.failed
        result["error"] = f"{type(err).__name__}: {err}"
        if accelerator.is_main_process:
            rundir.update_result(run_dir, result)
        raise
    finally:
        bar.close()

    result.update(memory.peaks(accelerator))
    accelerator.end_training()  # destroys the process group: no collective after it
    if accelerator.num_processes > 1:
        _HELD_UNTIL_EXIT.append((accelerator, c))
    c.speed.record(result, c.task.throughput_unit, progress.seen - seen_at_start, time.time() - process_start)
    return finish(cfg.trainer, accelerator, result, stop, run_dir, c.task.throughput_unit, process_start, wall)


def finish(trainer: TrainerConfig, accelerator: Accelerator, result: dict, stop: dict | None, run_dir: Path,
           c_unit: str, process_start: float, wall: float) -> dict:
    """The final result.json: completed, or stopped on request at a step boundary (resumable)."""
    pruned = stop is not None and stop["signal"] == pruning.PRUNER
    early = stop is not None and stop["signal"] in (EARLY_STOP, CALLBACK_STOP)
    result.update(
        status=Status.completed if stop is None or early else Status.pruned if pruned else Status.interrupted,
        wall_time_s=round(time.time() - process_start, 3),
        train_time_s=round(wall, 3),
    )
    if early and stop["signal"] == CALLBACK_STOP:
        result["callback_stop"] = {"step": stop["step"], "reason": stop["reason"]}
    elif early:
        result["early_stop"] = {"step": stop["step"], "patience": trainer.early_stop_patience,
                                "best_step": result["monitor"]["best_step"]}
    elif pruned:
        result.update(stop=stop, error=f"pruned by the study's pruner at step {stop['step']}; its checkpoint is saved")
    elif stop is not None:
        result.update(stop=stop, error=f"stopped by {stop['signal']} at step {stop['step']}; its checkpoint is saved")
    if accelerator.is_main_process:
        rundir.update_result(run_dir, result)
        if stop is None or early:
            log.info("done: %d steps | %s | %s | %s", result["steps"], reporting.eval_text(result, final=True),
                     reporting.speed_text(result, c_unit), run_dir)
    return result


def run_steps(accelerator: Accelerator, cfg: RunConfig, c: Components, batches, p: Progress, result: dict,
              run_dir: Path, bar, process_start: float) -> dict | None:
    """Optimizer steps up to `max_steps`, with logs, evals and checkpoints. A stop request (any rank's)
    ends them at the step boundary, with a checkpoint of that step: returns the request."""
    t = cfg.trainer
    for step in range(p.step + 1, t.max_steps + 1):
        began = time.perf_counter()
        loss_sum, count, lr = optimizer_step(accelerator, c, batches, t.grad_accum, t.max_grad_norm)
        loss, per_step, stop = agree_on_step(accelerator, loss_sum, count, t.grad_accum, step, p.last_finite, cfg.trainer)
        p.window.train_s += time.perf_counter() - began  # (agree_on_step waited for the step: its loss is read)
        p.step, p.last_finite = step, (step, loss)
        p.skipped += accelerator.optimizer_step_was_skipped
        p.window.loss_sum += loss
        p.window.steps += 1
        p.window.count += per_step
        p.window.lr = lr
        p.seen += per_step
        bar.update(1)
        if "time_to_first_step_s" not in result:
            reporting.note_first_step(result, process_start)
        saved = periodic(accelerator, cfg, c, p, result, run_dir, bar)
        result["steps"], result["skipped_steps"] = step, p.skipped
        c.callbacks.call("on_train_batch_end", step, result, loss)
        p.callback_stop = c.callbacks.stop_asked()
        if (stop or p.pruned or p.early_stop or p.callback_stop) and step < t.max_steps:
            if not saved:
                save_checkpoint(accelerator, cfg, run_dir, p, c)
            request = stopping.requested() or {"signal": "a stop request on another rank", "at": time.time()}
            if p.pruned and not stop:
                request = {"signal": pruning.PRUNER, "at": time.time()}
            elif p.early_stop and not stop:
                request = {"signal": EARLY_STOP, "at": time.time()}
            elif p.callback_stop and not stop:
                request = {"signal": CALLBACK_STOP, "reason": p.callback_stop, "at": time.time()}
            why = f" ({request['reason']})" if request.get("reason") else ""
            log.info("step %d | stopped by %s%s: checkpoint saved", step, request["signal"], why)
            return {**request, "step": step}
    return None


def periodic(accelerator: Accelerator, cfg: RunConfig, c: Components, p: Progress, result: dict, run_dir: Path,
             bar) -> bool:
    """This step's log line, eval and checkpoint, where due; True if a checkpoint was saved."""
    t, step = cfg.trainer, p.step
    last = step == t.max_steps
    if step % t.log_every == 0 or last:
        c.speed.add(p.window.count, p.window.train_s)
        result["train_loss"] = reporting.log_train(accelerator, p.window, step, t.max_steps, p.seen, p.skipped,
                                                   c.task.throughput_unit, c.speed)
        bar.set_postfix(loss=f"{result['train_loss']:.3f}", refresh=False)
        p.window = reporting.Window()
    if step % t.eval_every == 0 or last:
        evaluation.run_eval(accelerator, cfg, c, step, result, run_dir)
        judge(accelerator, cfg.trainer, c, p, result, run_dir, last)
        p.pruned = c.pruning is not None and c.pruning.decide(accelerator, step, result) and not last
        c.callbacks.call("on_validation_end", step, result, val_values(result))
    if step % t.save_every == 0 or last:
        save_checkpoint(accelerator, cfg, run_dir, p, c)
        return True
    return False


def judge(accelerator: Accelerator, trainer: TrainerConfig, c: Components, p: Progress, result: dict, run_dir: Path,
          last: bool = False) -> None:
    """After an eval: `trainer.monitor`'s verdict (its best is `best_<monitor>`); `export=best` exports the model
    where it improved, and `model_eval` records what that model scored."""
    improved, p.early_stop = p.monitor.judge(accelerator, p.step, result, trainer)
    p.early_stop = p.early_stop and not last
    result["monitor"] = p.monitor.state()
    if p.monitor.best is not None:
        result[f"best_{p.monitor.name}"] = p.monitor.best
    p.best = {key: value for key, value in result.items() if key.startswith("best_val_")}
    if improved and trainer.export is Export.best:
        save_model(accelerator, c, run_dir, p.step, result)


def val_values(result: dict) -> dict:
    """The last eval's values (`val_loss`, `val_<metric>`) as `result` holds them."""
    return {key: value for key, value in result.items() if key.startswith("val_")}


def scores(result: dict, step: int) -> dict:
    """The eval values at `step` (the eval just recorded in `result`), as `model_eval` holds them."""
    return {"step": step, **val_values(result)}


def save_checkpoint(accelerator: Accelerator, cfg: RunConfig, run_dir: Path, p: Progress, c: Components) -> None:
    window = {"loss_sum": p.window.loss_sum, "steps": p.window.steps}  # throughput restarts with the process
    state = {"seen": p.seen, "skipped_steps": p.skipped, "log_window": window, "best": p.best,
             "monitor": p.monitor.state(),
             **checkpoint.identity(cfg),
             "config": schema.to_container(cfg)}  # what it was trained with: a resume with other settings says so
    path = checkpoint.save(accelerator, run_dir, p.step, state, cfg.trainer.keep_checkpoints, cfg.model.lora.enabled)
    log.info("step %d | checkpoint saved: %s", p.step, path)
    c.callbacks.call("on_save_checkpoint", p.step, None, path)


def _recording_first_batch(batches, accelerator: Accelerator, result: dict):
    """Record which data each rank got first (the sum of its ids): the shards must differ."""
    batch = next(batches)
    ids = sum(value.sum() for value in (batch.values() if isinstance(batch, dict) else batch) if torch.is_tensor(value))
    result["first_batch_sums"] = accelerator.gather(ids.reshape(1)).tolist()
    yield batch
    yield from batches


def save_model(accelerator: Accelerator, c: Components, run_dir: Path, step: int, result: dict) -> None:
    """The task's export (model/, with LoRA adapter/ too), each directory replacing the run dir's (files.replace_dir);
    `model_step` and `model_eval` (what that model scored at its eval) in `result`."""
    result["model_step"], result["model_eval"] = step, scores(result, step)
    if c.test_loader is not None:  # the test split, on the model model/ keeps (a collective)
        result["model_test"] = evaluation.run_test(accelerator, c, step, run_dir)
    state_dict = accelerator.get_state_dict(c.model)  # a collective where the model is sharded
    if not accelerator.is_main_process:
        return
    log.info("step %d | exporting model/", step)
    tmp = run_dir / f".tmp-{rundir.MODEL}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    c.task.export(accelerator.unwrap_model(c.model), state_dict, tmp)
    for made in sorted(tmp.iterdir()):
        replace_dir(made, run_dir / made.name)
    tmp.rmdir()
