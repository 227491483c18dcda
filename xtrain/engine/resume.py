"""What a resume may change: run.yaml always says what trains.

Each checkpoint records the config it was trained with (`xtrain_state.json`). Resumed with other settings:

- settings that change only when things happen or where they run (log, eval and save intervals, checkpoints
  kept, the tracker, timeouts, the SLURM request) are taken and recorded;
- settings that change what trains are refused in one line that lists each as old -> new; with
  `resume_changes=apply` the optimizer's and the schedule's (`APPLICABLE`) take effect from the resumed step on
  (the loop sets them on the restored optimizer), and the restart entry in result.json records them;
- the number of processes and the strategy are where it runs (reshard.py moves the checkpoint): the effective batch
  (batch_size x data-parallel processes x grad_accum) stays the checkpoint's, `grad_accum` set to keep it
  (`keep_effective_batch`), or the move is refused in one line where it cannot be kept;
- anything else (the batch, the data, the model) cannot change within one run: a new run_dir.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xtrain.config import fields, schema
from xtrain.config.schema import RunConfig
from xtrain.core.errors import ConfigError
from xtrain.parallel import dims

# Settings (a dotted name, or a prefix ending in ".") a resume may change freely: when things happen, where they
# run, how they are watched, as each field says (config/fields.py). (The world, with the effective batch kept:
# `keep_effective_batch`.)
FREE = tuple(fields.free_settings(RunConfig))
# What `resume_changes=apply` makes take effect: the optimizer's and the schedule's settings
APPLICABLE = ("trainer.lr", "trainer.max_steps", "trainer.max_epochs", "trainer.warmup_steps", "trainer.min_lr_ratio", "trainer.weight_decay",
              "trainer.max_grad_norm")


# Settings a checkpoint written before they existed does not record, with the value it trained as
ADDED = {"strategy.dp_replicate": 1, "strategy.tp": 1, "strategy.cp": 1, "trainer.compile_tuning": False,
         "trainer.max_epochs": None, "trainer.limit_train_batches": 0, "trainer.limit_val_batches": 0,
         "trainer.overfit_batches": 0}

SCHEDULE = ("trainer.max_steps", "trainer.max_epochs", "trainer.warmup_steps", "trainer.min_lr_ratio")  # the default schedule's shape


def applicable(key: str, now: dict) -> bool:
    """`resume_changes=apply` can make this change take effect on the restored optimizer and schedule: xtrain's own
    settings of them, a user optimizer's arguments (not its class); a user scheduler's state is its own, so neither it
    nor the default schedule's shape can change under it."""
    users_schedule = bool(now.get("trainer", {}).get("scheduler", {}).get("_target_"))
    if key.startswith("trainer.optimizer."):
        return key != "trainer.optimizer._target_"
    return key in APPLICABLE and not (users_schedule and key in SCHEDULE)


@dataclass(frozen=True)
class Change:
    key: str
    old: object
    new: object
    kept_batch: bool = False  # grad_accum, changed with the world so that the effective batch is the same

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"

    @property
    def trains(self) -> bool:
        """It changes what trains (not only when or where)."""
        if self.kept_batch:
            return False
        return not any(self.key == c or (c.endswith(".") and self.key.startswith(c)) for c in FREE)


def keep_effective_batch(cfg: RunConfig, recorded: dict | None, what: str) -> RunConfig:
    """`cfg` resumed from a checkpoint trained with `recorded`: with the grad_accum that keeps the checkpoint's
    effective batch on this run's data-parallel processes (a ConfigError where no whole grad_accum does). The
    command's own grad_accum is where it trained first; the effective batch cannot change within a run."""
    if recorded is None:
        return cfg
    saved, t = schema.from_container(recorded), cfg.trainer
    before, now = dims.of(saved).data_parallel, dims.of(cfg).data_parallel
    if t.batch_size != saved.trainer.batch_size or dims.effective_batch(cfg) == dims.effective_batch(saved):
        return cfg  # (another batch size: a change of what trains, refused by `changes`)
    effective = dims.effective_batch(saved)
    if effective % (t.batch_size * now):
        raise ConfigError(
            f"{what} with an effective batch of {effective} (trainer.batch_size {t.batch_size} x {before} "
            f"data-parallel processes x trainer.grad_accum {saved.trainer.grad_accum}); {now} processes cannot keep it "
            f"(no whole grad_accum): use a number of data-parallel processes that divides {effective // t.batch_size}"
        )
    return replace(cfg, trainer=replace(t, grad_accum=effective // (t.batch_size * now)))


def changes(recorded: dict, now: dict) -> list[Change]:
    """Every setting whose value differs between two configs (as plain containers); a grad_accum that keeps the
    effective batch on another world is where it runs, not what trains."""
    found = _differences(_as_epochs(recorded, now), now)
    if any(c.key == "trainer.grad_accum" for c in found):
        same = dims.effective_batch(schema.from_container(recorded)) == dims.effective_batch(schema.from_container(now))
        found = [replace(c, kept_batch=same) if c.key == "trainer.grad_accum" else c for c in found]
    return found


def _as_epochs(recorded: dict, now: dict) -> dict:
    """A checkpoint's config where `trainer.max_epochs` decides the steps: its steps (and the warmup they gave) as
    `now` leaves them, unset (the same epochs of the same data come to the same steps)."""
    old, new = recorded.get("trainer", {}), now.get("trainer", {})
    if new.get("max_epochs") is None or new.get("max_steps") is not None or old.get("max_epochs") is None:
        return recorded
    warmup = {"warmup_steps": None} if new.get("warmup_steps") is None else {}
    return {**recorded, "trainer": {**old, "max_steps": None, **warmup}}


def _differences(recorded: dict, now: dict, prefix: str = "") -> list[Change]:
    found = []
    for key in sorted(set(recorded) | set(now)):
        old, new = recorded.get(key), now.get(key)
        if key not in recorded and ADDED.get(f"{prefix}{key}", ...) == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict) and key != "sbatch_args":
            found += _differences(old, new, f"{prefix}{key}.")
        elif old != new:
            found.append(Change(f"{prefix}{key}", old, new))
    return found


def refusal(found: list[Change], mode: str, what: str, now: dict) -> str | None:
    """Why a resume with these changes cannot go on (`what`: where it resumes), or None."""
    trained = [c for c in found if c.trains]
    if not trained:
        return None
    listed = ", ".join(map(str, trained))
    fixed = [c for c in trained if not applicable(c.key, now)]
    if fixed:
        return (f"{what} was trained with other settings: {listed}; {', '.join(c.key for c in fixed)} cannot change "
                "within a run: resume with the settings it was started with, or start a new run_dir")
    if mode == "apply":
        return None
    return (f"{what} was trained with other settings: {listed}; resume with the settings it was started with, or "
            "add resume_changes=apply to train on with the new ones from the resumed step")


def record(found: list[Change]) -> dict:
    """The changes as result.json records them: {setting: [old, new]} (not the resume's own settings)."""
    return {c.key: [c.old, c.new] for c in found if c.key not in ("run_dir", "resume", "resume_changes", "dry_run")}


def applicable_changes(mode: str, recorded: dict | None, now: dict, what: str) -> list[Change]:
    """The changes a resume takes (a ConfigError where it must not); `recorded`: the checkpoint's config."""
    found = changes(recorded, now) if recorded is not None else []
    reason = refusal(found, mode, what, now)
    if reason:
        raise ConfigError(reason)
    return found
