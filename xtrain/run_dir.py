"""The run dir contract: run.yaml, metrics.jsonl, result.json, checkpoints/, model/.

Every file is replaced atomically (write aside, rename), so an interrupted run never
leaves a half-written one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from xtrain import checkpoint
from xtrain.config import ConfigError, RunConfig, to_yaml
from xtrain.files import write_atomic

RUN_CONFIG = "run.yaml"
METRICS = "metrics.jsonl"
RESULT = "result.json"
MODEL = "model"


def holds_run(run_dir: Path) -> bool:
    """Training started here (a run that failed before its first step can be run again)."""
    return (run_dir / RESULT).exists() or bool(checkpoint.existing(run_dir))


def check_free(cfg: RunConfig) -> None:
    """Refuse to start over a run that is there already (unless resuming)."""
    if cfg.resume == "none" and holds_run(Path(cfg.run_dir)):
        raise ConfigError(
            f"run_dir={cfg.run_dir}: already holds a run; continue it with resume=auto, or choose a new run_dir"
        )


def prepare(cfg: RunConfig) -> Path:
    """Create the run dir and write run.yaml; refuse to start over a run that is there already."""
    check_free(cfg)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / RUN_CONFIG, to_yaml(cfg))
    return run_dir


def write_result(run_dir: Path, result: dict) -> None:
    write_atomic(run_dir / RESULT, json.dumps(result, indent=2) + "\n")


def record_end(run_dir: Path, status: str, error: str, started_only: bool = False) -> None:
    """How a run ended, in result.json, unless its trainer recorded an end already. `started_only`: only
    for a run whose training had started (its result.json exists): a run that failed before can reuse its dir."""
    path = run_dir / RESULT
    if started_only and not path.exists():
        return
    result = json.loads(path.read_text()) if path.exists() else {}
    if result.get("status") in (None, "running"):
        write_result(run_dir, {**result, "status": status, "error": error})


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


def continued(run_dir: Path, step: int, last_logged: int) -> dict:
    """What a run resumed in its own run dir carries over from the attempt before: its restarts, one more.
    Steps lost: those trained after the checkpoint resumed from (as far as metrics.jsonl shows them)."""
    path = run_dir / RESULT
    before = json.loads(path.read_text()) if path.exists() else {}
    stop = before.get("stop") or {}
    restart = {
        "at_step": step,
        "steps_lost": max(0, last_logged - step),
        "ended": before.get("status", "unknown"),  # `running`: killed without a chance to record anything
        "reason": before.get("error") or "killed without warning (no stop signal reached it)",
        "stopped_at": stop.get("at"),
        "resumed_at": time.time(),
    }
    if os.environ.get("SLURM_JOB_ID"):  # a sweep's point: <array job>_<task>, as slurm.json has it
        array = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
        restart["slurm_job"] = "_".join(array) if all(array) else os.environ["SLURM_JOB_ID"]
        restart["slurm_restart_count"] = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    restarts = [*before.get("restarts", []), restart]
    carried = {key: before[key] for key in ("initial_val_loss",) if key in before}
    return {**carried, "restarts": restarts, "steps_lost": sum(r["steps_lost"] for r in restarts)}
