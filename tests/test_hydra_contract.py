"""Hydra's launcher contract on xtrain's own runs (hydra/launcher=xtrain here; test_slurm.py and test_ray.py hold
the same on SLURM and Ray): a batched sweeper's points keep their swept values, `hydra.callbacks` see every job
with its JobReturn, an explicit `hydra.sweep.subdir` places the points, `${hydra:job.num}` is each job's."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error, read_result, xtrain_in_process
from hydra_calls import check_jobs, recorded, recording

TINY = ["trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.log_every=2", "trainer.eval_every=2",
        "trainer.save_every=2"]


def test_a_batched_sweep_keeps_every_points_values_and_callbacks_see_every_job(tmp_path):
    sweep_dir, log = tmp_path / "sweep", tmp_path / "calls.jsonl"
    proc = xtrain_in_process("-m", f"run_dir={sweep_dir}", "hydra/sweeper=basic", "hydra.sweeper.max_batch_size=2",
                             "trainer.seed=0,1,2", *TINY, *recording(log))
    names = ["0_seed=0", "1_seed=1", "2_seed=2"]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == names
    with open(sweep_dir / "sweep.csv") as f:
        assert [(r["point"], r["trainer.seed"]) for r in csv.DictReader(f)] == list(zip(names, "012"))
    points = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    assert [p["overrides"] for p in points] == [["trainer.seed=0"], ["trainer.seed=1"], ["trainer.seed=2"]]
    assert "sweep done: 3 points" in proc.stdout  # (the last batch's line counts the whole sweep)

    calls = recorded(log)
    check_jobs(calls, sweep_dir, names, seeds=[0, 1, 2])
    for num, end in enumerate(calls[2:-1:2]):
        assert end["overrides"] == [f"run_dir={sweep_dir}", f"trainer.seed={num}", *TINY]  # (Hydra's own apart)


def test_a_failed_point_reaches_the_callbacks_as_a_failed_job(tmp_path):
    sweep_dir, log = tmp_path / "sweep", tmp_path / "calls.jsonl"
    proc = xtrain_in_process("-m", f"run_dir={sweep_dir}", "trainer.batch_size=2000,8", *TINY, *recording(log),
                             check=False)
    assert proc.returncode == 1 and "1 of 2 points failed" in proc.stderr
    ends = [c for c in recorded(log) if c["hook"] == "on_job_end"]
    assert [e["status"] for e in ends] == ["FAILED", "COMPLETED"]
    assert ends[0]["value"].startswith("point 0 (trainer.batch_size=2000) failed: trainer.batch_size=2000: larger than")


def test_an_explicit_subdir_places_the_points_and_hydra_job_num_is_each_jobs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    xtrain_in_process("-m", f"run_dir={sweep_dir}", "hydra.sweep.subdir=job${hydra.job.num}_bs${trainer.batch_size}",
                      "trainer.seed=${hydra:job.num}", "trainer.batch_size=4,8", *TINY)
    with open(sweep_dir / "sweep.csv") as f:
        assert [r["point"] for r in csv.DictReader(f)] == ["job0_bs4", "job1_bs8"]
    for num, name in enumerate(["job0_bs4", "job1_bs8"]):
        assert read_result(sweep_dir / name)["status"] == "completed"
        assert f"seed: {num}\n" in (sweep_dir / name / "run.yaml").read_text()  # run.yaml: what trained


@pytest.mark.parametrize("subdir,line", [
    ("same", "xtrain: error: hydra.sweep.subdir: points 0 and 1 would share the run dir {sweep}/same; give each its "
             "own, e.g. hydra.sweep.subdir='${{hydra.job.num}}_...'"),
    ("../elsewhere", "xtrain: error: point 0 (trainer.batch_size=4): hydra.sweep.subdir=../elsewhere: outside the "
                     "sweep dir {sweep}; give a path inside it"),
])
def test_a_subdir_that_would_mix_points_or_leave_the_sweep_is_refused(tmp_path, subdir, line):
    sweep_dir = tmp_path / "sweep"
    proc = xtrain_in_process("-m", f"run_dir={sweep_dir}", f"hydra.sweep.subdir={subdir}", "trainer.batch_size=4,8",
                             *TINY, check=False)
    assert_one_line_error(proc, line.format(sweep=sweep_dir))
    assert not sweep_dir.exists() and not (tmp_path / "elsewhere").exists()


def test_a_later_batch_refused_leaves_the_earlier_batches_runs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = xtrain_in_process("-m", f"run_dir={sweep_dir}", "hydra/sweeper=basic", "hydra.sweeper.max_batch_size=1",
                             "hydra.sweep.subdir=same", "trainer.batch_size=4,8", *TINY, check=False)
    assert proc.returncode == 2 and "points 0 and 1 would share the run dir" in proc.stderr
    assert read_result(sweep_dir / "same")["status"] == "completed"
    assert (sweep_dir / "sweep.json").exists() and (sweep_dir / "multirun.yaml").exists()


def test_a_study_calls_the_callbacks_for_every_trial(tmp_path):
    sweep_dir, log = tmp_path / "study", tmp_path / "calls.jsonl"
    xtrain_in_process("-m", f"run_dir={sweep_dir}", "hydra/sweeper=xtrain_optuna", "hydra.sweeper.n_trials=2",
                      "trainer.lr=tag(log,interval(1e-4,1e-2))", *TINY, *recording(log))
    calls = recorded(log)
    assert [c["hook"] for c in calls] == ["on_multirun_start", *["on_job_start", "on_job_end"] * 2, "on_multirun_end"]
    for num, end in enumerate(calls[2:-1:2]):
        assert end["num"] == num and end["status"] == "COMPLETED"
        assert end["value"] == pytest.approx(read_result(Path(end["output_dir"]))["val_loss"])
