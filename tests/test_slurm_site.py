"""cluster=slurm against what a real site has, on the test cluster (tests/slurm/): CPUs bound to each task, a `gpu`
partition whose nodes declare GPUs CUDA cannot see, submission from inside an allocation, a controller that goes
away mid-job and at submission, and files nobody else may replace."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (PACED, REPO, assert_equal_weights, assert_one_line_error, finished, read_result, run_xtrain,
                      start_xtrain, xtrain_in_process)
from test_slurm import ALL_CPUS, SLURM, TINY, job_id, sacct_state, wait_for_step

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def writable_by_others(root: Path) -> list[str]:
    return [str(p) for p in [root, *root.rglob("*")] if not p.is_symlink() and p.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)]


def test_a_gpu_partition_job_asks_for_every_gpu_and_a_node_cuda_cannot_see_them_on_refuses(tmp_path):
    """gpus_per_node=auto: the partition's 2 GPUs per node, so num_processes=auto is 2; the node's own check finds no
    CUDA device behind the GPUs SLURM gave the job and says so in one line. Under umask 002 nothing written is
    group-writable: the run dir, its logs, submitit's pickles."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "xtrain", f"run_dir={run_dir}", *ALL_CPUS, "cluster.partition=gpu", *TINY],
                          capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(0o002))
    assert proc.returncode == 1, proc.stderr
    node = "n3" if "GPUs on n3" in proc.stderr else "n4"
    assert (f"xtrain: error: cluster.gpus_per_node=2: the job was given GPUs on {node} (CUDA_VISIBLE_DEVICES=0,1), and "
            "CUDA sees 0 of them there; check the node's driver and the job's GPU binding, or ask for none "
            "(cluster.gpus_per_node=0: train on the nodes' CPUs)") in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    run_yaml = (run_dir / "run.yaml").read_text()
    assert "gpus_per_node: '2'" in run_yaml and "num_processes: '2'" in run_yaml
    assert "slurm request: 1 node(s) of partition gpu, each one task of 2 CPUs and 2 GPU(s), running 2 worker" in proc.stdout
    assert "#SBATCH --gpus-per-node=2" in next((run_dir / "logs").glob("*_submission.sh")).read_text()
    result = read_result(run_dir)
    assert result["status"] == "failed" and "cluster.gpus_per_node=2" in result["error"]
    assert list((run_dir / "logs").glob("*.pkl")) and writable_by_others(run_dir) == []


def test_no_gpu_on_a_gpu_partition_only_when_asked_and_the_plan_says_on_cpus(tmp_path):
    proc = xtrain_in_process(f"run_dir={tmp_path / 'run'}", *SLURM, "cluster.partition=gpu", "cluster.gpus_per_node=0",
                             "dry_run=true")
    assert "slurm request: 1 node(s) of partition gpu, each one task of 1 CPUs and no GPU: on CPUs" in proc.stdout
    assert "--gpus-per-node" not in proc.stdout
    # checked against the resolved count: FSDP is accepted on the GPU partition, refused on the CPU one
    assert "topology" in xtrain_in_process(f"run_dir={tmp_path / 'r2'}", *SLURM, "cluster.partition=gpu", "strategy=fsdp",
                                           "dry_run=true").stdout
    refused = xtrain_in_process(f"run_dir={tmp_path / 'r3'}", *SLURM, "strategy=fsdp", "dry_run=true", check=False)
    assert_one_line_error(refused, "strategy=fsdp: FSDP needs CUDA GPUs")


def test_submitting_from_inside_an_allocation_is_as_from_a_login_node(tmp_path):
    """A batch job (1 CPU of n1) runs `python -m xtrain cluster=slurm`: the new job asks for the partition's CPUs,
    not the 1 of the job it was submitted from, runs as a job of its own, and the batch job follows it to its end."""
    run_dir, out = tmp_path / "run", tmp_path / "outer.out"
    command = f"{sys.executable} -m xtrain run_dir={run_dir} {' '.join(ALL_CPUS)} {' '.join(TINY)}"
    submitted = subprocess.run(["sbatch", "--parsable", "-w", "n1", "-c", "1", f"--output={out}", f"--chdir={REPO}",
                                "--wrap", command], capture_output=True, text=True, check=True)
    outer = submitted.stdout.strip().split(";")[0]
    assert sacct_state(outer, timeout=300) == "COMPLETED", out.read_text()
    inner = job_id(run_dir)
    result = read_result(run_dir)
    assert inner != outer and result["status"] == "completed"
    assert result["hosts"] == ["n2"] and result["cpu_threads"] == [os.cpu_count()]  # n1 had 1 CPU left: not enough
    assert f"cpus_per_task: '{os.cpu_count()}'" in (run_dir / "run.yaml").read_text()
    assert f"slurm job {inner}: COMPLETED" in out.read_text()


def test_the_controller_going_away_mid_job_leaves_it_followed_to_its_end(tmp_path, slurm_cluster):
    """slurmctld stopped while a job trains, and kept away until the job's run has ended and 10 s more (its end
    reported to a controller that does not answer): the command waits (one line says SLURM does not answer),
    xtrain.status says unknown, a new submission is refused in one line; the job is followed to COMPLETED once the
    controller is back, bitwise as unbroken."""
    args = [*SLURM, "trainer.max_steps=40", "trainer.log_every=2", "trainer.eval_every=20", "trainer.save_every=20",
            "trainer.batch_size=8", *PACED]
    unbroken, run_dir, refused = tmp_path / "unbroken", tmp_path / "run", tmp_path / "refused"
    # the reference, alongside: the same run here on one CPU thread, as the job's
    reference = start_xtrain(f"run_dir={unbroken}", *[a for a in args if not a.startswith("cluster")],
                             "cluster.num_processes=1", env={"OMP_NUM_THREADS": "1"}, quiet=True)
    proc = start_xtrain(f"run_dir={run_dir}", *args)
    wait_for_step(run_dir, 2, proc)
    slurm_cluster.stop("slurmctld")
    try:
        status = xtrain_in_process(str(run_dir), check=False, command="xtrain.status")
        assert status.returncode == 0 and f"job {job_id(run_dir)}: unknown: SLURM does not answer" in status.stdout
        late = run_xtrain(f"run_dir={refused}", *SLURM, *TINY, check=False)
        assert_one_line_error(late, "cluster=slurm: `sinfo -h` failed")
        assert not refused.exists()
        deadline = time.time() + 300
        while read_result(run_dir)["status"] != "completed":  # the run ends while SLURM is away
            assert time.time() < deadline and read_result(run_dir)["status"] == "running", read_result(run_dir)
            time.sleep(0.5)
        time.sleep(10)
        assert proc.poll() is None  # still following
    finally:
        slurm_cluster.start("slurmctld")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert out.count("SLURM does not answer") == 0 and out.count("the job's state is unknown, still following it") == 1
    assert "slurm: answering again" in out and f"slurm job {job_id(run_dir)}: COMPLETED" in out
    assert read_result(run_dir)["status"] == "completed"
    finished(reference)
    assert_equal_weights(unbroken, run_dir)


def test_a_lost_node_requeues_the_job_which_resumes_from_its_newest_checkpoint_bitwise(tmp_path, slurm_cluster):
    """n2 is lost mid-job: its slurmd and every process on it freeze (no answer, no connection reset), so the rank on
    n1 waits in its collective; SLURM marks n2 DOWN (SlurmdTimeout=30) and requeues the job, killing what ran on n1.
    Once n2 is back (its frozen processes gone, as after a reboot) the job resumes from its newest checkpoint and
    ends bitwise equal to the unbroken run, its result.json counting the restart and the steps lost."""
    args = [*SLURM, "cluster.nodes=2", "cluster.num_processes=1", "trainer.max_steps=60", "trainer.log_every=1",
            "trainer.eval_every=30", "trainer.save_every=10", "trainer.batch_size=4", *PACED]
    unbroken, run_dir = tmp_path / "unbroken", tmp_path / "run"
    # the reference, alongside, here (a job would be lost with n2): 2 processes of one CPU thread each, as the job's
    reference = start_xtrain(f"run_dir={unbroken}", *[a for a in args if not a.startswith("cluster")],
                             "cluster.num_processes=2", quiet=True)
    proc = start_xtrain(f"run_dir={run_dir}", *args)
    wait_for_step(run_dir, 24, proc, timeout=300)
    job = job_id(run_dir)
    slurm_cluster.stop("slurmd-n2", lose_node=True)
    try:
        deadline = time.time() + 180
        while "down" not in subprocess.run(["sinfo", "-h", "-N", "-n", "n2", "-o", "%T"], capture_output=True,
                                           text=True).stdout:
            assert time.time() < deadline, "n2 was never marked DOWN"
            time.sleep(1)
        while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                             text=True).stdout.strip() in ("RUNNING", "COMPLETING"):
            assert time.time() < deadline, "the job on the lost node was never requeued"
            time.sleep(1)
    finally:
        slurm_cluster.start("slurmd-n2")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["steps"] == 60
    # the first restart: the lost node's (its attempt ended `running`: killed by SLURM, nothing recorded). SLURM
    # 22.05 here may then send the requeued incarnation's task on the returned node a SIGTERM meant for the lost
    # one (~10-30 s after it starts); xtrain takes it as a stop at a step boundary and requeues: nothing more is lost.
    lost, *later = result["restarts"]
    assert lost["at_step"] in (20, 30) and lost["slurm_restart_count"] == 1 and lost["ended"] == "running"
    assert lost["steps_lost"] >= 24 - lost["at_step"] and all(r["steps_lost"] == 0 for r in later)
    assert result["steps_lost"] == lost["steps_lost"]
    assert "resumed from" in out, out[-3000:]
    # the stray SIGTERM may also reach the last incarnation's task after its run completed: SLURM then says FAILED
    assert f"slurm job {job_id(run_dir)}: COMPLETED" in out or (
        result["slurm_state"] == "FAILED" and "its run had completed (result.json) before SLURM ended it FAILED" in out
    ), out[-3000:]
    finished(reference)
    assert_equal_weights(unbroken, run_dir)
