"""Trackers write what they should: metrics.jsonl (always), TensorBoard event files, W&B offline runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, read_metrics, run_xtrain, wandb_history, wandb_records

RUN = ["trainer.max_steps=8", "trainer.log_every=4", "trainer.eval_every=4", "trainer.save_every=8"]


def test_tensorboard_event_files_hold_train_and_val_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", "tracker=tensorboard", *RUN)
    log_dir = run_dir / "tensorboard" / "xtrain"  # <tracker.project>; hparams go to a sub-run below it
    events = EventAccumulator(str(log_dir))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/loss", "val/ppl"} <= set(scalars)
    jsonl = {(r["step"], k): v for r in read_metrics(run_dir) for k, v in r.items() if k != "step"}
    for tag in ("train/loss", "val/loss"):
        for event in events.Scalars(tag):
            assert event.value == pytest.approx(jsonl[(event.step, tag)], rel=1e-6)
    assert [e.step for e in events.Scalars("val/loss")] == [0, 4, 8]


def test_wandb_runs_offline_without_an_account(tmp_path):
    run_dir = tmp_path / "run"
    # no API key, no ~/.netrc: auto mode must go offline and keep its files in the run dir
    run_xtrain(f"run_dir={run_dir}", "tracker=wandb", *RUN, env={"HOME": str(tmp_path / "home")})
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = wandb_history(log)
    logged = {(int(row["_step"]), key): value for row in history for key, value in row.items()}
    for row in read_metrics(run_dir):
        for key, value in row.items():
            if key != "step":
                assert logged[(row["step"], key)] == value, (row["step"], key)
    assert config["trainer/batch_size"] == 16 and config["model/arch"] == "gpt2"


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    """Killed after its step-6 checkpoint, with steps after it logged, and resumed: one W&B run id throughout (kept
    in the run dir), rewound to step 6 (W&B's resume_from: the steps trained again replace the killed attempt's
    rows), the resumed part logging from step 7 on."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    args = [f"run_dir={run_dir}", "tracker=wandb", "trainer.max_steps=12", "trainer.log_every=1",
            "trainer.eval_every=6", "trainer.save_every=6"]
    proc = subprocess.Popen([sys.executable, "-m", "xtrain", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    published = run_dir / "checkpoints" / "step_00000006" / "xtrain_state.json"
    # killed once step 6's checkpoint is published (written behind training) and a step after it, which the resumed
    # run trains again, is logged
    while not (published.exists() and any(row["step"] > 6 for row in logged_rows(run_dir))):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    run_xtrain(*args, "resume=auto", env={"HOME": str(tmp_path / "home")})
    run_id = (run_dir / "wandb_id").read_text().strip()
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)
    (log,) = runs[1].glob("run-*.wandb")
    resumed = sorted({int(row["_step"]) for row in wandb_history(log)[0] if "train/loss" in row})
    assert resumed == list(range(7, 13))
    (point,) = [r.run.branch_point for r in wandb_records(log) if r.WhichOneof("record_type") == "run"]
    assert (point.run, point.value, point.metric) == (run_id, 6, "_step")


def logged_rows(run_dir) -> list[dict]:
    """metrics.jsonl's complete rows so far (the last line may be being written)."""
    import json

    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows
