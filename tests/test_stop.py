"""Stop signals on one machine: SIGTERM / SIGUSR1 end a run at a step boundary with a checkpoint, exit
`interrupted` with a line saying how to continue, and `resume=auto` ends bitwise equal to the unbroken run,
W&B and TensorBoard included."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (PACED, REPO, SHARDED, SMALL, assert_equal_weights, logged, read_metrics, read_result, run_xtrain,
                      start_xtrain, wandb_history)

ONE = ["trainer.max_steps=30", "trainer.warmup_steps=3", "trainer.log_every=2", "trainer.eval_every=10",
       "trainer.save_every=10", "trainer.batch_size=8"]


def signal_at_step(proc: subprocess.Popen, run_dir: Path, step: int, signum: int) -> tuple[str, str]:
    """Send `signum` once a row of step >= `step` is logged; the run's output once it has ended."""
    deadline = time.time() + 300
    while not ((run_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in read_metrics(run_dir))):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"{run_dir} never reached step {step}"
        time.sleep(0.05)
    proc.send_signal(signum)
    return proc.communicate(timeout=300)


def assert_stopped_at_a_step_boundary(proc: subprocess.Popen, stderr: str, run_dir: Path, name: str) -> int:
    """Exit 128+N, one line saying how to continue, result `interrupted` at step k with a checkpoint of step k."""
    assert proc.returncode == 128 + signal.Signals[name], stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    result = read_result(run_dir)
    step = result["stop"]["step"]
    assert last == (f"xtrain: stopped by {name} at step {step} with a checkpoint; to continue, run the same "
                    f"command with run_dir={run_dir} resume=auto")
    assert result["status"] == "interrupted" and result["stop"]["signal"] == name and result["steps"] == step
    state = json.loads((run_dir / "checkpoints" / f"step_{step:08d}" / "xtrain_state.json").read_text())
    assert state["step"] == step
    assert max(r["step"] for r in read_metrics(run_dir)) <= step  # nothing logged after it
    assert not (run_dir / "model").exists()
    return step


def test_sigterm_stops_a_run_at_a_step_boundary_and_it_continues_bitwise_in_one_wandb_run(tmp_path):
    home = {"HOME": str(tmp_path / "home")}
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    run_xtrain(f"run_dir={whole}", *ONE, *SMALL, env=home)

    proc = start_xtrain(f"run_dir={stopped}", *ONE, *PACED, "tracker=wandb", env=home)
    _, stderr = signal_at_step(proc, stopped, 12, signal.SIGTERM)
    step = assert_stopped_at_a_step_boundary(proc, stderr, stopped, "SIGTERM")
    run_xtrain(f"run_dir={stopped}", *ONE, *PACED, "tracker=wandb", "resume=auto", env=home)

    result = read_result(stopped)
    assert result["status"] == "completed" and result["resumed_from"].endswith(f"step_{step:08d}")
    assert_equal_weights(whole, stopped)
    assert logged(stopped) == logged(whole)  # every step once, the log window across the stop included
    [restart] = result["restarts"]
    assert restart["at_step"] == step and restart["steps_lost"] == 0 and restart["ended"] == "interrupted"
    assert restart["down_s"] > 0 and result["steps_lost"] == 0
    # one W&B run: the same id in both attempts, its history every train step once, in order
    run_id = (stopped / "wandb_id").read_text().strip()
    runs = sorted((stopped / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)
    steps = [int(row["_step"]) for r in runs for row in wandb_history(next(r.glob("run-*.wandb")))[0]
             if "train/loss" in row]
    assert steps == list(range(2, 31, 2))


def test_sigusr1_stops_two_processes_together_and_they_continue_bitwise(tmp_path, ddp_two_processes):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    proc = start_xtrain(f"run_dir={run_dir}", "strategy=ddp", *SHARDED, "tracker=tensorboard")
    _, stderr = signal_at_step(proc, run_dir, 12, signal.SIGUSR1)
    step = assert_stopped_at_a_step_boundary(proc, stderr, run_dir, "SIGUSR1")
    ranks = sorted(p.name for p in (run_dir / "checkpoints" / f"step_{step:08d}").glob("random_states_*"))
    assert ranks == ["random_states_0.pkl", "random_states_1.pkl"]  # both ranks saved the same step
    run_xtrain(f"run_dir={run_dir}", "strategy=ddp", *SHARDED, "tracker=tensorboard", "resume=auto")

    assert read_result(run_dir)["status"] == "completed"
    assert_equal_weights(ddp_two_processes, run_dir)
    assert logged(run_dir) == logged(ddp_two_processes)
    events = EventAccumulator(str(run_dir / "tensorboard" / "xtrain"))  # one log dir for both attempts
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(2, 21, 2))


def test_a_closed_terminal_stops_a_run_at_a_step_boundary(tmp_path):
    """The terminal a run was started from is closed (its pty's master: the kernel sends SIGHUP, and every later write
    to it fails): the run stops at a step boundary with its checkpoint, as for SIGTERM, and exits 128 + SIGHUP."""
    import fcntl
    import os
    import pty
    import select
    import sys
    import termios
    import threading

    run_dir = tmp_path / "run"
    master, slave = pty.openpty()

    def in_the_terminals_session():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([sys.executable, "-m", "xtrain", f"run_dir={run_dir}", *ONE, *PACED], cwd=REPO,
                            stdin=slave, stdout=slave, stderr=slave, preexec_fn=in_the_terminals_session)
    os.close(slave)
    reading, shown = threading.Event(), []
    reading.set()

    def read_the_terminal():  # (never blocked in a read: a read in progress would keep the terminal open)
        while reading.is_set():
            if select.select([master], [], [], 0.1)[0]:
                try:
                    shown.append(os.read(master, 65536))
                except OSError:
                    return

    reader = threading.Thread(target=read_the_terminal)
    reader.start()
    deadline = time.time() + 300
    while not ((run_dir / "metrics.jsonl").exists() and any(r["step"] >= 12 for r in read_metrics(run_dir))):
        assert proc.poll() is None and time.time() < deadline, b"".join(shown).decode(errors="replace")
        time.sleep(0.05)
    reading.clear()
    reader.join()
    os.close(master)
    assert proc.wait(timeout=300) == 128 + signal.SIGHUP
    result = read_result(run_dir)
    step = result["stop"]["step"]
    assert result["status"] == "interrupted" and result["stop"]["signal"] == "SIGHUP" and 12 <= step < 30
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "xtrain_state.json").is_file()


def test_rank_0s_lines_go_to_the_log_once_the_terminal_is_gone():
    """A closed terminal fails every write (EIO): the lines the workers print go on into the launcher's log, and the
    pipe keeps being read (a reader that stopped would leave the workers blocked on their next print)."""
    import io

    from xtrain.launch import supervisor

    class Closed(io.StringIO):
        def write(self, text):
            raise OSError(5, "Input/output error")

    prefix = supervisor.RANK0_PREFIX
    lines = [f"{prefix}step 1\n", "torchrun's own\n", f"{prefix}step 2\n"]
    log = io.StringIO()
    supervisor._pump(io.BytesIO("".join(lines).encode()), Closed(), log)
    assert log.getvalue() == "step 1\ntorchrun's own\nstep 2\n"


def test_a_second_signal_stops_at_once(tmp_path):
    """A stop that is taking too long (a huge checkpoint, a hung rank) can still be ended right away."""
    from xtrain.core import stopping

    with stopping.on():
        stopping.request(signal.SIGTERM)
        assert stopping.requested()["signal"] == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            stopping.request(signal.SIGTERM)
    assert stopping.requested() is None  # leaving the scope forgets the request
    with stopping.on(stopping.IN_WORKERS, escalate=False):  # workers: the driver repeats its request
        stopping.request(signal.SIGUSR1)
        stopping.request(signal.SIGUSR1)
        assert stopping.requested()["signal"] == "SIGUSR1"


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_sigterm_to_a_sweep_stops_its_running_points_at_a_step_boundary(tmp_path, n_jobs):
    """In the driver (n_jobs=1) the running point stops, later ones stay pending; with points in processes
    of their own, each running point gets the stop and saves its step."""
    sweep_dir = tmp_path / "sweep"
    proc = start_xtrain("-m", f"run_dir={sweep_dir}", "trainer.batch_size=4,8", "trainer.max_steps=2000",
                   "trainer.log_every=1", "trainer.save_every=1000", f"hydra.launcher.n_jobs={n_jobs}")
    running = [sweep_dir / "0_batch_size=4"] + ([sweep_dir / "1_batch_size=8"] if n_jobs == 2 else [])
    deadline = time.time() + 300
    while not all((p / "metrics.jsonl").exists() and len(read_metrics(p)) >= 3 for p in running):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and f"sweep interrupted; continue it with run_dir={sweep_dir} resume=auto" in err
    for point in running:
        result = read_result(point)
        assert result["status"] == "interrupted" and result["stop"]["signal"] == "SIGTERM"
        assert (point / "checkpoints" / f"step_{result['stop']['step']:08d}" / "xtrain_state.json").is_file()
    if n_jobs == 1:
        assert not (sweep_dir / "1_batch_size=8" / "result.json").exists()  # not started
