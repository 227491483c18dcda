"""The training loop: one Accelerate loop over a run dir's resolved config.

`train(run_dir)` reads `run.yaml` (never composes config) into a `Run`: it builds the Accelerator
(accelerator.py), the task's model and data, the optimizer and schedule (components.py) and resumes if asked;
`Run.train()` trains for `trainer.max_steps` optimizer steps with periodic logging, evaluation and checkpoints,
and has the task export the final model. Every rank runs this same function. What a batch means (its loss, its
tokens, the eval) is the task's: the loop knows nothing of causal LMs.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path

from accelerate.utils import set_seed
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from xtrain.config import schema
from xtrain.config.schema import Export, Precision, RunConfig
from xtrain.core import machine, memory, rundir, stopping
from xtrain.core.errors import one_line
from xtrain.core.rundir import Status
from xtrain.parallel import compiling, dims, strategies
from xtrain.engine import (cadence, checkpoint, evaluation, exporting, goodput, progress, pruning, reporting, reshard,
                           resume, sampler, saving, tracking)
from xtrain.engine.progress import Progress, resume_setting
from xtrain.engine.accelerator import build_accelerator, check_setup, library_notes_quieted
from xtrain.engine.callbacks import CALLBACK_STOP, Callbacks
from xtrain.engine.components import build_components
from xtrain.engine.monitor import EARLY_STOP, Monitor
from xtrain.engine.optim import set_hyperparameters
from xtrain.engine.result import Result
from xtrain.engine.speed import measure_speed
from xtrain.engine.update import agree_on_step, optimizer_step, read_losses
from xtrain.tasks.facts import model_facts
from xtrain.tasks.registry import task_for

log = logging.getLogger("xtrain")

# A multi-process run's objects that hold its process group (the DDP reducer, DeepSpeed's engine), kept until its
# worker process ends with os._exit, never torn down: a gloo group destroyed from the main thread while one of the
# group's own threads still disposes of the last collective's work deadlocks (that thread waits for the GIL, the main
# thread holds it and waits for the group's lock). Seen under load: a rank that had saved its stop never exited.
_HELD_UNTIL_EXIT: list = []


def train(run_dir: str | Path, cfg: RunConfig | None = None) -> dict:
    """Trains the run dir as this rank; `cfg` is its run.yaml where the caller has read it already."""
    with library_notes_quieted():
        run = Run(Path(run_dir), cfg)
        with compiling.tuning(run.cfg.trainer):  # (compilation happens at the first forward)
            return run.train()


class Run:
    """One run on this rank: its config (run.yaml), Accelerator, run dir, components, counters (`progress`),
    what it knows as it trains (`record`, which result.json is written from) and clock. Building it builds everything and restores the checkpoint, if
    any; `train()` is the loop."""

    def __init__(self, run_dir: Path, cfg: RunConfig | None = None):
        self.run_dir = run_dir
        self.cfg = cfg = cfg or schema.load(str(run_dir / rundir.RUN_CONFIG))
        # from the driver's start when it launched this worker, else from this process's start
        self.process_start = machine.launch_time()
        machine.name_deepspeed_accelerator()
        memory.reset_peaks()
        n_params_meta, facts = model_facts(cfg, run_dir=run_dir)  # (the driver's, from prepared.json)
        self.accelerator = accelerator = build_accelerator(cfg, run_dir, facts)
        check_setup(cfg, accelerator.distributed_type, accelerator.num_processes)
        # preflight (hardware.check) refuses what Accelerate would silently run in fp32
        assert cfg.precision.name is Precision.fp32 or accelerator.native_amp or strategies.of(cfg).owns_precision, "no autocast"
        set_seed(cfg.trainer.seed)
        task = task_for(cfg)
        resume_from, self.set_aside = resume_setting(cfg.resume, run_dir), []
        if accelerator.is_main_process and resume_from == "auto":
            self.set_aside = checkpoint.set_aside_failing(run_dir)
        accelerator.wait_for_everyone()
        self.resumed_from = checkpoint.resolve(resume_from, run_dir, checkpoint.identity(cfg, task), cfg,
                                               checked=not accelerator.is_main_process)
        if accelerator.is_main_process:
            checkpoint.remove_partial(run_dir)
        self.c = c = build_components(cfg, accelerator, task)
        self.pruning = pruning.Pruning(run_dir, accelerator.is_main_process, dims.effective_batch(cfg))
        model_ready = memory.peaks(accelerator)["peak_rss_bytes"]  # built, placed: before any eval or step
        last_logged, changed = self.restore()
        self.start_step = start = self.progress.step
        self.saver = saving.Saver(accelerator, run_dir, cfg.trainer.keep_checkpoints, cfg.model.lora.enabled,
                                  asynchronous=cfg.trainer.async_save is True)
        self.previous = rundir.read_result(run_dir) if accelerator.is_main_process and self.resumed_here() else {}
        self.cadence = cadence.Cadence(cfg, run_dir, accelerator, start, self.previous)
        self.goodput = goodput.Goodput.of({}, self.process_start)
        self.finishing = start == cfg.trainer.max_steps  # (trained already: only its export is left to do)
        if self.finishing:
            log.info("resume: %s has trained all %d steps, but the run did not end: finishing its export",
                     self.resumed_from, start)
        self.speed = measure_speed(cfg, accelerator, c, c.n_params)  # (the steady rate's windows, MFU's FLOPs, peak)
        self.callbacks = Callbacks(cfg, accelerator, c.model, run_dir)
        trackers = tracking.init_kwargs(cfg.tracker, run_dir, accelerator.is_main_process, start, last_logged)
        accelerator.init_trackers(cfg.tracker.project, config=tracking.hyperparameters(cfg), init_kwargs=trackers)
        started = reporting.first_result(cfg, accelerator, c, self.resumed_from, start, n_params_meta, facts)
        self.record = Result(started={**started, "peak_rss_model_ready_bytes": model_ready}, steps=start)
        self.record_start(last_logged, changed)  # (from here on, whatever ends the run is recorded: `train`)

    def train(self) -> dict:
        """A first eval (on a fresh start), then optimizer steps up to `trainer.max_steps`, each followed by its log
        line, eval and checkpoint where due; a stop request (a signal, the pruner, early stopping, a callback: any
        rank's) ends them at that step boundary with a checkpoint. Then the export and the final result.json."""
        t, p, c = self.cfg.trainer, self.progress, self.c
        batches = progress.recording_first_batch(
            sampler.micro_batches(self.accelerator, c.train_loader, p.step * t.grad_accum), self.accelerator, self.record
        )
        self.train_start, self.seen_at_start, stop = time.time(), p.seen, None
        self.goodput.startup = self.train_start - self.process_start
        self.bar = bar = self.progress_bar()
        try:
            with logging_redirect_tqdm():
                self.callbacks.call("on_train_start", p.step, self.record.as_dict())
                if p.step == 0:
                    self.first_eval()
                for step in range(p.step + 1, t.max_steps + 1):
                    signal = self.step(batches)
                    bar.update(1)
                    saved = self.log_eval_save()
                    self.callbacks.call("on_train_batch_end", step, self.record.as_dict(), p.last_finite[1])
                    p.callback_stop = self.callbacks.stop_asked()
                    if (signal or p.pruned or p.early_stop or p.callback_stop) and step < t.max_steps:
                        stop = self.stop_here(signal, saved)
                        break
                self.saves_done(self.saver.wait())  # (the last save: in flight still, where asynchronous)
                self.conclude(stop)
        except BaseException as err:
            self.record_failure(err)
            raise
        finally:
            bar.close()
        return self.finish(stop)

    def identity(self) -> dict:
        return checkpoint.identity(self.cfg, self.c.task)

    def restore(self) -> tuple[int, dict]:
        """Load the checkpoint, if any, and cut metrics.jsonl back to it: sets `progress`; returns, on the main
        process, the last step logged before the cut, and the settings that changed since the checkpoint (preflight
        allowed them; the optimizer's and the schedule's take effect here)."""
        cfg, c, accelerator, path = self.cfg, self.c, self.accelerator, self.resumed_from
        direction = c.task.directions().get(cfg.trainer.monitor)
        self.progress = Progress(step=0, seen=0, skipped=0, monitor=Monitor.of(cfg.trainer, direction))
        last_logged, changed, self.moved = 0, {}, {}
        if path is not None:
            checkpoint.load(accelerator, path, cfg)
            state = checkpoint.read_state(path)
            accelerator.step = state["step"] * cfg.trainer.grad_accum  # (micro-batches: another world has another)
            window = state.get("log_window", {})  # a stop between two log lines: the next one covers both parts
            self.progress = Progress(
                step=state["step"], seen=state.get("seen", state.get("tokens_seen", 0)),
                skipped=state.get("skipped_steps", 0),
                window=reporting.Window(loss_sum=window.get("loss_sum", 0.0), steps=window.get("steps", 0)),
                best=state.get("best", {}), monitor=Monitor.of(cfg.trainer, direction, state.get("monitor")),
            )
            self.moved = reshard.moved(path, state, cfg)
            if self.moved:
                log.info("resumed on another world: %s", reshard.moved_text(self.moved))
            found = resume.changes(state["config"], schema.to_container(cfg)) if "config" in state else []
            if any(change.trains for change in found):  # (preflight refused what cannot apply)
                set_hyperparameters(c.model, c.optimizer, c.scheduler, cfg)
                log.info("resumed with new settings: %s", ", ".join(str(change) for change in found if change.trains))
            changed = resume.record(found)
        if accelerator.is_main_process:
            if self.progress.step:
                last_logged = rundir.keep_metrics_until(self.run_dir, self.progress.step)
            else:
                (self.run_dir / rundir.METRICS).unlink(missing_ok=True)
            rundir.keep_evals_until(self.run_dir, self.progress.step)
        accelerator.wait_for_everyone()
        return last_logged, changed

    def record_start(self, last_logged: int, changed: dict) -> None:
        """This attempt's record in result.json, from the start: the best values so far, the model model/ holds, a
        restart entry."""
        record, p, run_dir = self.record, self.progress, self.run_dir
        if self.finishing and self.accelerator.is_main_process:  # what the attempt that trained recorded stays
            trained = rundir.read_result(run_dir)
            record.recorded = {key: value for key, value in trained.items() if key not in ("status", "error", "stop")}
        record.evals.best, record.monitor = dict(p.best), p.monitor.state()
        if self.cfg.trainer.export is Export.best and p.monitor.best_step is not None:  # model/ holds that eval's model
            kept = rundir.read_result(run_dir) if self.accelerator.is_main_process else {}
            record.kept.step = p.monitor.best_step
            if kept.get("model_step") == p.monitor.best_step:
                record.kept.eval, record.kept.test = kept.get("model_eval"), kept.get("model_test")
        if self.accelerator.is_main_process:
            if self.resumed_here():
                record.recorded.update(rundir.continued(run_dir, p.step, last_logged, changed, self.moved,
                                                        self.set_aside))
                redo = record.recorded["restarts"][-1]["steps_lost"]
                self.goodput = goodput.Goodput.of(self.previous, self.process_start, redo)
            elif changed:  # resumed from another run's checkpoint
                record.recorded["changed_from_checkpoint"] = changed
                if self.moved:
                    record.recorded["moved_from_checkpoint"] = self.moved
            self.write_result(fresh=True)

    def resumed_here(self) -> bool:
        """This attempt continues its own run dir's checkpoint (a restart, not another run's checkpoint)."""
        return self.resumed_from is not None and self.resumed_from.parent == rundir.checkpoints_dir(self.run_dir)

    def write_result(self, fresh: bool = False, measured: bool = True) -> dict:
        """result.json as the run stands now (the main process), its goodput measured now (`measured`) or as recorded."""
        if measured:
            self.record.goodput = self.goodput.figures(time.time(), self.saver.blocked_s)
        result = self.record.as_dict()
        if self.accelerator.is_main_process:
            rundir.update_result(self.run_dir, result, fresh=fresh)
        return result

    def progress_bar(self):
        t = self.cfg.trainer
        return tqdm(
            total=t.max_steps, initial=self.progress.step, desc="train", mininterval=1.0, dynamic_ncols=True,
            disable=not (self.accelerator.is_main_process and sys.stderr.isatty()),  # log files get the log lines only
        )

    def first_eval(self) -> None:
        """Step 0's eval (it also checks, on every task, that each metric can take its inputs)."""
        evals = self.record.evals
        with self.timed("evals"):
            evals.initial_val_loss = evaluation.run_eval(self.accelerator, self.cfg, self.c, 0, evals, self.run_dir)
        self.judge()
        self.callbacks.call("on_validation_end", 0, self.record.as_dict(), dict(evals.latest))

    def step(self, batches) -> bool:
        """One optimizer step and its counters; whether any rank was asked to stop."""
        t, p, accelerator = self.cfg.trainer, self.progress, self.accelerator
        began, compiled = time.perf_counter(), goodput.compile_seconds()
        loss_sum, count, lr = optimizer_step(accelerator, self.c, batches, t.grad_accum, t.max_grad_norm)
        p.step += 1
        loss_sum, per_step, signal, written, published = agree_on_step(accelerator, loss_sum, count,
                                                                       self.saver.flags())
        p.unread.append((p.step, loss_sum))
        if self.loss_read_due(signal):
            for step, loss in read_losses(p.unread, p.last_finite, t):
                p.window.loss_sum += loss
                p.last_finite = (step, loss)
            p.unread.clear()
        took = time.perf_counter() - began
        p.window.train_s += took  # (a read waited for the steps: their time is in)
        self.goodput.timed("steps", took, goodput.compile_seconds() - compiled)
        p.skipped += accelerator.optimizer_step_was_skipped
        p.window.steps += 1
        p.window.count += per_step
        p.window.lr = lr
        p.seen += per_step
        record = self.record
        if not record.first_step:
            record.first_step_done(self.process_start)
        record.steps, record.skipped_steps = p.step, p.skipped
        record.epoch = sampler.epochs(p.step, t.grad_accum, self.c.train_loader)
        self.saves_done(self.saver.poll(written, published))
        return signal

    def loss_read_due(self, signal: bool) -> bool:
        """Whether this step reads its loss and those of the steps before it (one process keeps them on the
        device): where a log line, eval or checkpoint needs them (a diverged loss is caught at the first of these),
        at a stop, at this attempt's first step (its time to the first step is the step done) and its last, at every
        step where callbacks take each step's loss or several ranks read it anyway."""
        t, step = self.cfg.trainer, self.progress.step
        return (signal or self.callbacks.any or self.accelerator.num_processes > 1
                or step in (self.start_step + 1, t.max_steps)
                or any(step % every == 0 for every in (t.log_every, t.eval_every)) or self.cadence.due(step))

    def log_eval_save(self) -> bool:
        """This step's log line, eval and checkpoint, where due; True if a checkpoint was saved."""
        t, p, c, accelerator = self.cfg.trainer, self.progress, self.c, self.accelerator
        step, last = p.step, p.step == t.max_steps
        if step % t.log_every == 0 or last:
            self.speed.add(p.window.count, p.window.train_s)
            self.record.train_loss = reporting.log_train(accelerator, p.window, step, t.max_steps, p.seen, p.skipped,
                                                         c.task.throughput_unit, self.speed, self.record.epoch)
            self.bar.set_postfix(loss=f"{self.record.train_loss:.3f}", refresh=False)
            p.window = reporting.Window()
        if step % t.eval_every == 0 or last:
            with self.timed("evals"):
                evaluation.run_eval(accelerator, self.cfg, c, step, self.record.evals, self.run_dir)
            self.judge(last)
            p.pruned = self.pruning.decide(accelerator, step, self.record.as_dict()) and not last
            self.callbacks.call("on_validation_end", step, self.record.as_dict(), dict(self.record.evals.latest))
        if self.cadence.due(step) or last:
            self.save_checkpoint()
            self.cadence.after_save(step, self.saver.blocked_s / self.saver.saves, self.goodput.figures(
                time.time(), self.saver.blocked_s)["step_s"] or 0.0, self.previous)
            return True
        return False

    @contextlib.contextmanager
    def timed(self, part: str):
        """The time of what runs inside, for goodput's `part` (its compile apart)."""
        began, compiled = time.perf_counter(), goodput.compile_seconds()
        yield
        self.goodput.timed(part, time.perf_counter() - began, goodput.compile_seconds() - compiled)

    def judge(self, last: bool = False) -> None:
        """After an eval: `trainer.monitor`'s verdict (its best is `best_<monitor>`); `export=best` exports the model
        where it improved, and `model_eval` records what that model scored."""
        p, record, trainer = self.progress, self.record, self.cfg.trainer
        improved, p.early_stop = p.monitor.judge(self.accelerator, p.step, record.evals.latest, trainer)
        p.early_stop = p.early_stop and not last
        record.monitor = p.monitor.state()
        if p.monitor.best is not None:
            record.evals.best[f"best_{p.monitor.name}"] = p.monitor.best
        p.best = dict(record.evals.best)
        if improved and trainer.export is Export.best:
            self.save_model()

    def stop_here(self, signal: bool, saved: bool) -> dict:
        """The stop request that ends the steps at this step boundary, after its checkpoint."""
        p = self.progress
        if not saved:
            self.save_checkpoint()
        self.saves_done(self.saver.wait())
        request = stopping.requested() or {"signal": "a stop request on another rank", "at": time.time()}
        if p.pruned and not signal:
            request = {"signal": pruning.PRUNER, "at": time.time()}
        elif p.early_stop and not signal:
            request = {"signal": EARLY_STOP, "at": time.time()}
        elif p.callback_stop and not signal:
            request = {"signal": CALLBACK_STOP, "reason": p.callback_stop, "at": time.time()}
        why = f" ({request['reason']})" if request.get("reason") else ""
        log.info("step %d | stopped by %s%s: checkpoint saved", p.step, request["signal"], why)
        if request["signal"] not in (pruning.PRUNER, EARLY_STOP, CALLBACK_STOP):  # interrupted, to resume later
            self.callbacks.exception(p.step, self.record.as_dict(), KeyboardInterrupt(
                f"stopped by {request['signal']} at step {p.step}; its checkpoint is saved"))
        return {**request, "step": p.step}

    def conclude(self, stop: dict | None) -> None:
        """A run that ended (not stopped to resume later): its export, test values and `on_train_end`."""
        if stop is not None and stop["signal"] not in (EARLY_STOP, CALLBACK_STOP):
            return
        if self.cfg.trainer.export is Export.last:
            self.save_model()
        if self.record.kept.test is not None:  # the test split's values, of the model kept
            self.record.tested = evaluation.report_test(self.accelerator, self.record.kept.test, self.progress.step)
        self.callbacks.call("on_train_end", self.progress.step, self.record.as_dict())

    def record_failure(self, err: BaseException) -> None:
        """Whatever ended the run after it started, in result.json (`failed`, or `interrupted` by a signal) with its
        one-line error; the callbacks' `on_exception`."""
        self.saver.abandon()
        stopped = isinstance(err, KeyboardInterrupt) or self.accelerator.num_processes > 1 and stopping.driver_gone()
        self.record.status = Status.interrupted if stopped else Status.failed
        self.record.error = one_line(err)
        self.callbacks.exception(self.progress.step, self.record.as_dict(), err)
        self.write_result()

    def finish(self, stop: dict | None) -> dict:
        """The final result.json: completed, or stopped on request at a step boundary (resumable)."""
        accelerator, record, trainer, c = self.accelerator, self.record, self.cfg.trainer, self.c
        wall, seen = time.time() - self.train_start, self.progress.seen - self.seen_at_start
        record.peaks = memory.peaks(accelerator)
        ended = stop is None or stop["signal"] in (EARLY_STOP, CALLBACK_STOP)
        record.goodput = self.goodput.figures(time.time(), self.saver.blocked_s)  # (its end: the trackers' figures)
        if ended:  # (the trackers get the whole run's goodput once, as it ends)
            tracking.log_goodput(accelerator, record.goodput, self.progress.step)
        accelerator.end_training()  # destroys the process group: no collective after it
        if accelerator.num_processes > 1:
            _HELD_UNTIL_EXIT.append((accelerator, c))
        if not self.finishing:  # (an attempt that only exported has no speed of its own)
            record.speed = self.speed.figures(c.task.throughput_unit, seen, time.time() - self.process_start)
        pruned = stop is not None and stop["signal"] == pruning.PRUNER
        early = stop is not None and stop["signal"] in (EARLY_STOP, CALLBACK_STOP)
        record.status = Status.completed if stop is None or early else Status.pruned if pruned else Status.interrupted
        record.wall_time_s, record.train_time_s = round(time.time() - self.process_start, 3), round(wall, 3)
        if early and stop["signal"] == CALLBACK_STOP:
            record.callback_stop = {"step": stop["step"], "reason": stop["reason"]}
        elif early:
            record.early_stop = {"step": stop["step"], "patience": trainer.early_stop_patience,
                                 "best_step": record.monitor["best_step"]}
        elif pruned:
            record.stop, record.error = stop, f"pruned by the study's pruner at step {stop['step']}; its checkpoint is saved"
        elif stop is not None:
            record.stop, record.error = stop, f"stopped by {stop['signal']} at step {stop['step']}; its checkpoint is saved"
        result = self.write_result(measured=False)
        if accelerator.is_main_process and ended:
            speed = ("model/ exported from its checkpoint" if self.finishing
                     else reporting.speed_text(result, c.task.throughput_unit))
            log.info("done: %d steps | %s | %s | %s | %s", result["steps"], reporting.eval_text(result, final=True),
                     speed, goodput.text(result), self.run_dir)
        return result

    def save_checkpoint(self) -> None:
        p, cfg = self.progress, self.cfg
        window = {"loss_sum": p.window.loss_sum, "steps": p.window.steps}  # throughput restarts with the process
        state = {"seen": p.seen, "skipped_steps": p.skipped, "log_window": window, "best": p.best,
                 "monitor": p.monitor.state(), **self.identity(),
                 "config": schema.to_container(cfg)}  # what it was trained with: a resume with other settings says so
        self.saves_done(self.saver.save(p.step, state))

    def saves_done(self, done: list[saving.Done]) -> None:
        """Checkpoints now complete on disk: said, recorded (what a kill from here on resumes from), called back."""
        for save in done:
            how = (f"training waited {save.waited_s:.2f} s" if save.waited_s >= save.write_s - 1e-3 else
                   f"training waited {save.waited_s:.2f} s, written in {save.write_s:.2f} s behind it")
            log.info("step %d | checkpoint saved: %s (%s)", save.step, save.path, how)
            self.record.checkpoint_step = save.step
        if done:
            self.record.checkpoint_blocked_s = round(self.saver.blocked_s, 3)
            self.record.checkpoint_saves = self.saver.saves
            self.write_result()
        for save in done:
            self.callbacks.call("on_save_checkpoint", self.progress.step, None, save.path)

    def save_model(self) -> None:
        """The task's export (model/, with LoRA adapter/ too), each directory replacing the run dir's
        (files.replace_dir); the step, what it scored at its eval and its test split's values in `record.kept`."""
        accelerator, c, record, step = self.accelerator, self.c, self.record, self.progress.step
        record.kept.step, record.kept.eval = step, {"step": step, **record.evals.latest}
        if c.test_loader is not None:  # the test split, on the model model/ keeps (a collective)
            record.kept.test = evaluation.run_test(accelerator, c, step, self.run_dir)
            if accelerator.is_main_process:
                record.evals.files = evaluation.eval_files(self.run_dir)
        state_dict = c.parallelism.whole_state_dict(accelerator, c.model)  # a collective where the model is spread
        if not accelerator.is_main_process:
            return  # (ZeRO-3 consolidates on the main process only: here it is None)
        exporting.write_model(self.run_dir, c.task, c.parallelism.whole_model(accelerator, c.model), state_dict, step)
