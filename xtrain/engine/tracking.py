"""Trackers, all through Accelerate's tracker API: metrics.jsonl always, plus TensorBoard or W&B."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from accelerate.tracking import GeneralTracker

from xtrain.config.cluster import SHELL_STRINGS
from xtrain.config.schema import RunConfig, TrackerConfig, TrackerKind, to_container
from xtrain.core.files import write_atomic
from xtrain.core.rundir import METRICS

TENSORBOARD_DIR = "tensorboard"
WANDB_ID = "wandb_id"


class JsonlTracker(GeneralTracker):
    """One JSON object per `accelerator.log` call, with its step, flushed at once."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self._file = None

    def start(self) -> None:
        self._file = open(self.path, "a")

    @property
    def tracker(self):
        return self._file

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


def wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return os.environ.get("WANDB_MODE", "online")
    try:
        import netrc

        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


def log_with(tracker: TrackerConfig, run_dir: Path) -> list:
    trackers: list = [JsonlTracker(run_dir / METRICS)]
    if tracker.kind is TrackerKind.tensorboard:
        trackers.append("tensorboard")
    elif tracker.kind is TrackerKind.wandb:
        trackers.append("wandb")
    return trackers


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run this run dir logs to, chosen once and kept in the run dir: a resumed run continues it."""
    path = run_dir / WANDB_ID
    if path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)  # W&B run ids: lowercase letters and digits
    write_atomic(path, run_id + "\n")
    return run_id


def init_kwargs(tracker: TrackerConfig, run_dir: Path, main_process: bool, start_step: int,
                last_logged: int = 0) -> dict:
    """Tracker settings for `init_trackers` (which starts trackers on the main process only). A resumed run
    continues its W&B run, rewound to the checkpoint where the attempt before logged steps after it (W&B's
    `resume_from`: the rows of the steps trained again are the new ones); TensorBoard hides what a killed attempt
    logged after the checkpoint (purge_step)."""
    if tracker.kind is TrackerKind.wandb and main_process:
        run_id = wandb_run_id(run_dir)
        again = {"resume_from": f"{run_id}?_step={start_step}"} if last_logged > start_step else {"resume": "allow"}
        return {"wandb": {"dir": str(run_dir), "mode": wandb_mode(tracker.wandb_mode), "name": run_dir.name,
                          "id": run_id, **again}}
    if tracker.kind is TrackerKind.tensorboard and start_step:
        return {"tensorboard": {"purge_step": start_step + 1}}
    return {}


def hyperparameters(cfg: RunConfig) -> dict:
    """The run config as trackers want hyperparameters: flat `a/b` keys, scalar values. The cluster's shell
    strings (setup lines, srun and sbatch arguments) stay on this machine: they may name credentials' paths."""
    tree = to_container(cfg)
    for name in SHELL_STRINGS:
        tree["cluster"].pop(name, None)  # (a SLURM job's alone)
    return _flat(tree)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}/"))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


def log_goodput(accelerator, figures: dict, step: int) -> None:
    """The whole run's goodput for TensorBoard and W&B, as it ends: `goodput` and each part of its span in seconds
    (`goodput/<part>_s`). Not in metrics.jsonl, whose rows are steps and evals: result.json holds it."""
    row = {"goodput": figures["goodput"], **{f"goodput/{part}": seconds
                                             for part, seconds in figures["goodput_breakdown"].items()}}
    for tracker in accelerator.trackers:
        if tracker.name != JsonlTracker.name:
            tracker.log(row, step=step)
