"""Checkpoint/resume: a run killed with SIGKILL and resumed ends bitwise equal to the uninterrupted run."""

from __future__ import annotations


import pytest

from conftest import assert_equal_weights, kill_after_checkpoint, logged, read_metrics, read_result, run_xtrain, start_xtrain, xtrain_in_process

# 40 optimizer steps x 2 micro-batches of 16 = 80 micro-batches: crosses the first epoch (955 blocks / 16 = 59 batches).
RUN = ["trainer.max_steps=40", "trainer.grad_accum=2", "trainer.save_every=10", "trainer.eval_every=20",
       "trainer.log_every=5", "trainer.warmup_steps=5", "trainer.keep_checkpoints=2"]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sigkill_then_resume_is_bitwise_equal_to_uninterrupted(tmp_path, dropout):
    overrides = [*RUN, f"model.dropout={dropout}"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_xtrain(f"run_dir={whole}", *overrides)

    proc = start_xtrain(f"run_dir={killed}", *overrides, quiet=True)
    kill_after_checkpoint(proc, killed / "checkpoints" / "step_00000020")
    assert read_result(killed)["status"] == "running"  # what a killed run leaves
    last_logged = max(r["step"] for r in read_metrics(killed))
    run_xtrain(f"run_dir={killed}", *overrides, "resume=auto")

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
    run_xtrain(f"run_dir={run_dir}", "resume=auto", "trainer.max_steps=4", "trainer.log_every=2")
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["resumed_from"] is None and result["steps"] == 4


def test_interrupted_saves_are_ignored_and_cleaned(tmp_path):
    """A save killed midway leaves a .tmp- dir or a step dir without xtrain_state.json: never resumed from."""
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

    run_xtrain(f"run_dir={run_dir}", "resume=auto", "trainer.max_steps=9", *common[1:])
    result = read_result(run_dir)
    assert result["resumed_from"].endswith("step_00000006") and result["steps"] == 9
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000006", "step_00000009"]


def test_resume_of_a_finished_run_says_what_to_raise(short_run):
    proc = xtrain_in_process(f"run_dir={short_run}", "resume=auto", "trainer.max_steps=12", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "already trained 12 steps" in proc.stderr and "raise trainer.max_steps" in proc.stderr
