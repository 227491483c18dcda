"""`python -m xtrain.status DIR`: where a sweep or a run stands, from its files alone.

For a sweep dir: regenerates `sweep.csv`, `summary.md` and `sweep.png` and prints the table.
For a run dir: its status, steps, losses and throughput. Works on a running or killed sweep too.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from xtrain.backends.slurm import monitor
from xtrain.core import rundir
from xtrain.core.errors import ConfigError
from xtrain.engine import goodput
from xtrain.sweeps import summary

SHOWN = ["point", "status", "steps", "restarts", "train_loss", "val_loss", "tokens_per_s", "batch_sequences", "wall_time_s"]


def table_text(table: list[dict], columns: list[str]) -> str:
    cells = [[summary.fmt(r.get(c, "")) for c in columns] for r in table]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def sweep_status(sweep_dir: Path) -> str:
    entries = rundir.sweep_points(sweep_dir)
    jobs = {e["dir"]: slurm_state(sweep_dir / e["dir"]) for e in entries}
    table = summary.write(sweep_dir)
    keys = summary.swept_keys(entries)
    objective, direction = summary.ranking(sweep_dir)
    shown = [summary.throughput_column(table) if c == "tokens_per_s" else c for c in SHOWN]
    if objective not in shown:
        shown.insert(shown.index("val_loss") + 1, objective)
    if any(r.get("model_step", "") != "" for r in table):  # the model each point kept, which ranks it
        shown += ["model_step", f"model_{objective}"]
    columns = shown[:1] + keys + shown[1:]
    if any(jobs.values()):
        for r in table:
            r["slurm"] = jobs.get(r["point"]) or ""
        columns.append("slurm")
    lines = [table_text(summary.ranked(table, objective, direction), columns)]
    for r in table:
        if r["error"]:
            lines.append(f"{r['point']}: {r['error']}")
    record = summary.study_record(sweep_dir)
    top = summary.best(table, objective, direction)
    if record:
        told = ", ".join(f"{n} {state}" for state, n in sorted(record["trials"].items()))
        lines.append(f"study {record['study_name']}: {sum(record['trials'].values())} of {record['n_trials']} trials "
                     f"asked ({told}); pruner {record['pruner']}")
    lines += worker_lines(sweep_dir)
    if top:
        tied = summary.ties(table, top, objective)
        lines.append(f"best: {top['point']} ({objective} {summary.fmt(summary.scored(top, objective))} at step "
                     f"{top.get('model_step') or top['steps']}, the model it kept)"
                     + (f"; tied with {', '.join(tied)}" if tied else ""))
    lines.append(f"files: {sweep_dir / summary.MARKDOWN}, {sweep_dir / summary.CSV}, {sweep_dir / summary.PLOT}")
    return "\n".join(lines)


def slurm_state(run_dir: Path) -> str | None:
    """The SLURM job of a run submitted with cluster=slurm, as SLURM sees it now; a job that ended without
    its run recording how (cancelled, timed out, a node lost) gets that recorded in result.json here."""
    job = monitor.recorded_job(run_dir)
    if job is None:
        return None
    if shutil.which("squeue") is None:
        return f"job {job.job_id} (SLURM's commands are not on this machine's PATH)"
    state = monitor.job_state(job)
    if state.split()[0] not in monitor.ACTIVE and not state.startswith("unknown"):  # (unknown: never settled)
        monitor.settle(job, state)
    return f"job {job.job_id}: {state}"


def worker_lines(sweep_dir: Path) -> list[str]:
    """A study's SLURM workers: each one's job and the trial it runs (or ran last)."""
    lines = []
    for path in sorted((sweep_dir / rundir.WORKERS).glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        job = slurm_state(path)
        trial = path / rundir.WORKER_TRIAL
        number = json.loads(trial.read_text()).get("trial") if trial.exists() else None
        trial = "" if number is None else f", trial {number}"
        if job:
            lines.append(f"worker {path.name}: {job}{trial}")
    return lines


def run_status(run_dir: Path) -> str:
    job = slurm_state(run_dir)
    row = summary.run_row(run_dir)
    max_steps = summary.run_config(run_dir)["trainer"]["max_steps"] or rundir.read_result(run_dir).get("max_steps", "?")
    lines = [f"run {run_dir}: {row['status']}, step {row['steps'] or 0} of {max_steps}"]
    if job:
        lines.append(f"  slurm            {job}")
    metrics = [key for key in row if key.startswith("val_") and key not in ("val_loss", "val_ppl")]
    names = ["train_loss", "val_loss", "val_ppl", *metrics, summary.throughput_column([row]), "batch_sequences",
             "world_size", "wall_time_s"]
    for name in (["restarts", "steps_lost"] if row["restarts"] else []) + names:
        if row.get(name, "") != "":
            lines.append(f"  {name:16} {summary.fmt(row[name])}")
    if row.get("goodput", "") != "":
        lines.append(f"  {'goodput':16} {goodput.text(rundir.read_result(run_dir)).removeprefix('goodput ')}")
    if row["error"]:
        lines.append(f"  error            {row['error']}")
    newest = rundir.complete_checkpoints(run_dir)[-1:]
    if newest and row["status"] in RESUMABLE:
        step = int(rundir.CHECKPOINT_NAME.match(newest[0].name).group(1))
        lines.append(f"  resume           from its checkpoint of step {step}: run the same command with "
                     f"run_dir={run_dir} resume=auto")
    return "\n".join(lines)


# what a run that ended so continues from its newest checkpoint with resume=auto (a requeued SLURM job does by itself)
RESUMABLE = (rundir.LOST, rundir.Status.failed, rundir.Status.interrupted, rundir.Status.cancelled,
             rundir.Status.timeout)


USAGE = """usage: python -m xtrain.status RUN_DIR_OR_SWEEP_DIR

Where a run or a sweep (a study too) stands, from its files alone: a run's status, steps, losses and throughput;
a sweep's table of points (sweep.csv, summary.md and sweep.png are written anew). Works on a running, killed or
SLURM run alike."""


def main() -> None:
    if {"--help", "-h"} & set(sys.argv[1:]):
        print(USAGE)
        return
    if len(sys.argv) != 2:
        print(USAGE.splitlines()[0], file=sys.stderr)
        sys.exit(2)
    path = Path(sys.argv[1])
    try:
        shown = sweep_status(path) if rundir.is_sweep_dir(path) else \
            run_status(path) if (path / rundir.RUN_CONFIG).is_file() else None
    except ConfigError as err:
        print(f"xtrain.status: error: {err}", file=sys.stderr)
        sys.exit(2)
    if shown is not None:
        print(shown)
    elif not path.exists():
        print(f"xtrain.status: error: {path}: no such directory", file=sys.stderr)
        sys.exit(2)
    else:
        print(f"xtrain.status: error: {path}: neither a run dir (run.yaml) nor a sweep dir ({rundir.SWEEP_FILE})",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
