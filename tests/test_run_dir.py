"""The run-dir contract's writers: result.json through one read-merge-write helper, atomic files and directories."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from xtrain.core import files, rundir


def test_update_result_merges_replaces_and_guards(tmp_path):
    assert rundir.update_result(tmp_path, {"status": "running", "steps": 3}) == {"status": "running", "steps": 3}
    assert rundir.update_result(tmp_path, {"steps": 4})["status"] == "running"  # merged
    assert rundir.update_result(tmp_path, {"status": "failed", "error": "x"}, fresh=True) == {"status": "failed",
                                                                                              "error": "x"}
    unchanged = rundir.update_result(tmp_path, {"status": "completed"}, only_if=lambda r: r.get("status") == "running")
    assert unchanged["status"] == "failed" and rundir.read_result(tmp_path)["status"] == "failed"
    with pytest.raises(AssertionError, match="not a result status: 'done'"):
        rundir.update_result(tmp_path, {"status": "done"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # no temp or lock file left


def test_the_loops_typed_record_writes_result_jsons_keys():
    """What the loop knows, typed, as result.json's keys: what is not known yet is absent; the attempt's own values
    over the ones an earlier attempt recorded; an eval's best kept by direction, the monitored one left to the
    monitor; a restart's time down from its stop to the first step."""
    from xtrain.engine.result import Result

    typed = Result({"max_steps": 10, "world_size": 1}, 4,  # (started, steps, and what earlier attempts recorded)
                   {"restarts": [{"at_step": 4, "stopped_at": time.time() - 5}], "initial_val_loss": 3.0,
                    "train_loss": 9.9, "tokens_per_s": 1.0})
    assert typed.as_dict() == {"restarts": typed.recorded["restarts"], "initial_val_loss": 3.0, "train_loss": 9.9,
                                "tokens_per_s": 1.0, "status": "running", "steps": 4, "max_steps": 10, "world_size": 1}
    typed.evals.best = {"best_val_accuracy": 0.5}
    directions = {"val_loss": "minimize", "val_accuracy": "maximize"}
    for loss, accuracy in [(2.0, 0.4), (1.0, 0.3), (1.5, 0.9)]:
        typed.evals.record({"loss": loss, "accuracy": accuracy}, directions, monitored="val_loss")
    typed.evals.add_time(0.25)
    typed.evals.add_time(0.5)
    typed.first_step_done(time.time() - 2)
    typed.train_loss = 1.25
    out = typed.as_dict()
    assert out["val_loss"] == 1.5 and out["val_accuracy"] == 0.9 and out["eval_time_s"] == 0.75
    assert out["best_val_accuracy"] == 0.9 and "best_val_loss" not in out  # (the monitor's, judged after)
    assert out["train_loss"] == 1.25 and out["initial_val_loss"] == 3.0  # its own value; the earlier one carried
    assert 1.5 < out["time_to_first_step_s"] < 5 and 4.5 < out["restarts"][0]["down_s"] < 10
    assert not {"model_step", "model_test", "error", "stop", "checkpoint_step"} & set(out)
    json.dumps(out)  # (as update_result writes it)


def test_record_end_keeps_an_end_the_trainer_recorded(tmp_path):
    rundir.record_end(tmp_path, "failed", "before training", started_only=True)
    assert not (tmp_path / "result.json").exists()  # nothing started: the dir can take the run again
    rundir.update_result(tmp_path, {"status": rundir.Status.running.value})
    rundir.record_end(tmp_path, "interrupted", "sweep interrupted")
    rundir.record_end(tmp_path, "failed", "later")
    assert rundir.read_result(tmp_path) == {"status": "interrupted", "error": "sweep interrupted"}


def _count_up(path: str, key: str, n: int) -> None:
    for i in range(n):
        rundir.update_result(Path(path), {key: i + 1})


def test_concurrent_writers_never_clobber_each_other(tmp_path):
    """Four processes merge their own key into one result.json 50 times each: every key ends complete."""
    rundir.update_result(tmp_path, {"status": "running"})
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_count_up, args=(str(tmp_path), f"w{i}", 50)) for i in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    result = rundir.read_result(tmp_path)
    assert result == {"status": "running", "w0": 50, "w1": 50, "w2": 50, "w3": 50}


def test_write_atomic_uses_a_temp_file_of_its_own_and_leaves_none(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (seen.append(Path(a).name), real_replace(a, b)))
    files.write_atomic(tmp_path / "x.json", "1")
    files.write_atomic(tmp_path / "x.json", "2")
    assert len(set(seen)) == 2 and all(name.startswith(".x.json.") for name in seen)
    assert (tmp_path / "x.json").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_dir_swaps_in_the_new_version(tmp_path, monkeypatch, exchange):
    """With RENAME_EXCHANGE the swap is one step; where a filesystem lacks it, two renames (docs: the run dir)."""
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    final, tmp = tmp_path / "model", tmp_path / ".tmp-model"
    final.mkdir()
    (final / "weights").write_text("old")
    tmp.mkdir()
    (tmp / "weights").write_text("new")
    files.replace_dir(tmp, final)
    assert (final / "weights").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_replace_dir_exchange_leaves_no_moment_without_the_directory(tmp_path):
    """A reader polling model/ while it is replaced 200 times never finds it missing (Linux, tmpfs/ext4)."""
    final = tmp_path / "model"
    final.mkdir()
    if not files._exchange(final, final):  # an exchange with itself: a no-op where the filesystem supports it
        pytest.skip("this filesystem has no RENAME_EXCHANGE: replace_dir is two renames here (README)")
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    missing = ctx.Value("i", 0)

    def reader():
        while not stop.is_set():
            if not final.is_dir():
                missing.value += 1

    proc = ctx.Process(target=reader)
    proc.start()
    for i in range(200):
        tmp = tmp_path / ".tmp-model"
        tmp.mkdir()
        (tmp / "weights").write_text(str(i))
        files.replace_dir(tmp, final)
    time.sleep(0.05)
    stop.set()
    proc.join(10)
    assert missing.value == 0 and (final / "weights").read_text() == "199"


def test_a_half_written_rank_error_never_hides_the_real_one(tmp_path):
    errors = tmp_path / rundir.ERRORS_DIR
    errors.mkdir(parents=True)
    (errors / "rank0.json").write_text('{"rank": 0, "time": 1, "terminated": fal')  # cut short by a kill
    files.write_atomic(errors / "rank1.json", json.dumps({"rank": 1, "time": 2, "terminated": False,
                                                          "summary": "RuntimeError: the real one"}))
    assert rundir.first_rank_error(tmp_path)["summary"] == "RuntimeError: the real one"


def test_the_echo_of_a_job_output_starts_over_when_a_requeue_writes_it_anew(tmp_path, capsys):
    """SLURM truncates a requeued job's output: the echo notices by its first bytes, even where the new output has
    grown past the old end between two looks, and prints the new incarnation's lines from its start."""
    from xtrain.backends.slurm.monitor import Tail

    out = tmp_path / "0_log.out"
    out.write_text("[10:00:01] start\nstep 1\nstep 2\npart")
    echo = Tail(out)
    echo.echo_new_lines()
    assert capsys.readouterr().out == "[10:00:01] start\nstep 1\nstep 2\n"
    with open(out, "a") as f:
        f.write("ial line\nsubmitit INFO bookkeeping\n")
    echo.echo_new_lines()
    assert capsys.readouterr().out == "partial line\n"
    out.write_text("[10:05:00] start\nresumed from step 2\nstep 3\nstep 4\nstep 5\n")  # longer than before
    echo.echo_new_lines()
    assert capsys.readouterr().out == "[10:05:00] start\nresumed from step 2\nstep 3\nstep 4\nstep 5\n"
    out.write_text("[10:09:00] x\n")  # shorter than before
    echo.echo_new_lines()
    assert capsys.readouterr().out == "[10:09:00] x\n"
