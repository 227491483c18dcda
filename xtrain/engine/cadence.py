"""When a checkpoint is due: every `trainer.save_every` steps, or with `save_every=auto` at Young/Daly's interval
(goodput.interval) from what this run measured.

With `auto`, a run that knows nothing yet (a fresh start) saves once after its second log window, which measures
the time a step takes and what a save blocks, then chooses; a resume chooses at once from what the attempts before
it recorded (result.json). The ranks take the main process's choice; it is said in the log and recorded in run.yaml,
the number as `trainer.save_every` and a history line (`# save_every=auto: ...`) that tells a requeued job, which
reads run.yaml as it is, to choose again.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from xtrain.config import schema
from xtrain.config.schema import RunConfig
from xtrain.core import rundir
from xtrain.engine import goodput

log = logging.getLogger("xtrain")


def is_auto(cfg: RunConfig, run_dir: Path) -> bool:
    """`save_every=auto`: as composed, or chosen already by an earlier attempt (run.yaml's history says so)."""
    return cfg.trainer.save_every == "auto" or any(line.startswith(rundir.AUTO_SAVE)
                                                     for line in rundir.history(run_dir))


def mtbf_s(cfg: RunConfig, result: dict) -> float | None:
    """The failure rate save_every=auto plans for: `cluster.mtbf_hours`, else the run's own restarts."""
    if cfg.cluster.mtbf_hours is not None:
        return cfg.cluster.mtbf_hours * 3600.0
    return goodput.observed_mtbf_s(result)


class Cadence:
    """The steps a checkpoint is due at (besides a stop and the end)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, accelerator, start: int, previous: dict):
        """`previous`: result.json as the attempts before this one left it (the main process's; {} elsewhere)."""
        self.cfg, self.run_dir, self.accelerator = cfg, run_dir, accelerator
        self.auto = is_auto(cfg, run_dir)
        self.every = None if self.auto else cfg.trainer.save_every
        self.probe_at: int | None = None
        self.last = start  # the newest save's step (auto: the next is `every` steps after it)
        if self.every is None:
            measured = _measured(previous)
            self.every = self.choose(start, *(measured or (0.0, 0.0)), previous)
            if self.every is None:
                self.probe_at = min(cfg.trainer.max_steps, start + 2 * cfg.trainer.log_every)

    def due(self, step: int) -> bool:
        if self.every is None:
            return step == self.probe_at
        return step - self.last >= self.every if self.auto else step % self.every == 0

    def after_save(self, step: int, blocked_s: float, step_s: float, result: dict) -> None:
        """After a save (every rank); after the one at the probe step, the interval chosen from what it measured."""
        self.last = step
        if self.every is None and step == self.probe_at:
            self.probe_at = None
            fallback = self.cfg.trainer.save_every if isinstance(self.cfg.trainer.save_every, int) else None
            self.every = self.choose(step, blocked_s, step_s, result) or fallback or self.cfg.trainer.max_steps

    def choose(self, step: int, blocked_s: float, step_s: float, result: dict) -> int | None:
        """Every rank: the main process's choice from what a save blocks and a step takes (None where it knows
        neither, or no failure rate); said and recorded there."""
        mtbf = mtbf_s(self.cfg, result)
        chosen = goodput.interval(blocked_s, mtbf, step_s) if mtbf and step_s > 0 else None
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            chosen = broadcast_object_list([chosen])[0]
        if chosen and self.accelerator.is_main_process:
            self.record(chosen, step, f"a save blocks training {blocked_s:.3g} s, a step takes {step_s:.3g} s, "
                                      f"failures every {mtbf / 3600:.3g} h: Young/Daly")
        return chosen

    def record(self, every: int, step: int, why: str) -> None:
        """The choice in the log and in run.yaml (the main process)."""
        log.info("step %d | checkpoints every %d steps (save_every=auto: %s)", step, every, why)
        cfg = replace(self.cfg, trainer=replace(self.cfg.trainer, save_every=every))
        rundir.add_history(self.run_dir, f"{rundir.AUTO_SAVE}: {every} steps, chosen at step {step} ({why})",
                           schema.to_yaml(cfg))


def _measured(result: dict) -> tuple[float, float] | None:
    """(what a save blocked, the time a step took) as the last attempt recorded them, where it did."""
    saves, step_s = result.get("checkpoint_saves"), result.get("step_s")
    if not saves or not step_s:
        return None
    return result["checkpoint_blocked_s"] / saves, step_s
