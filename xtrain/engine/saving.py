"""The run's checkpoints as it trains: each written in step with training (synchronous) or behind it (asynchronous).

A synchronous save blocks every rank until the checkpoint is on disk (checkpoint.save). An asynchronous one blocks
only while the state is copied off the training tensors (staging.py); the files are written on a thread of this
rank's while training goes on, and the main process publishes the checkpoint (digests, state file, rename: the
promises of checkpoint.py) once every rank's files are in. Its promises are a save's:

- complete or absent: until it is published, the newest checkpoint is the one before (a kill leaves a `.tmp-`
  directory that the next start removes);
- at most one in flight: the next save waits for it, and so do a stop at a step boundary and the end of the run;
- `keep_checkpoints` prunes only published checkpoints.

The ranks learn that every rank's files are written, and that the main process has published them, through the one
all-reduce they make after each step anyway (update.agree_on_step): no collective runs off the training thread but
torch's own for a sharded state (over a gloo group of the saver's).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from xtrain.core import seams
from xtrain.core.rundir import checkpoint_name, checkpoints_dir
from xtrain.engine import checkpoint, staging

log = logging.getLogger("xtrain")


@dataclass
class Done:
    """A published save, as its rank reports it: its step and path, how long training waited for it (the copy,
    and whatever save in flight it waited for) and how long its files took to write."""

    step: int
    path: Path
    waited_s: float
    write_s: float


class InFlight:
    """One asynchronous save after its state was staged: this rank's writes on a thread, then (main process) the
    publication once every rank's are in."""

    def __init__(self, step: int, tmp: Path, staged: staging.Staged, publish: Callable[[], Path] | None,
                 waited_s: float):
        self.step, self.tmp, self.waited_s = step, tmp, waited_s
        self.began = time.perf_counter()
        self.written_at: float | None = None
        self.written_event = threading.Event()
        self.abandoned = False  # the run failed: its files are left unpublished (the next start removes them)
        self.error: BaseException | None = None
        self.all_written = threading.Event()  # every rank's files are in (the main process then publishes)
        self.path: Path | None = None
        self._publish = publish
        self.thread = threading.Thread(target=self._run, args=(staged,), name=f"xtrain-save-{step}", daemon=True)
        self.thread.start()

    def _run(self, staged: staging.Staged) -> None:
        try:
            seams.each("before_checkpoint_write", self.step)
            staged.write()
            self.written_at = time.perf_counter()
            self.written_event.set()
            if self._publish is not None:
                self.all_written.wait()
                if not self.abandoned:
                    self.path = self._publish()
        except BaseException as err:  # (surfaced on the training thread, at its next step boundary)
            self.error = err
            self.written_at = self.written_at or time.perf_counter()
            self.written_event.set()

    @property
    def written(self) -> bool:
        return self.written_at is not None

    @property
    def published(self) -> bool:
        """Its publication is done (or this rank has none to do)."""
        return not self.thread.is_alive() if self._publish is not None else self.written


class Saver:
    """This rank's saves: `save` at a step boundary, `poll` after each step with what the ranks agreed, `wait` where
    nothing may be in flight (a stop, the end)."""

    def __init__(self, accelerator, run_dir: Path, keep: int, only_trainable: bool, asynchronous: bool):
        self.accelerator, self.run_dir, self.keep, self.only_trainable = accelerator, run_dir, keep, only_trainable
        self.asynchronous = asynchronous
        self.sharded = accelerator.distributed_type.value == "FSDP"  # (its states go through torch's distributed checkpoint)
        self.buffers = staging.Buffers()
        self.in_flight: InFlight | None = None
        self.blocked_s, self.saves = 0.0, 0
        self._groups: list = []

    def save(self, step: int, state: dict) -> list[Done]:
        """Step `step`'s checkpoint (every rank): written now, or staged and written behind training. What it waited
        for that ended (the save in flight) and, when synchronous, this save itself."""
        done = self.wait()
        began = time.perf_counter()
        if not self.asynchronous:
            path = checkpoint.save(self.accelerator, self.run_dir, step, state, self.keep, self.only_trainable)
            spent = time.perf_counter() - began
            self._count(spent)
            return [*done, Done(step, path, spent, spent)]
        tmp = checkpoint.begin(self.accelerator, self.run_dir, step)
        try:
            with staging.deferred(self.buffers, self._process_group if self.sharded else None) as staged:
                checkpoint.write_state(self.accelerator, tmp, self.only_trainable)
        except Exception as err:
            raise checkpoint.failed(self.accelerator, err, self.run_dir, tmp, step) from err
        self.accelerator.wait_for_everyone()  # (every rank has staged: the state may change from here on)
        main = self.accelerator.is_main_process
        publish = (lambda: checkpoint.publish(self.run_dir, tmp, step, state, self.keep)) if main else None
        spent = time.perf_counter() - began
        self.in_flight = InFlight(step, tmp, staged, publish, spent)
        if self.accelerator.num_processes == 1:
            self.in_flight.all_written.set()
        self._count(spent)
        return done

    def flags(self) -> tuple[float, float]:
        """This rank's part of the step's all-reduce: (its files are written, its publication is done)."""
        f = self.in_flight
        return (1.0, 1.0) if f is None else (float(f.written), float(f.published))

    def poll(self, all_written: bool, all_published: bool) -> list[Done]:
        """After a step, with what every rank reported (`flags`, all-reduced): the save in flight's publication
        starts once every rank's files are in, and it is done, on every rank at the same step, once published."""
        f = self.in_flight
        if f is None:
            return []
        if f.error is not None:
            self._fail(f)
        if all_written:
            f.all_written.set()
        if all_published and f.published:
            return self._finished(f)
        return []

    def wait(self) -> list[Done]:
        """Every rank: the save in flight written and published (what training waits for counts as blocked)."""
        f = self.in_flight
        if f is None:
            return []
        began = time.perf_counter()
        f.written_event.wait()
        if f.error is not None:
            self._fail(f)
        self.accelerator.wait_for_everyone()  # (every rank's files are in)
        f.all_written.set()
        f.thread.join()
        if f.error is not None:
            self._fail(f)
        self.accelerator.wait_for_everyone()  # (published)
        waited = time.perf_counter() - began
        f.waited_s += waited
        self._count(waited, save=False)
        return self._finished(f)

    def abandon(self) -> None:
        """The run failed with a save in flight: one process still publishes it (no other rank to wait for: its files
        are the state of a step that trained); several leave it unpublished, since no collective is safe now."""
        f, self.in_flight = self.in_flight, None
        if f is None:
            return
        f.abandoned = self.accelerator.num_processes > 1
        f.all_written.set()
        if not f.abandoned:
            f.thread.join()

    def _finished(self, f: InFlight) -> list[Done]:
        self.in_flight = None
        path = checkpoints_dir(self.run_dir) / checkpoint_name(f.step)
        return [Done(f.step, path, f.waited_s, f.written_at - f.began)]

    def _fail(self, f: InFlight) -> None:
        self.in_flight = None
        raise checkpoint.failed(self.accelerator, f.error, self.run_dir, f.tmp, f.step) from f.error

    def _count(self, seconds: float, save: bool = True) -> None:
        self.blocked_s += seconds
        self.saves += save

    def _process_group(self, i: int):
        """The gloo group the i-th sharded state of a save writes over (made once, by every rank)."""
        import torch.distributed as dist

        while len(self._groups) <= i:
            self._groups.append(dist.new_group(backend="gloo"))
        return self._groups[i]
