"""Stops on the real test cluster (tests/slurm/): a warning signal, `scontrol requeue` without warning, a time
limit shorter than the run, a stop past `cluster.max_requeues`, a requeued sweep point. Each run comes back in
its own run dir and ends bitwise equal to the same run unbroken, every step logged once."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from conftest import (PACED, SMALL, assert_equal_weights, finished, logged, read_metrics, read_result, run_xtrain,
                      start_xtrain, wandb_history)
from test_slurm import SLURM, job_id, sacct_state, sweep_rows, wait_for_step

pytestmark = pytest.mark.usefixtures("slurm_cluster")

# 40 steps of at least 0.25 s, a row every step, periodic checkpoints every 5: long enough to be stopped in the middle.
LONG = ["trainer.max_steps=40", "trainer.warmup_steps=4", "trainer.log_every=1", "trainer.eval_every=10",
        "trainer.save_every=5", "trainer.batch_size=4", *PACED]
TWO_PROCESSES = [*LONG, "cluster.num_processes=2"]


@pytest.fixture(scope="module")
def two_processes_unbroken(tmp_path_factory):
    """The reference: the same run as a local 2-process run, never stopped. It starts alongside the first test that
    asks for it (which mostly waits on SLURM); `two_processes_unbroken()` waits for it and gives its run dir."""
    run_dir = tmp_path_factory.mktemp("unbroken") / "run"
    proc = start_xtrain(f"run_dir={run_dir}", *TWO_PROCESSES, quiet=True)

    def done() -> Path:
        if proc.returncode is None:
            finished(proc)
        return run_dir

    yield done
    done()


def every_step_once(run_dir: Path, max_steps: int, log_every: int = 1) -> bool:
    logged_steps = [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]
    return logged_steps == list(range(log_every, max_steps + 1, log_every))


def wait_until_running(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the run's job holds its allocation (SLURM's state RUNNING)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "slurm.json").exists():
            state = subprocess.run(["squeue", "-h", "-j", job_id(run_dir), "-o", "%T"], capture_output=True, text=True)
            if state.stdout.strip() == "RUNNING":
                return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"{run_dir}: its job never ran")


def test_a_warning_signal_stops_a_two_node_job_which_requeues_itself_and_continues_bitwise(tmp_path,
                                                                                          two_processes_unbroken):
    """Two 2-node jobs, one CPU of each node each. The first, stopped by a warning, requeues itself onto both nodes and
    ends bitwise where the unbroken run does (the local 2-process run: bitwise the 2-node job's). The second
    (`cluster.min_nodes=1`), stopped by a warning while n2 is drained, requeues itself asking for the one node that can
    run, n1, and continues there on 1 process with grad_accum 2 (the effective batch kept) along the unbroken run
    (the same 8 blocks a step; only the order of float sums differs)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = [*SLURM, *LONG, "cluster.nodes=2", "cluster.num_processes=1"]
    run_dir, fewer = tmp_path / "run", tmp_path / "fewer"
    proc = start_xtrain(f"run_dir={run_dir}", *args, "tracker=tensorboard")
    moving = start_xtrain(f"run_dir={fewer}", *args, "cluster.min_nodes=1")
    for started, process in ((run_dir, proc), (fewer, moving)):
        wait_until_running(started, process)
    job = job_id(run_dir)
    # n2 drained once both jobs hold it: each is stopped as soon as it is at step 12 (their starts differ by up to
    # 10 s under load, the time the first takes to its end)
    subprocess.run(["scontrol", "update", "nodename=n2", "state=drain", "reason=xtrain-test"], check=True)
    warn = ["scancel", "--signal=USR2"]  # what SLURM sends before the time limit
    try:  # (the first job's requeue waits for n2 until the second has started again on n1)
        wait_for_step(run_dir, 12, proc)
        subprocess.run([*warn, job], check=True)
        wait_for_step(fewer, 12, moving)
        assert read_result(fewer)["hosts"] == ["n1", "n2"]  # the second's first allocation: both nodes
        subprocess.run([*warn, job_id(fewer)], check=True)
        deadline = time.time() + 120
        while not read_result(fewer).get("restarts") and time.time() < deadline:
            time.sleep(0.5)
    finally:
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], check=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err

    result = read_result(run_dir)
    assert result["status"] == "completed" and result["hosts"] == ["n1", "n2"]
    [restart] = result["restarts"]
    assert restart["ended"] == "requeued" and restart["steps_lost"] == 0 and restart["slurm_job"] == job
    assert restart["slurm_restart_count"] == 1 and restart["reason"].startswith("stopped by SIGUSR2 at step")
    assert result["resumed_from"].endswith(f"step_{restart['at_step']:08d}")
    assert f"slurm job {job}: PENDING" in out and "restart 1" in out  # followed across the requeue
    assert sacct_state(job) == "COMPLETED"
    unbroken = two_processes_unbroken()
    assert every_step_once(run_dir, 40) and logged(run_dir) == logged(unbroken)
    assert_equal_weights(unbroken, run_dir)
    events = EventAccumulator(str(run_dir / "tensorboard" / "xtrain"))  # the same log dir, each step once
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 41))

    _, err = moving.communicate(timeout=300)
    assert moving.returncode == 0, err
    result = read_result(fewer)
    [restart] = result["restarts"]
    assert result["status"] == "completed" and result["hosts"] == ["n1"] and result["world_size"] == 1
    assert restart["moved"] == {"world": [2, 1], "grad_accum": [1, 2]} and restart["steps_lost"] == 0
    assert restart["reason"].endswith("requeued (restart 1 of at most 10) on 1 node(s): the others cannot run now")
    run_yaml = (fewer / "run.yaml").read_text()
    assert "nodes: 1" in run_yaml and "grad_accum: 2" in run_yaml
    assert run_yaml.startswith("# moved to 1 of the job's 2 node(s) (restart 1): grad_accum 1 -> 2\n")
    assert every_step_once(fewer, 40)
    before, losses = restart["at_step"], {r["step"]: r["train/loss"] for r in read_metrics(fewer) if "train/loss" in r}
    expected = {r["step"]: r["train/loss"] for r in read_metrics(unbroken) if "train/loss" in r}
    assert {s: losses[s] for s in losses if s <= before} == {s: expected[s] for s in expected if s <= before}
    assert losses == pytest.approx(expected, rel=1e-5, abs=0)


def test_scontrol_requeue_without_warning_resumes_from_the_newest_periodic_checkpoint(tmp_path,
                                                                                       two_processes_unbroken):
    run_dir = tmp_path / "run"
    proc = start_xtrain(f"run_dir={run_dir}", *SLURM, *TWO_PROCESSES)
    wait_for_step(run_dir, 12, proc)
    job = job_id(run_dir)
    subprocess.run(["scontrol", "requeue", job], check=True)  # SIGTERM to every process, then SIGKILL
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err

    result = read_result(run_dir)
    [restart] = result["restarts"]
    assert result["status"] == "completed" and restart["slurm_restart_count"] == 1
    # SLURM's SIGTERM reaches every process of the step (proctrack/cgroup): the workers end at once, back to the
    # newest periodic checkpoint, unless the node task's stop request (it takes SIGTERM as one) reached them
    # first and they finished the step with a checkpoint of it
    assert restart["at_step"] >= 10 and result["steps_lost"] == restart["steps_lost"]
    assert restart["at_step"] % 5 == 0 and restart["steps_lost"] >= 2 or restart["steps_lost"] == 0
    assert every_step_once(run_dir, 40) and logged(run_dir) == logged(two_processes_unbroken())
    assert_equal_weights(two_processes_unbroken(), run_dir)


def test_a_run_longer_than_its_time_limit_finishes_across_allocations_in_one_wandb_run(tmp_path):
    """time_limit=1 minute, the warning 10 s before (SLURM checks every ~30 s, so it comes 10-40 s before
    the end): each allocation trains, checkpoints at the warning and requeues, until the run is done. A callback of
    the user's makes each step take 0.5 s (over a minute in all, on almost no CPU); the reference runs without it."""
    home = {"HOME": str(tmp_path / "home")}
    project = tmp_path / "project"
    project.mkdir()
    (project / "pace.py").write_text("import time\n\n\nclass HalfASecondAStep:\n"
                                     "    def on_train_batch_end(self, state, loss):\n        time.sleep(0.5)\n")
    run = ["trainer.max_steps=130", "trainer.warmup_steps=10", "trainer.log_every=5", "trainer.eval_every=65",
           "trainer.save_every=65", "trainer.batch_size=8", "tracker=wandb", *SMALL]
    unbroken, run_dir = tmp_path / "unbroken", tmp_path / "run"
    # the reference, alongside: a one-node job of one process takes one CPU of a node's two
    reference = start_xtrain(f"run_dir={unbroken}", *SLURM, *run, env=home, quiet=True)
    proc = run_xtrain(f"run_dir={run_dir}", "cluster=slurm", "cluster.time_limit=1", "cluster.signal_lead_s=10",
                      "cluster.cpus_per_task=1", *run, "trainer.callbacks=[{_target_: pace.HalfASecondAStep}]",
                      env=home, cwd=project)
    finished(reference)
    assert "#SBATCH --signal=USR2@10" in next((run_dir / "logs").glob("*_submission.sh")).read_text()

    result = read_result(run_dir)
    restarts = result["restarts"]
    assert result["status"] == "completed" and len(restarts) >= 1, proc.stdout
    assert all(r["ended"] == "requeued" and r["steps_lost"] == 0 for r in restarts)
    assert [r["slurm_restart_count"] for r in restarts] == list(range(1, len(restarts) + 1))
    assert sorted(r["at_step"] for r in restarts) == [r["at_step"] for r in restarts]  # each went further
    assert every_step_once(run_dir, 130, log_every=5) and logged(run_dir) == logged(unbroken)
    assert_equal_weights(unbroken, run_dir)
    # one W&B run across the allocations: one id, and its history has every logged step once, in order
    run_id = (run_dir / "wandb_id").read_text().strip()
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == len(restarts) + 1 and all(r.name.endswith(f"-{run_id}") for r in runs)
    steps = [int(row["_step"]) for r in runs for row in wandb_history(next(r.glob("run-*.wandb")))[0]
             if "train/loss" in row]
    assert steps == list(range(5, 131, 5))


def test_past_max_requeues_a_stop_ends_the_run_with_one_line_and_a_usable_checkpoint(tmp_path,
                                                                                      two_processes_unbroken):
    run_dir = tmp_path / "run"
    proc = start_xtrain(f"run_dir={run_dir}", *SLURM, *TWO_PROCESSES, "cluster.max_requeues=0")
    wait_for_step(run_dir, 12, proc)
    job = job_id(run_dir)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    _, err = proc.communicate(timeout=300)
    result = read_result(run_dir)
    step = result["stop"]["step"]
    assert proc.returncode == 128 + 12 and "Traceback" not in err  # 12: SIGUSR2
    assert err.strip().splitlines()[-1] == (
        f"xtrain: stopped by SIGUSR2 at step {step} with a checkpoint; not requeued: the job has been restarted "
        f"0 time(s), cluster.max_requeues=0; continue with run_dir={run_dir} resume=auto")
    assert result["status"] == "interrupted" and sacct_state(job) == "COMPLETED"
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "xtrain_state.json").is_file()

    run_xtrain(f"run_dir={run_dir}", *SLURM, *TWO_PROCESSES, "resume=auto")  # by hand, as the line says
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["restarts"][0]["at_step"] == step
    assert every_step_once(run_dir, 40)
    assert_equal_weights(two_processes_unbroken(), run_dir)


def test_a_requeued_sweep_point_resumes_its_own_point_and_the_summary_shows_it(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = start_xtrain("-m", f"run_dir={sweep_dir}", *SLURM, *LONG, "trainer.lr=1e-3,2e-3",
                   "hydra.launcher.array_parallelism=2")
    while not list(sweep_dir.glob("1_*/slurm.json")):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    first, second = sorted(sweep_dir.glob("[01]_*"))
    wait_for_step(second, 12, proc)
    task = job_id(second)
    subprocess.run(["scancel", "--signal=USR2", task], check=True)  # that array task only
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err

    rows = {r["point"]: r for r in sweep_rows(sweep_dir)}
    assert rows[first.name]["restarts"] == "0" and rows[second.name]["restarts"] == "1"
    assert all(r["status"] == "completed" for r in rows.values())
    header = next(line for line in (sweep_dir / "summary.md").read_text().splitlines() if line.startswith("| point"))
    assert "| restarts |" in header
    [restart] = read_result(second)["restarts"]
    assert restart["slurm_job"] == task and restart["ended"] == "requeued" and restart["steps_lost"] == 0
    assert every_step_once(second, 40) and every_step_once(first, 40)
    assert "restarts" not in read_result(first)
