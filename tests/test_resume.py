"""Checkpoint/resume: a run killed with SIGKILL and resumed ends bitwise equal to the uninterrupted run; a resume
never trains other settings than run.yaml records."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import (PACED, SMALL, assert_equal_weights, assert_one_line_error, compose_run, kill_after_checkpoint,
                      logged, model_weights, read_metrics, read_result, run_xtrain, start_xtrain, xtrain_in_process)
from test_errors import snapshot

# 40 optimizer steps x 2 micro-batches of 16 = 80 micro-batches: crosses the first epoch (955 blocks / 16 = 59 batches).
RUN = ["trainer.max_steps=40", "trainer.grad_accum=2", "trainer.save_every=10", "trainer.eval_every=20",
       "trainer.log_every=5", "trainer.warmup_steps=5", "trainer.keep_checkpoints=2"]


def test_sigkill_then_resume_is_bitwise_equal_to_uninterrupted(tmp_path):
    """With dropout, bitwise equality needs both the data order and every RNG restored. (The killed run is paced: its
    steps' sleeps change no number.)"""
    overrides = [*RUN, *SMALL, "model.dropout=0.1"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_xtrain(f"run_dir={whole}", *overrides)

    paced = [*RUN, *PACED, "model.dropout=0.1"]
    proc = start_xtrain(f"run_dir={killed}", *paced, quiet=True)
    kill_after_checkpoint(proc, killed / "checkpoints" / "step_00000020")
    assert read_result(killed)["status"] == "running"  # what a killed run leaves
    last_logged = max(r["step"] for r in read_metrics(killed))
    run_xtrain(f"run_dir={killed}", *paced, "resume=auto")

    result = read_result(killed)
    assert result["status"] == "completed" and result["resumed_from"].endswith("step_00000020")
    [restart] = result["restarts"]  # the steps trained after the checkpoint were lost, and trained again
    assert restart["ended"] == "running" and restart["at_step"] == 20
    assert restart["steps_lost"] == last_logged - 20 == result["steps_lost"]
    assert_equal_weights(whole, killed)
    # the metrics after resume are the uninterrupted run's, with no row of the killed run's lost steps
    assert logged(killed) == logged(whole)


def test_resume_auto_without_checkpoint_starts_fresh(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", "resume=auto", "trainer.max_steps=4", "trainer.log_every=2")
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["resumed_from"] is None and result["steps"] == 4
    assert f"resume=auto: {run_dir} holds no checkpoint; starting fresh" in proc.stdout


def test_interrupted_saves_are_ignored_and_cleaned(tmp_path):
    """A save killed midway leaves a .tmp- dir (removed); a step dir without xtrain_state.json is not xtrain's:
    never resumed from, set aside with what it holds."""
    run_dir = tmp_path / "run"
    common = ["trainer.max_steps=6", "trainer.save_every=3", "trainer.log_every=3", "trainer.eval_every=3"]
    run_xtrain(f"run_dir={run_dir}", *common)
    ckpts = run_dir / "checkpoints"
    half_tmp = ckpts / ".tmp-step_00000009"
    half_tmp.mkdir()
    (half_tmp / "model.safetensors").write_bytes(b"truncated")
    no_state = ckpts / "step_00000012"
    no_state.mkdir()
    (no_state / "model.safetensors").write_bytes(b"truncated")

    run_xtrain(f"run_dir={run_dir}", "resume=auto", "trainer.max_steps=9", *common[1:], "resume_changes=apply")
    result = read_result(run_dir)
    assert result["resumed_from"].endswith("step_00000006") and result["steps"] == 9
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000006", "step_00000009", "step_00000012.corrupt"]
    assert (ckpts / "step_00000012.corrupt" / "model.safetensors").read_bytes() == b"truncated"


def test_resume_of_a_finished_run_says_what_to_raise(short_run):
    proc = xtrain_in_process(f"run_dir={short_run}", "resume=auto", "trainer.max_steps=12", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "already trained 12 steps" in proc.stderr and "raise trainer.max_steps" in proc.stderr


# 8 steps, checkpoints at 4 and 8: with the step-8 one removed, a run killed after its step-4 checkpoint
EIGHT = ["trainer.max_steps=8", "trainer.warmup_steps=2", "trainer.log_every=1", "trainer.eval_every=4",
         "trainer.save_every=4"]


@pytest.fixture
def killed_at_4(tmp_path) -> Path:
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", *EIGHT)
    shutil.copytree(run_dir / "model", tmp_path / "unbroken_model")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000008")
    return run_dir


def test_a_resume_that_would_change_what_trains_is_refused_listing_each_change(killed_at_4):
    """run.yaml never says something other than what trains: a new lr or seed is not taken silently."""
    before = snapshot(killed_at_4)
    proc = xtrain_in_process(f"run_dir={killed_at_4}", *EIGHT, "trainer.lr=0.1", "trainer.max_steps=10", "resume=auto",
                             check=False)
    assert_one_line_error(proc, "resume=auto: ", "step_00000004 was trained with other settings: ",
                          "trainer.lr 0.002 -> 0.1, trainer.max_steps 8 -> 10", "add resume_changes=apply")
    assert snapshot(killed_at_4) == before
    for opt_in in ([], ["resume_changes=apply"]):  # the batch, the seed: not even with the opt-in
        fixed = xtrain_in_process(f"run_dir={killed_at_4}", *EIGHT, "trainer.batch_size=8", "trainer.seed=3",
                                  "resume=auto", *opt_in, check=False)
        assert_one_line_error(fixed, "trainer.batch_size 16 -> 8, trainer.seed 0 -> 3",
                              "trainer.batch_size, trainer.seed cannot change within a run")
    assert snapshot(killed_at_4) == before


def test_a_resume_may_change_when_things_happen_and_records_it(killed_at_4):
    """Log, eval and save intervals, checkpoints kept, the tracker, a timeout: taken, recorded in run.yaml and the
    restart entry, and the weights are the unbroken run's."""
    cadence = ["trainer.log_every=2", "trainer.eval_every=2", "trainer.keep_checkpoints=1", "tracker=tensorboard",
               "cluster.timeout_s=300"]
    state = killed_at_4 / "checkpoints" / "step_00000004" / "xtrain_state.json"  # as earlier versions wrote it
    state.write_text(state.read_text().replace('"seen":', '"tokens_seen":'))
    run_xtrain(f"run_dir={killed_at_4}", *EIGHT, *cadence, "resume=auto")
    result = read_result(killed_at_4)
    assert result["status"] == "completed" and result["steps"] == 8
    assert result["restarts"][0]["changed"] == {
        "cluster.timeout_s": [600, 300], "tracker.kind": ["none", "tensorboard"], "trainer.eval_every": [4, 2],
        "trainer.keep_checkpoints": [2, 1], "trainer.log_every": [1, 2]}
    run_yaml = (killed_at_4 / "run.yaml").read_text()
    assert "log_every: 2" in run_yaml and "kind: tensorboard" in run_yaml
    assert [r["step"] for r in read_metrics(killed_at_4) if "train/loss" in r] == [1, 2, 3, 4, 6, 8]
    seen = {r["step"]: r["train/tokens_seen"] for r in read_metrics(killed_at_4) if "train/tokens_seen" in r}
    assert seen[8] == 2 * seen[4] == 8 * 16 * 128  # the count went on from the checkpoint's
    from safetensors.torch import load_file

    unbroken = load_file(killed_at_4.parent / "unbroken_model" / "model.safetensors")
    for name, tensor in model_weights(killed_at_4).items():
        assert torch.equal(tensor, unbroken[name]), name


def test_resume_changes_apply_makes_a_new_lr_and_a_longer_run_take_effect(killed_at_4):
    """resume_changes=apply: from step 5 on the optimizer steps with the new peak lr on the new schedule (cosine to
    step 12), run.yaml says so, and the restart entry records what changed."""
    from xtrain.engine.optim import lr_factor

    run_xtrain(f"run_dir={killed_at_4}", *EIGHT, "trainer.lr=0.01", "trainer.max_steps=12", "resume=auto",
               "resume_changes=apply")
    result = read_result(killed_at_4)
    assert result["status"] == "completed" and result["steps"] == 12
    assert result["restarts"][0]["changed"] == {"trainer.lr": [0.002, 0.01], "trainer.max_steps": [8, 12]}
    assert "lr: 0.01" in (killed_at_4 / "run.yaml").read_text()
    old, new = compose_run(*EIGHT), compose_run(*EIGHT, "trainer.lr=0.01", "trainer.max_steps=12")
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(killed_at_4) if "train/lr" in r}
    assert sorted(lrs) == list(range(1, 13))
    for step, lr in lrs.items():  # the lr each step trained at: the schedule's after the steps before it
        cfg = old if step <= 4 else new
        assert lr == pytest.approx(cfg.trainer.lr * lr_factor(step - 1, cfg.trainer), rel=1e-6), step
