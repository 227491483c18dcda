"""Faults injected on purpose: a kill -9 in the export, a second trainer on a live run dir, corrupted checkpoints, a
full disk, a read-only run dir, a worker killed outright. Each test asserts what is kept and what the resume gives."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import (PACED, SHORT, SMALL, assert_one_line_error, logged, model_weights, read_result, run_xtrain,
                      start_xtrain, xtrain_in_process)
from xtrain.core import runlock
from xtrain.engine import checkpoint

TWELVE = ["trainer.max_steps=12", "trainer.warmup_steps=2", "trainer.log_every=4", "trainer.eval_every=6",
          "trainer.save_every=6"]
STEP_6, STEP_12 = "step_00000006", "step_00000012"

# A kill -9 in the middle of the final export: the model written to its temp dir, one file of it cut short.
KILL_IN_EXPORT = '''
import os, signal
from xtrain.tasks.causal_lm import task

shipped = task.CausalLM.export


def export(self, model, state_dict, out):
    shipped(self, model, state_dict, out)
    for file in out.rglob("*.safetensors"):
        file.write_bytes(file.read_bytes()[:1000])
    os.kill(os.getpid(), signal.SIGKILL)


task.CausalLM.export = export
'''


@pytest.fixture(scope="module")
def small_whole(tmp_path_factory) -> Path:
    """The small model's 12 steps, trained without a fault: what every faulted run must end as."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    run_xtrain(f"run_dir={run_dir}", *SMALL, *TWELVE)
    return run_dir


def assert_same_model(a: Path, b: Path) -> None:
    expected, got = model_weights(a), model_weights(b)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def status(run_dir: Path) -> str:
    return xtrain_in_process(str(run_dir), command="xtrain.status").stdout


def test_a_kill_in_the_final_export_is_finished_by_resume_auto(tmp_path, small_whole):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(KILL_IN_EXPORT)
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", *SMALL, *TWELVE, check=False, env={"PYTHONPATH": str(inject)})
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "model").exists() and (run_dir / ".tmp-model").is_dir()
    assert read_result(run_dir)["status"] == "running"
    assert "lost, step 12 of 12" in status(run_dir)
    assert f"from its checkpoint of step 12: run the same command with run_dir={run_dir} resume=auto" in status(run_dir)

    proc = run_xtrain(f"run_dir={run_dir}", *SMALL, *TWELVE, "resume=auto")
    assert f"resume: {run_dir / 'checkpoints' / STEP_12} has trained all 12 steps, but the run did not end: " \
           "finishing its export" in proc.stdout
    result, whole = read_result(run_dir), read_result(small_whole)
    assert result["status"] == "completed" and result["model_step"] == 12 and result["steps"] == 12
    assert result["val_loss"] == whole["val_loss"] and result["train_loss"] == whole["train_loss"]
    assert result["restarts"][0]["ended"] == "running" and result["steps_lost"] == 0
    assert not (run_dir / ".tmp-model").exists()
    assert_same_model(small_whole, run_dir)
    assert logged(run_dir) == logged(small_whole)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_dir / "model").num_parameters() > 0
    again = xtrain_in_process(f"run_dir={run_dir}", *SMALL, *TWELVE, "resume=auto", check=False)
    assert_one_line_error(again, "has already trained 12 steps; trainer.max_steps=12 leaves nothing to do")


def test_one_trainer_per_run_dir_a_second_is_refused_naming_the_live_one_until_it_is_gone(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*PACED, *TWELVE, "trainer.max_steps=40"]  # (10 s or more after step 6: the refusals fit)
    proc = start_xtrain(f"run_dir={run_dir}", *overrides, quiet=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / STEP_6 / "xtrain_state.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        written = {name: (run_dir / name).read_bytes() for name in ("run.yaml", "accelerate_config.yaml")}
        for attempt in (["resume=auto"], [], ["resume=auto", "dry_run=true"]):
            refused = xtrain_in_process(f"run_dir={run_dir}", *overrides, *attempt, check=False)
            assert_one_line_error(refused, f"run_dir={run_dir}: another process trains into it now (pid {proc.pid} on",
                                  f"kill -TERM {proc.pid} saves a checkpoint")
        assert_one_line_error(xtrain_in_process(str(run_dir), "split=val", command="xtrain.eval", check=False),
                              f"pid {proc.pid}")
        assert proc.poll() is None  # (still training: each refusal was of a live run)
        assert {name: (run_dir / name).read_bytes() for name in written} == written
        assert read_result(run_dir)["status"] == "running" and "restarts" not in read_result(run_dir)
    finally:
        proc.kill()
        proc.wait()
    assert (run_dir / ".lock").exists()  # (its process is gone: the kernel let go of the lock)
    run_xtrain(f"run_dir={run_dir}", *overrides, "resume=auto")
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["restarts"][0]["ended"] == "running"
    assert not (run_dir / ".lock").exists()


def corrupt(path: Path, how: str) -> None:
    """One of the ways a checkpoint's file goes bad: cut short, changed inside (same size), gone."""
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "changed":
        data = bytearray(path.read_bytes())
        data[len(data) // 3: len(data) // 3 + 4096] = os.urandom(4096)
        path.write_bytes(bytes(data))
    else:
        path.unlink()


@pytest.mark.parametrize("name, how, why", [
    ("model.safetensors", "truncated", "model.safetensors holds"),
    ("model.safetensors", "changed", "model.safetensors does not match the checksum it was written with"),
    ("optimizer.bin", "truncated", "optimizer.bin holds"),
    ("optimizer.bin", "missing", "optimizer.bin is missing"),
    ("random_states_0.pkl", "missing", "random_states_0.pkl is missing"),
    ("xtrain_state.json", "truncated", "its xtrain_state.json cannot be read (JSONDecodeError"),
])
def test_each_corruption_of_a_checkpoint_fails_its_check(short_run, tmp_path, name, how, why):
    path = tmp_path / STEP_12
    shutil.copytree(short_run / "checkpoints" / STEP_12, path)
    assert checkpoint.failure(path) is None
    corrupt(path / name, how)
    assert checkpoint.failure(path).startswith(why)


def test_a_corrupted_newest_checkpoint_is_set_aside_and_the_resume_continues_bitwise_from_the_one_before(
        short_run, tmp_path):
    """The step-6 checkpoint is made one of before checksums were recorded: it still resumes, on its state file."""
    run_dir = tmp_path / "run"
    shutil.copytree(short_run, run_dir, ignore=shutil.ignore_patterns(runlock.LOCK))  # (held a moment by a test beside)
    shutil.rmtree(run_dir / "model")
    corrupt(run_dir / "checkpoints" / STEP_12 / "model.safetensors", "changed")
    state_file = run_dir / "checkpoints" / STEP_6 / "xtrain_state.json"
    state_file.write_text(json.dumps({k: v for k, v in json.loads(state_file.read_text()).items() if k != "files"}))

    proc = run_xtrain(f"run_dir={run_dir}", *SHORT, "resume=auto")
    assert (f"checkpoint {run_dir / 'checkpoints' / STEP_12} fails its check: model.safetensors does not match the "
            f"checksum it was written with; set aside as {STEP_12}.corrupt, resuming from {STEP_6}") in proc.stdout
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["resumed_from"].endswith(STEP_6)
    [restart] = result["restarts"]
    assert restart["checkpoints_set_aside"] == [{"checkpoint": STEP_12, "set_aside": f"{STEP_12}.corrupt",
                                                 "why": "model.safetensors does not match the checksum it was written with"}]
    assert restart["steps_lost"] == 6
    assert_same_model(short_run, run_dir)
    assert logged(run_dir) == logged(short_run)
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == [STEP_6, STEP_12, f"{STEP_12}.corrupt"] and checkpoint.failure(run_dir / "checkpoints" / STEP_12) is None


def test_no_checkpoint_passing_its_check_is_refused_and_nothing_is_changed(short_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(short_run, run_dir, ignore=shutil.ignore_patterns(runlock.LOCK))  # (held a moment by a test beside)
    corrupt(run_dir / "checkpoints" / STEP_12 / "optimizer.bin", "truncated")
    corrupt(run_dir / "checkpoints" / STEP_6 / "random_states_0.pkl", "missing")
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    proc = xtrain_in_process(f"run_dir={run_dir}", "trainer.max_steps=18", "resume=auto", "resume_changes=apply",
                             check=False)
    assert_one_line_error(proc, f"resume=auto: no checkpoint passes its check ({STEP_12}: optimizer.bin holds",
                          f"{STEP_6}: random_states_0.pkl is missing)")
    one = xtrain_in_process(f"run_dir={run_dir}", f"resume={run_dir / 'checkpoints' / STEP_12}", check=False)
    line = assert_one_line_error(one, f"resume={run_dir / 'checkpoints' / STEP_12}: fails its check: optimizer.bin holds")
    assert line.count(STEP_12) == 1  # (named once)
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    """A filesystem of `size` (a full disk, made here: root only, as CI runs)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_full_disk_at_a_checkpoint_is_one_line_the_partial_files_go_and_the_resume_continues(tmp_path, small_whole):
    """A tmpfs holds the first checkpoint (1 MB) but not the second."""
    with tmpfs(tmp_path / "disk", "1500k") as disk:
        run_dir = disk / "run"
        proc = xtrain_in_process(f"run_dir={run_dir}", *SMALL, *TWELVE, check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"xtrain: error: the checkpoint of step 12 could not be written to {run_dir / 'checkpoints'}"
                               ": no space left on the device (it takes about 1.0 MB,")
        assert line.endswith(f"its partial files are removed and {STEP_6} is kept; make room (or fix that), then run "
                             f"the same command with run_dir={run_dir} resume=auto")
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [STEP_6]
        assert checkpoint.failure(run_dir / "checkpoints" / STEP_6) is None
        result = read_result(run_dir)
        assert result["status"] == "failed" and result["error"] == "WriteFailed: " + line.removeprefix("xtrain: error: ")

        subprocess.run(["mount", "-o", "remount,size=10m", str(disk)], check=True)
        run_xtrain(f"run_dir={run_dir}", *SMALL, *TWELVE, "resume=auto")
        assert read_result(run_dir)["status"] == "completed"
        assert_same_model(small_whole, run_dir)


def test_a_read_only_run_dir_is_refused_in_one_line(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        (disk / "run").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        for run_dir in (disk / "run", disk / "new" / "run"):
            for extra in ([], ["dry_run=true"]):
                proc = xtrain_in_process(f"run_dir={run_dir}", *extra, check=False)
                assert_one_line_error(proc, f"run_dir={run_dir}: cannot be written (a read-only filesystem at")


def test_a_text_corpus_that_is_not_text_is_refused_with_its_file_and_offset(tmp_path):
    from xtrain.data.sources import not_text

    binary = tmp_path / "weights.txt"
    binary.write_bytes(b"fine so far " + bytes(range(256)) * 40)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(bytes(range(0x80, 0x100)) * 40)
    mostly_text = tmp_path / "text.txt"
    mostly_text.write_bytes("Grüße, a text with one stray byte: \xe9 ".encode("utf-8") + b"\xe9" + b" and more" * 100)
    assert not_text(str(binary)) == "a NUL byte at offset 12"
    assert not_text(str(latin)) == "5120 of its first 5120 bytes are not UTF-8, the first at offset 0"
    assert not_text(str(mostly_text)) is None
    proc = xtrain_in_process(f"run_dir={tmp_path / 'run'}", "data=text", f"data.files=[{mostly_text},{binary}]",
                             check=False)
    assert_one_line_error(proc, f"data.files: {binary} is not text (a NUL byte at offset 12); give UTF-8 text files")
    assert not (tmp_path / "run").exists()


def test_a_batch_larger_than_the_data_found_by_the_worker_leaves_nothing_behind(tmp_path):
    """Refused as the model is built (after run.yaml is written): what the launch wrote is taken back."""
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", *SMALL, "trainer.batch_size=100000", "cluster.check_memory=false",
                             check=False)
    assert_one_line_error(proc, "trainer.batch_size=100000: larger than the 955 training blocks")
    assert not run_dir.exists()


def test_a_worker_killed_outright_is_the_rank_named(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_xtrain(f"run_dir={run_dir}", *PACED, *TWELVE, "trainer.max_steps=60", "cluster.num_processes=2")
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / STEP_6 / "xtrain_state.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    agent = next(p for p in psutil.Process(proc.pid).children(recursive=True) if "xtrain.launch.agent" in " ".join(p.cmdline()))
    rank_1 = sorted(agent.children(), key=lambda p: p.create_time())[1]  # (forked in rank order)
    rank_1.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "xtrain: error: rank 1 failed: its process was killed by SIGKILL (by hand, or the kernel's OOM killer" in err
    assert "Terminated" not in err
    result = read_result(run_dir)
    assert result["status"] == "failed" and result["error"].startswith("rank 1: its process was killed by SIGKILL")
    assert f"run the same command with run_dir={run_dir} resume=auto" in status(run_dir)


def test_the_rank_killed_outright_is_named_before_the_peer_that_lost_its_connection(tmp_path):
    """torchrun saw both fail in one poll: rank 1 killed, rank 0 raising as its collective's peer vanished. Within
    the same second, torchrun calls the lower rank its root cause; the rank without an error of its own is named."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from xtrain.launch.supervisor import killed_rank

    run_dir = tmp_path / "run"
    (run_dir / "logs" / "errors").mkdir(parents=True)
    (run_dir / "logs" / "errors" / "rank0.json").write_text(json.dumps({"rank": 0, "terminated": False}))
    failures = {0: ProcessFailure(0, 101, 1, "<N/A>"), 1: ProcessFailure(1, 102, -signal.SIGKILL, "<N/A>")}
    failures[0].timestamp = failures[1].timestamp
    log = run_dir / "logs" / "launcher-node0.log"
    log.write_text(f"earlier output\n{ChildFailedError('xtrain.launch.worker', failures)}\n")
    root_cause = log.read_text().split("Root Cause")[1]
    assert "rank      : 0 (local_rank: 0)" in root_cause  # (torchrun's own choice is the peer)
    killed = killed_rank(log, 0, run_dir)
    assert killed["rank"] == 1 and killed["signalled"]
    assert killed["summary"] == "its process was killed by SIGKILL (by hand, or the kernel's OOM killer: see dmesg)"
    failures[1] = ProcessFailure(1, 102, 1, "<N/A>")  # (rank 1 ended with a code, not a signal, and said nothing)
    log.write_text(str(ChildFailedError("xtrain.launch.worker", failures)))
    killed = killed_rank(log, 0, run_dir)
    assert killed["rank"] == 1 and not killed["signalled"] and "exited with code 1" in killed["summary"]
    (run_dir / "logs" / "errors" / "rank1.json").write_text("{}")  # both said why: their own errors decide
    assert killed_rank(log, 0, run_dir) is None


def test_a_full_disk_in_the_final_export_is_one_line_and_resume_auto_finishes_it(tmp_path, small_whole):
    """A tmpfs that holds the run's one checkpoint (1 MB) but not its model/ (0.3 MB more) as well."""
    once = [*SMALL, *TWELVE, "trainer.save_every=12"]
    with tmpfs(tmp_path / "disk", "1200k") as disk:
        run_dir = disk / "run"
        proc = xtrain_in_process(f"run_dir={run_dir}", *once, check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"xtrain: error: step 12's model/ could not be written to {run_dir}: no space left on the "
                               "device") and f"the newest checkpoint ({STEP_12}) is kept" in line
        assert not (run_dir / "model").exists() and not (run_dir / ".tmp-model").exists()
        assert read_result(run_dir)["status"] == "failed"

        subprocess.run(["mount", "-o", "remount,size=10m", str(disk)], check=True)
        run_xtrain(f"run_dir={run_dir}", *once, "resume=auto")
        result = read_result(run_dir)
        assert result["status"] == "completed" and result["restarts"][0]["ended"] == "failed"
        assert_same_model(small_whole, run_dir)
