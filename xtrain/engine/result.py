"""What the loop knows of its run as it trains, typed: the evals and the best of each, the model `model/` keeps, its
speed and how the attempt ended. result.json is written from it (`Result.as_dict`, the file's keys); the callbacks,
the pruner and the monitor read that mapping."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from xtrain.core.rundir import Status
from xtrain.tasks import metrics


@dataclass
class Evals:
    """This attempt's evals: each value's latest (`val_<name>`) and best so far (`best_val_<name>`, the checkpoint's
    to begin with), and their cost."""

    latest: dict[str, float] = field(default_factory=dict)
    best: dict[str, float] = field(default_factory=dict)
    initial_val_loss: float | None = None  # step 0's (a fresh start's)
    step: int | None = None  # the step of the latest values (eval_step)
    time_s: float | None = None  # this attempt's time in evals (eval_time_s)
    files: dict[str, list[str]] | None = None  # every eval file in the run dir, by metric (eval_files)

    def record(self, scalars: dict[str, float], directions: dict[str, str], monitored: str) -> None:
        """One eval's values; each one's best where its direction is known (the monitored value's is the monitor's,
        judged after this)."""
        for name, value in scalars.items():
            key = f"val_{name}"
            self.latest[key] = value
            if key != monitored and metrics.better(directions.get(key), value, self.best.get(f"best_{key}")):
                self.best[f"best_{key}"] = value

    def add_time(self, seconds: float) -> None:
        self.time_s = round((self.time_s or 0.0) + seconds, 3)


@dataclass
class KeptModel:
    """The model `model/` holds: its step, what it scored at that eval, its test split's values."""

    step: int | None = None
    eval: dict | None = None
    test: dict | None = None


@dataclass
class Result:
    """result.json as the loop knows it: `started` (the run's facts as the loop starts, the header line's) and
    `recorded` (what the attempts before this one left: its restarts, the steps they lost; a checkpoint of another
    run's: what changed from it; an attempt that only exports: the training attempt's record) are fixed as it starts;
    the rest is the attempt's own."""

    started: dict
    steps: int
    recorded: dict = field(default_factory=dict)
    status: Status = Status.running
    evals: Evals = field(default_factory=Evals)
    kept: KeptModel = field(default_factory=KeptModel)
    monitor: dict | None = None  # trainer.monitor's state
    skipped_steps: int | None = None
    epoch: float | None = None
    train_loss: float | None = None  # the last log line's
    first_batch_sums: list[int] | None = None  # which data each rank got first: the shards must differ
    first_step: dict = field(default_factory=dict)  # time_to_first_step_s, first_step_at
    checkpoint_step: int | None = None  # what a kill from here on resumes from
    checkpoint_blocked_s: float | None = None  # this attempt's time training waited on saves
    checkpoint_saves: int | None = None
    goodput: dict = field(default_factory=dict)  # goodput, its span and breakdown (goodput.Goodput.figures)
    tested: dict[str, float] = field(default_factory=dict)  # test_<name>: the kept model's, at the end
    speed: dict = field(default_factory=dict)  # the steady rate, the whole run's, MFU (Speed.figures)
    peaks: dict = field(default_factory=dict)  # memory peaks at the end
    wall_time_s: float | None = None
    train_time_s: float | None = None
    error: str | None = None
    stop: dict | None = None  # a stop at a step boundary to resume later (a signal, the pruner)
    early_stop: dict | None = None
    callback_stop: dict | None = None

    def first_step_done(self, process_start: float) -> None:
        """The time to this attempt's first step; a restart's time down, from its stop to this step."""
        now = time.time()
        self.first_step = {"time_to_first_step_s": round(now - process_start, 3), "first_step_at": now}
        restart = (self.recorded.get("restarts") or [{}])[-1]
        if restart.get("stopped_at") and "down_s" not in restart:
            restart["down_s"] = round(now - restart["stopped_at"], 3)

    def as_dict(self) -> dict:
        """result.json's keys (a setting not known yet is not there)."""
        e, k = self.evals, self.kept
        own = {
            "status": self.status, "steps": self.steps, **self.started, "initial_val_loss": e.initial_val_loss,
            **e.best, "monitor": self.monitor, "model_step": k.step, "model_eval": k.eval, "model_test": k.test,
            **e.latest, "eval_step": e.step, "eval_files": e.files, "eval_time_s": e.time_s, **self.first_step,
            "skipped_steps": self.skipped_steps, "epoch": self.epoch, "train_loss": self.train_loss,
            "first_batch_sums": self.first_batch_sums, "checkpoint_step": self.checkpoint_step,
            "checkpoint_blocked_s": self.checkpoint_blocked_s, "checkpoint_saves": self.checkpoint_saves, **self.tested,
            **self.peaks, **self.speed, **self.goodput, "wall_time_s": self.wall_time_s, "train_time_s": self.train_time_s,
            "callback_stop": self.callback_stop, "early_stop": self.early_stop, "stop": self.stop, "error": self.error,
        }
        optional = {"initial_val_loss", "monitor", "model_step", "model_eval", "model_test", "eval_step", "eval_files",
                    "eval_time_s", "skipped_steps", "epoch", "train_loss", "first_batch_sums", "checkpoint_step", "checkpoint_blocked_s", "checkpoint_saves",
                    "wall_time_s", "train_time_s", "callback_stop", "early_stop", "stop", "error"}
        return {**self.recorded, **{key: value for key, value in own.items()
                                    if not (key in optional and value is None)}}
