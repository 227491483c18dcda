"""The run-dir contract: the files a run and a sweep leave behind, and the one way to write `result.json`.

A run dir:

| file | what | written by |
| --- | --- | --- |
| `run.yaml` | the resolved, typed run config (what the workers read) | `prepare`, before anything runs |
| `metrics.jsonl` | one JSON object per logged train step and per eval | the trainer (tracking.py) |
| `result.json` | how the run stands or ended (`Result`, `Status`) | `update_result` only |
| `checkpoints/` | Accelerate states, newest last (checkpoint.py) | the trainer |
| `model/` | the final model, loadable by transformers | the task's export |
| `evals/` | a metric's arrays (a confusion matrix) per eval: `<name>/step_N.json`, and `.png` for a square one | the trainer |
| `logs/` | torchrun's and SLURM's output; `logs/errors/rank<R>.json`: a failed rank's own error | launchers, workers |
| `slurm.json` | the SLURM job that runs it (cluster=slurm) | the SLURM backend |

A sweep dir is a run dir of run dirs: `sweep.json` lists its points (`Point`), each a run dir below it,
and the summary files (summary.py) are derived from those alone.

Every file is replaced atomically (files.py), so an interrupted run never leaves a half-written one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from enum import Enum
from pathlib import Path
from typing import Callable, TypedDict

from xtrain.core import machine
from xtrain.core.errors import ConfigError, one_line
from xtrain.core.files import write_atomic

RUN_CONFIG = "run.yaml"
METRICS = "metrics.jsonl"
RESULT = "result.json"
PREPARED = "prepared.json"  # what the launch found before it started (launch/prepared.py)
MODEL = "model"
EVALS = "evals"  # a metric's arrays (a confusion matrix), per eval: evals/<name>/step_N.json (and .png)
LOGS = "logs"
ERRORS_DIR = Path(LOGS) / "errors"
SLURM_FILE = "slurm.json"
SWEEP_FILE = "sweep.json"
WORKERS = "workers"  # a study's SLURM workers' own dirs, in its sweep dir
WORKER_TRIAL = "current.json"  # in a worker's dir: its SLURM array and the trial it runs


CHECKPOINTS = "checkpoints"  # step_XXXXXXXX dirs (checkpoint.py writes them)
CHECKPOINT_STATE = "xtrain_state.json"  # written last into a checkpoint: a dir without it is not one
CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if CHECKPOINT_NAME.match(p.name) and (p / CHECKPOINT_STATE).is_file()]
    return sorted(found, key=lambda p: p.name)


class Status(str, Enum):
    """`result.json`'s `status`: every value any writer may record."""

    running = "running"  # training started (or an attempt resumed) and has not ended
    completed = "completed"  # trained `trainer.max_steps` steps and saved `model/`
    failed = "failed"  # an error ended it (`error` says which); it can be resumed from its checkpoints
    interrupted = "interrupted"  # stopped: on request at a step boundary with a checkpoint (`stop`), or at once
    requeued = "requeued"  # stopped with a checkpoint; its SLURM job was requeued and will resume it
    pruned = "pruned"  # a study's trial its pruner stopped at a step boundary, with a checkpoint (engine/pruning.py)
    cancelled = "cancelled"  # its SLURM job was cancelled before the run could record an end
    timeout = "timeout"  # its SLURM job reached its time limit before the run could record an end


PENDING = "pending"  # what readers show for a run dir without result.json: written, not started
LOST = "lost"  # what readers show for a run `running` whose process on this machine is gone: killed outright
ENDED = {Status.completed, Status.failed, Status.interrupted, Status.cancelled, Status.timeout, Status.pruned}


class Result(TypedDict, total=False):
    """The fields of `result.json` that tools read (the trainer records more: throughput, memory, hosts)."""

    status: Status
    error: str  # one line: why it failed or stopped
    steps: int  # optimizer steps done
    max_steps: int
    train_loss: float
    val_loss: float
    val_ppl: float
    initial_val_loss: float
    tokens_per_s: float
    world_size: int
    wall_time_s: float
    model_step: int  # the step of the model in model/
    model_eval: dict  # what that model scored at its eval: {"step", "val_loss", "val_<metric>", ...}
    stop: dict  # a stop at a step boundary: {"signal", "at", "step"}
    restarts: list  # one entry per resume in this run dir (requeue or resume=auto): `continued`
    steps_lost: int  # logged steps trained again after those restarts
    slurm_state: str  # the SLURM job's end state, where it says more than `status`


def unreadable(path: Path, err: BaseException | str) -> ConfigError:
    """A run dir's file that is cut short or garbled (damaged on disk: xtrain replaces its files whole), in one line."""
    why = err if isinstance(err, str) else f"{type(err).__name__}: {one_line(err)[:120]}"
    return ConfigError(f"{path}: cut short or garbled ({why}); xtrain changed nothing: restore it from a copy, "
                       "or give another run dir")


def read_result(run_dir: Path) -> dict:
    """result.json, or {} before it is written; a ConfigError where it is damaged."""
    path = Path(run_dir) / RESULT
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (ValueError, UnicodeDecodeError) as err:
        raise unreadable(path, err) from None
    if not isinstance(result, dict):
        raise unreadable(path, f"a JSON {type(result).__name__}, not an object")
    return result


def result_bytes(run_dir: Path) -> bytes | None:
    """result.json as it is on disk now (None before it is written): whether a run recorded anything since."""
    try:
        return (Path(run_dir) / RESULT).read_bytes()
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _locked(run_dir: Path):
    """Writers of one run's result.json on this machine take turns (the read-merge-write is one step)."""
    fd = os.open(run_dir, os.O_RDONLY)  # the lock is on the directory itself: no file of its own
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks: still atomic, last writer wins
            pass
        yield
    finally:
        os.close(fd)


def update_result(run_dir: Path, changes: dict, *, fresh: bool = False,
                  only_if: Callable[[dict], bool] | None = None) -> dict:
    """Merge `changes` into result.json (`fresh`: replace it), atomically; returns what is recorded.
    `only_if(current)`: change nothing unless it holds for what is recorded now."""
    status = changes.get("status")
    assert status is None or status in Status._value2member_map_, f"not a result status: {status!r}"
    with _locked(run_dir):
        current = read_result(run_dir)
        if only_if is not None and not only_if(current):
            return current
        merged = {**({} if fresh else current), **changes}
        write_atomic(Path(run_dir) / RESULT, json.dumps(merged, indent=2) + "\n")
        return merged


def this_process() -> dict:
    """The process that trains a run (its main rank), as result.json records it: a reader on the same machine can
    tell whether it is still there."""
    import socket

    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time()}


def process_gone(record: dict | None) -> bool:
    """The recorded process ran on this machine and is no longer there (its pid gone, or taken by another)."""
    import socket

    import psutil

    if not record or record.get("host") != socket.gethostname():
        return False  # another machine's (a SLURM node's): its scheduler tells
    try:
        return abs(psutil.Process(record["pid"]).create_time() - record["started"]) > 1.0
    except psutil.NoSuchProcess:
        return True


def shown_status(run_dir: Path) -> str:
    """A run's status as readers show it: result.json's, `pending` before it, `lost` for a local run still `running`
    whose process is gone (killed outright: resume=auto continues it). A SLURM run's end its scheduler tells."""
    result = read_result(run_dir)
    status = result.get("status", PENDING)
    local = not (Path(run_dir) / SLURM_FILE).exists()
    if status == Status.running and local and process_gone(result.get("process")):
        return LOST
    return status


def kept_value(result: dict, name: str):
    """`name` (`val_loss`, `val_<metric>`) as the model in `model/` scored it: at the eval it was exported at
    (`model_eval`: the best eval's with `trainer.export=best`, the last eval's otherwise), else the run's last value
    (`train_loss`, a run that kept no model)."""
    return (result.get("model_eval") or {}).get(name, result.get(name))


def record_end(run_dir: Path, status: str, error: str, started_only: bool = False, a_rank_failed: bool = False) -> None:
    """How a run ended, in result.json, unless its trainer recorded an end already. `started_only`: only
    for a run whose training had started (its result.json exists): a run that failed before can reuse its dir.
    `a_rank_failed`: the end is the first rank's own failure, which also replaces what the main rank recorded as it
    failed or was stopped because of it (its collective cut off, its SIGTERM: `failed`, or `interrupted` with no stop
    checkpoint)."""
    def open_end(recorded: dict) -> bool:
        status_now = recorded.get("status")
        because = status_now == Status.failed.value or status_now == Status.interrupted.value and "stop" not in recorded
        return status_now in (None, Status.running.value) or a_rank_failed and because

    if started_only and not (Path(run_dir) / RESULT).exists():
        return
    update_result(run_dir, {"status": Status(status).value, "error": error}, only_if=open_end)


def holds_run(run_dir: Path) -> bool:
    """Training started here (a run that failed before its first step can be run again)."""
    return (run_dir / RESULT).exists() or bool(complete_checkpoints(run_dir))


def keep_metrics_until(run_dir: Path, step: int) -> int:
    """On resume: drop rows a killed run logged after the checkpoint it resumes from; the last step logged."""
    path = run_dir / METRICS
    if not path.exists():
        return 0
    rows, last = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        last = max(last, row.get("step") or 0)
        if row.get("step", 0) <= step:
            rows.append(line)
    write_atomic(path, "".join(f"{r}\n" for r in rows))
    return last


def keep_evals_until(run_dir: Path, step: int) -> None:
    """On resume (or a fresh start in the run dir): drop the eval files (`evals/`) of steps after `step`, which the
    attempt before wrote and this one trains again."""
    for path in (Path(run_dir) / EVALS).glob("*/step_*.*"):
        found = CHECKPOINT_NAME.match(path.stem)
        if found and int(found.group(1)) > step:
            path.unlink()


MOVED = "# moved"  # run.yaml's history: a comment line for each time the run moved to another world or strategy
AUTO_SAVE = "# save_every=auto"  # run.yaml's history: the interval save_every=auto chose (chosen again on a restart)
EPOCHS = "# max_epochs"  # run.yaml's history: the steps trainer.max_epochs came to, once the data was known


def add_history(run_dir: str | Path, line: str, body: str | None = None) -> None:
    """run.yaml with `line` in its history (in place of an earlier line of its kind: its text up to `:`) and, where
    given, `body` as its config."""
    file = Path(run_dir) / RUN_CONFIG
    text = file.read_text().splitlines(keepends=True)
    kind = line.partition(":")[0]
    kept = [h for h in text if h.startswith("# ") and h.partition(":")[0] != kind]
    body = body if body is not None else "".join(h for h in text if not h.startswith("# "))
    write_atomic(file, "".join(kept) + f"{line}\n" + body)


def history(run_dir: Path) -> list[str]:
    """run.yaml's history lines (`# moved ...`, `# save_every=auto ...`), oldest first."""
    file = Path(run_dir) / RUN_CONFIG
    return [line for line in file.read_text().splitlines() if line.startswith("# ")] if file.is_file() else []


def moves_recorded(run_dir: Path) -> list[str]:
    """run.yaml's history lines (`# moved ...`), oldest first; none where there is no run.yaml."""
    file = Path(run_dir) / RUN_CONFIG
    return [line for line in file.read_text().splitlines() if line.startswith(MOVED)] if file.is_file() else []


def continued(run_dir: Path, step: int, last_logged: int, changed: dict | None = None, moved: dict | None = None,
              set_aside: list | None = None) -> dict:
    """What a run resumed in its own run dir carries over from the attempt before: its restarts, one more.
    Steps lost: those trained after the checkpoint resumed from (as far as metrics.jsonl shows them)."""
    before = read_result(run_dir)
    stop = before.get("stop") or {}
    restart = {
        "at_step": step,
        "steps_lost": max(0, last_logged - step),
        "ended": before.get("status", "unknown"),  # `running`: killed without a chance to record anything
        "reason": before.get("error") or ("it had completed: trained on with more steps"
                                          if before.get("status") == Status.completed else
                                          "killed without warning (no stop signal reached it)"),
        "stopped_at": stop.get("at") or before.get("lost_at"),
        "resumed_at": time.time(),
    }
    if changed:  # settings that differ from the checkpoint's: {setting: [old, new]}
        restart["changed"] = changed
    if moved:  # another world or strategy than the checkpoint's: {"world": [4, 2], "strategy": [...], "grad_accum": ...}
        restart["moved"] = moved
    if set_aside:  # newer checkpoints that failed their check: [{"checkpoint", "why", "set_aside"}]
        restart["checkpoints_set_aside"] = set_aside
    if os.environ.get("SLURM_JOB_ID"):  # a sweep's point: <array job>_<task>, as slurm.json has it
        array = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
        restart["slurm_job"] = "_".join(array) if all(array) else os.environ["SLURM_JOB_ID"]
        restart["slurm_restart_count"] = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if os.environ.get(machine.RESTART_ENV):
        restart["ray_restart_count"] = int(os.environ[machine.RESTART_ENV])
    restarts = [*before.get("restarts", []), restart]
    carried = {key: before[key] for key in ("initial_val_loss",) if key in before}
    return {**carried, "restarts": restarts, "steps_lost": sum(r["steps_lost"] for r in restarts)}


def first_rank_error(run_dir: Path) -> dict | None:
    """The error of the rank that failed first (`logs/errors/rank<R>.json`), not one a failure ended."""
    errors = []
    for path in (Path(run_dir) / ERRORS_DIR).glob("rank*.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    root = [e for e in errors if not e["terminated"]] or errors
    return min(root, key=lambda e: e["time"]) if root else None


# ---------------------------------------------------------------- a sweep dir


def is_sweep_dir(path: Path) -> bool:
    return (Path(path) / SWEEP_FILE).is_file()


def sweep_points(sweep_dir: Path) -> list[dict]:
    """sweep.json's entries: {"num", "dir" (the point's run dir, relative), "overrides" (the swept ones)}."""
    return json.loads((Path(sweep_dir) / SWEEP_FILE).read_text())["points"]


def add_sweep_points(sweep_dir: Path, points: list) -> None:
    """Record points in sweep.json; a sweeper may launch its points in several batches: they join earlier ones."""
    known = {e["num"]: e for e in (sweep_points(sweep_dir) if is_sweep_dir(sweep_dir) else [])}
    known.update({p.num: {"num": p.num, "dir": p.path.name, "overrides": p.swept} for p in points})
    write_atomic(Path(sweep_dir) / SWEEP_FILE, json.dumps({"points": [known[n] for n in sorted(known)]}, indent=2) + "\n")
