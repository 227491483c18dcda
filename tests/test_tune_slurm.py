"""A study on the real test cluster (tests/slurm/): its trials asked and run by a job array of 2 workers, one
worker's job requeued in the middle of a trial, which continues in its own run dir and stays one trial; and
what a study on SLURM refuses before anything is queued."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (assert_equal_weights, assert_one_line_error, read_result, run_xtrain, start_xtrain,
                      xtrain_in_process)
from test_slurm import SLURM, sacct_state
from test_slurm_requeue import LONG, every_step_once
from test_tune import STUDY, point_dirs, study_trials

pytestmark = pytest.mark.usefixtures("slurm_cluster")

LR = "trainer.lr=tag(log,interval(1e-4,1e-2))"


def running_trial(sweep_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> tuple[Path, Path]:
    """A worker's dir and the run dir of the trial it runs, once that trial has logged `step`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for worker in sorted((sweep_dir / "workers").glob("*")):
            try:
                trial = json.loads((worker / "current.json").read_text())["trial"]
                [run_dir] = sweep_dir.glob(f"{trial}_*")
                rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            except (FileNotFoundError, ValueError):
                continue
            if any(r.get("step", 0) >= step for r in rows) and read_result(run_dir)["status"] == "running":
                return worker, run_dir
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"no trial of {sweep_dir} reached step {step}")


def test_a_study_of_two_slurm_workers_survives_a_requeue_mid_trial(tmp_path):
    sweep_dir = tmp_path / "study"
    proc = start_xtrain("-m", f"run_dir={sweep_dir}", *STUDY, *SLURM, *LONG, "hydra.sweeper.n_trials=4",
                        "hydra.sweeper.n_jobs=2", "hydra.sweeper.pruner=none", LR)
    worker, requeued = running_trial(sweep_dir, 12, proc)
    job = json.loads((worker / "slurm.json").read_text())["job_id"]  # <array>_<task>: that worker only
    subprocess.run(["scancel", "--signal=USR2", job], check=True)  # the warning SLURM sends before a time limit
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err

    trials = study_trials(sweep_dir)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4  # n_trials, however the workers were stopped
    assert len({t.params["trainer.lr"] for t in trials}) == 4  # the two workers' samplers draw apart
    dirs = point_dirs(sweep_dir)
    assert sorted(p.name for p in dirs) == sorted(t.user_attrs["point"] for t in trials)
    assert sorted(p.name for p in sweep_dir.iterdir() if p.name[0].isdigit()) == sorted(p.name for p in dirs)
    for path in dirs:
        result = read_result(path)
        assert result["status"] == "completed" and every_step_once(path, 40), path
        assert ("restarts" in result) == (path == requeued), path
    [restart] = read_result(requeued)["restarts"]
    assert restart["slurm_job"] == job and restart["ended"] == "requeued" and restart["steps_lost"] == 0
    assert sacct_state(job) == "COMPLETED"
    # both workers ran trials, and each ended once no trial was left
    ran = [json.loads((w / "result.json").read_text()) for w in sorted((sweep_dir / "workers").glob("*"))]
    assert [r["status"] for r in ran] == ["completed", "completed"] and all(r["trials"] for r in ran)
    assert "worker 0 ended completed" in out and "worker 1 ended completed" in out
    assert "study done: 4 trials; best trial" in out
    assert len(re.findall(r"trial \d completed: val_loss \d\.\d{4} \(trainer\.lr=", out)) == 4  # each told, once
    summary = (sweep_dir / "summary.md").read_text()
    assert "4 points: 4 completed" in summary and "(best)" in summary
    assert all((sweep_dir / name).stat().st_size > 10_000 for name in ("history.png", "slice.png"))
    status = xtrain_in_process(str(sweep_dir), command="xtrain.status").stdout
    assert re.search(r"^worker 1: job \d+_1: COMPLETED, trial \d$", status, re.M), status
    assert "study study: 4 of 4 trials asked (4 complete)" in status

    # the requeued trial is the run its parameters give unbroken (on one CPU thread, as each worker's)
    trial = next(t for t in trials if t.user_attrs["point"] == requeued.name)
    unbroken = tmp_path / "unbroken"
    run_xtrain(f"run_dir={unbroken}", f"trainer.lr={trial.params['trainer.lr']!r}", *LONG, env={"OMP_NUM_THREADS": "1"})
    assert_equal_weights(requeued, unbroken)
    assert trial.value == read_result(requeued)["val_loss"]

    # the same command, resumed with a larger budget: one more trial, the others kept as they were
    proc = run_xtrain("-m", f"run_dir={sweep_dir}", *STUDY, *SLURM, *LONG, "hydra.sweeper.n_trials=5",
                      "hydra.sweeper.n_jobs=2", "hydra.sweeper.pruner=none", LR, "resume=auto")
    again = study_trials(sweep_dir)
    assert [t.state.name for t in again] == ["COMPLETE"] * 5
    assert [t.value for t in again[:4]] == [t.value for t in trials]
    assert re.search(r"trial 4 completed: val_loss", proc.stdout) and "study done: 5 trials" in proc.stdout
    assert [json.loads((w / "result.json").read_text())["status"] for w in sorted((sweep_dir / "workers").glob("*"))] \
        == ["completed", "completed"]


def test_a_study_s_trials_span_both_nodes_of_their_workers_allocation(tmp_path):
    """cluster.nodes=2: the one worker's allocation is both nodes; its first node asks for each trial and names it,
    the other trains it as node 1. Each trial's run spans n1 and n2 (one process a node), and what Optuna recorded of
    it is what its run dir says. Hydra's callbacks see each trial, in the worker that runs it."""
    from hydra_calls import recorded, recording
    from test_slurm import TINY

    sweep_dir, log = tmp_path / "study", tmp_path / "calls.jsonl"
    proc = run_xtrain("-m", f"run_dir={sweep_dir}", *STUDY, *SLURM, *TINY, "cluster.nodes=2", "cluster.num_processes=1",
                      "hydra.sweeper.n_trials=2", "hydra.sweeper.pruner=none", LR, *recording(log))
    trials = study_trials(sweep_dir)
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"], proc.stderr
    jobs = [c for c in recorded(log) if c["hook"] in ("on_job_start", "on_job_end")]
    assert [(c["hook"], c["num"]) for c in jobs] == [("on_job_start", 0), ("on_job_end", 0), ("on_job_start", 1),
                                                    ("on_job_end", 1)]
    assert [c["value"] for c in jobs[1::2]] == [t.value for t in trials]
    for path in point_dirs(sweep_dir):
        result = read_result(path)
        assert result["status"] == "completed" and result["world_size"] == 2 and result["hosts"] == ["n1", "n2"]
        assert len(list((path / "logs").glob("launcher-node*.log"))) == 2  # (one torchrun a node)
        assert trials[int(path.name.split("_")[0])].value == result["val_loss"]
    [worker] = sorted((sweep_dir / "workers").glob("*"))
    assert read_result(worker)["trials"] == [0, 1]
    record = json.loads((worker / "current.json").read_text())
    assert record | {"job": None} == {"job": None, "restart": 0, "trial": 1, "done": True}
    job, restart, beats = (worker / "first-node.beat").read_text().split()  # (the first node's, while it lived)
    assert (job, restart) == (record["job"], "0") and int(beats) >= 1


@pytest.mark.parametrize("overrides, expected", [
    (["cluster.cpus_per_task=choice(1,2)"], "asks SLURM for another allocation than"),
    (["hydra.sweeper.n_jobs=0"], "hydra.sweeper.n_jobs=0: must be >= 1"),
])
def test_what_a_study_on_slurm_refuses_before_queueing_anything(tmp_path, overrides, expected):
    sweep_dir = tmp_path / "refused"
    proc = run_xtrain("-m", f"run_dir={sweep_dir}", *STUDY, *SLURM, LR, *overrides, check=False)
    assert_one_line_error(proc, expected)
    assert not sweep_dir.exists()
