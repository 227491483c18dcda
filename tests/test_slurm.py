"""cluster=slurm on a real 2-node SLURM cluster (tests/slurm/, nodes n1 and n2 on this machine): single and
2-node jobs, sweeps as job arrays with resume, failures, cancellation, not waiting, and refusals before
anything is queued."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (FAIL_ON_RANK_1, FSDP_ON_CPU, PACED, SHARDED, assert_one_line_error, read_metrics, read_result,
                      run_xtrain, start_xtrain, train_losses, xtrain_in_process)
from corpus import documents, write

pytestmark = pytest.mark.usefixtures("slurm_cluster")

ALL_CPUS = ["cluster=slurm", "cluster.time_limit=10"]  # each node's task asks for all of the node's CPUs
SLURM = [*ALL_CPUS, "cluster.cpus_per_task=1"]  # one of each node's 2 CPUs: two jobs share the test's nodes
TINY = ["trainer.max_steps=6", "trainer.warmup_steps=1", "trainer.log_every=2", "trainer.eval_every=3",
        "trainer.save_every=3", "trainer.batch_size=4"]


RUNS = 600  # seconds a tiny job nobody waited for may take on a loaded machine (its start imports torch)


def job_id(run_dir: Path) -> str:
    return json.loads((run_dir / "slurm.json").read_text())["job_id"]


def sacct_state(job: str, timeout: float = 60) -> str:
    """Accounting's final state of a job (it lags a few seconds behind the job's end, more on a loaded machine). A
    job nobody waited for is still running when this is asked: give it the time the job takes (`timeout=RUNS`)."""
    for _ in range(int(timeout / 0.2)):
        out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job, "-o", "JobID,State"], capture_output=True,
                             text=True).stdout
        states = dict(line.split("|") for line in out.splitlines())
        if job in states and states[job] not in ("PENDING", "RUNNING", "COMPLETING", ""):
            return states[job].split()[0]
        time.sleep(0.2)
    raise AssertionError(f"job {job} did not end: {out}")


def no_job_of(run_dir: Path) -> bool:
    """Nothing was queued for this run dir (its name is the job's comment-free marker: the run dir path)."""
    return not (run_dir / "slurm.json").exists()


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and any(r.get("step", 0) >= step for r in read_metrics(run_dir)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"{run_dir} never reached step {step}")


def test_a_single_node_job_trains_in_the_run_dir_itself(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", *SLURM, *TINY)
    job = job_id(run_dir)
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["steps"] == 6  # run_dir itself, not run_dir/0
    # the command showed the job's states and rank 0's own lines as they came
    assert f"slurm job {job}: RUNNING on n" in proc.stdout and f"slurm job {job}: COMPLETED" in proc.stdout
    assert "step 6 | val loss" in proc.stdout and "submitit" not in proc.stdout
    logs = run_dir / "logs"
    assert (logs / f"{job}_submission.sh").is_file() and "#SBATCH --nodes=1" in (logs / f"{job}_submission.sh").read_text()
    assert "step 6 | val loss" in (logs / f"{job}_0_log.out").read_text()
    assert sacct_state(job) == "COMPLETED"


def test_two_nodes_follow_the_local_two_process_run(tmp_path, ddp_two_processes):
    run_dir = tmp_path / "run"
    two_nodes = [o for o in SHARDED if not o.startswith("cluster.num_processes")]
    run_xtrain(f"run_dir={run_dir}", *ALL_CPUS, "cluster.nodes=2", "cluster.num_processes=1", *two_nodes)
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["world_size"] == 2
    assert result["hosts"] == ["n1", "n2"]  # one rank on each node, rendezvous at the first
    assert result["rendezvous"].startswith("n1:")
    # each node's task has every CPU of its node (cpus_per_task=all), bound to them, its worker threads as many
    cores = f"0-{os.cpu_count() - 1}" if os.cpu_count() > 1 else "0"
    assert result["cpu_threads"] == [os.cpu_count()] * 2 and result["cpu_cores"] == [cores] * 2
    script = next((run_dir / "logs").glob("*_submission.sh")).read_text()
    assert f"#SBATCH --cpus-per-task={os.cpu_count()}" in script and f"--cpus-per-task={os.cpu_count()} " in script
    assert train_losses(run_dir) == pytest.approx(train_losses(ddp_two_processes), rel=1e-4)
    job = job_id(run_dir)
    assert (run_dir / "logs" / f"{job}_1_log.out").exists()  # node 1's task output, beside node 0's


def test_a_two_node_job_prepares_its_data_inside_the_allocation(tmp_path):
    """Not on the submitting machine (which only checks the files): on a node of the job, before torchrun; the
    other node waits on the shared filesystem's lock."""
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    write(tmp_path / "c.jsonl", documents(3_000_000, seed=12))
    proc = run_xtrain(f"run_dir={run_dir}", *SLURM, "cluster.nodes=2", "cluster.num_processes=1", "data=text",
                      f"data.files=[{tmp_path}/c.jsonl]", *TINY, env={"XTRAIN_CACHE_DIR": str(cache)})
    assert read_result(run_dir)["status"] == "completed"
    submitted = proc.stdout.index("submitted SLURM job")
    assert "data: preparing" not in (proc.stdout[:submitted] + proc.stderr)
    job = job_id(run_dir)
    node_lines = [line for i in (0, 1) for line in (run_dir / "logs" / f"{job}_{i}_log.out").read_text().splitlines()
                  if "data: preparing" in line]
    [line] = node_lines
    [meta] = cache.glob("prepared/*/meta.json")
    node = json.loads(meta.read_text())["prepared_on"]
    assert node in ("n1", "n2") and re.search(rf"data: preparing .* on {node} with \d+ process", line)


def sweep_rows(sweep_dir: Path) -> list[dict]:
    import csv

    with open(sweep_dir / "sweep.csv") as f:
        return list(csv.DictReader(f))


def test_a_sweep_is_one_job_array_and_resumes_without_resubmitting_finished_points(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = ["-m", f"run_dir={sweep_dir}", *ALL_CPUS, "cluster.cpus_per_task=2", "hydra.launcher.array_parallelism=2",
            "trainer.batch_size=4,2000", "trainer.grad_accum=1,2", *TINY[:-1]]
    proc = run_xtrain(*args, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("xtrain: error: 2 of 4 points failed")
    assert all("larger than the" in line for line in lines[:2])
    rows = sweep_rows(sweep_dir)
    assert [r["status"] for r in rows] == ["completed", "completed", "failed", "failed"]
    points = [sweep_dir / r["point"] for r in rows]
    jobs = [job_id(p) for p in points]
    array = jobs[0].split("_")[0]
    assert jobs == [f"{array}_{i}" for i in range(4)]  # one array, a task per point
    script = (sweep_dir / "logs" / f"{array}_submission.sh").read_text()
    assert "#SBATCH --array=0-3%2" in script
    assert "| **" in (sweep_dir / "summary.md").read_text()  # the best point marked
    finished = {p: (p / "result.json").stat().st_mtime_ns for p in points[:2]}

    proc = run_xtrain(*args, "resume=auto", check=False)
    assert proc.returncode == 1
    assert "4 points in" in proc.stdout and "2 submitted" in proc.stdout
    assert [job_id(p) for p in points[:2]] == jobs[:2]  # finished points: not resubmitted, not touched
    assert {p: (p / "result.json").stat().st_mtime_ns for p in points[:2]} == finished
    again = [job_id(p) for p in points[2:]]
    assert again[0].split("_")[0] != array and len(set(again)) == 2  # the failed points: a new array


def test_a_failing_rank_fails_the_command_with_its_own_error(tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAIL_ON_RANK_1)
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", *SLURM, "cluster.nodes=2", *TINY, check=False,
                      env={"PYTHONPATH": f"{inject}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()
    assert last[-2] == "xtrain: error: rank 1: RuntimeError: injected failure on rank 1"
    assert last[-1] == f"every rank's output: {run_dir / 'logs'}"
    assert 'raise RuntimeError("injected failure on rank 1")' in proc.stderr  # rank 1's own traceback first
    result = read_result(run_dir)
    assert result["status"] == "failed" and result["slurm_state"] == "FAILED"
    assert sacct_state(job_id(run_dir)) == "FAILED"  # never reported as completed


def test_scancel_from_outside_says_cancelled(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_xtrain(f"run_dir={run_dir}", *SLURM, *PACED, "trainer.max_steps=300", "trainer.log_every=1")
    wait_for_step(run_dir, 2, proc)
    subprocess.run(["scancel", job_id(run_dir)], check=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == (f"xtrain: error: SLURM job {job_id(run_dir)} was cancelled; its checkpoints "
                                            f"stay: continue with run_dir={run_dir} resume=auto")
    assert read_result(run_dir)["status"] == "cancelled"


def test_ctrl_c_while_waiting_cancels_the_job(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_xtrain(f"run_dir={run_dir}", *SLURM, *PACED, "trainer.max_steps=300", "trainer.log_every=1")
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    job = job_id(run_dir)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == (f"xtrain: error: cancelled SLURM job {job} (Ctrl-C); continue it with "
                                            f"run_dir={run_dir} resume=auto")
    assert sacct_state(job) == "CANCELLED"
    assert read_result(run_dir)["status"] == "cancelled"


def test_not_waiting_returns_at_once_and_status_follows_the_job(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", *SLURM, *TINY, "cluster.wait=false")
    job = job_id(run_dir)
    assert f"submitted SLURM job {job}" in proc.stdout and "step 1 |" not in proc.stdout
    first = xtrain_in_process(str(run_dir), command="xtrain.status").stdout
    assert f"slurm            job {job}:" in first
    sacct_state(job, timeout=RUNS)
    last = xtrain_in_process(str(run_dir), command="xtrain.status").stdout
    assert last.splitlines()[0] == f"run {run_dir}: completed, step 6 of 6"
    assert f"slurm            job {job}: COMPLETED" in last and "val_loss" in last


@pytest.mark.parametrize("overrides, expected", [
    (["cluster.partition=big"], "cluster.partition=big: no such partition; this cluster has debug, gpu"),
    (["cluster.nodes=3"], "cluster.nodes=3: partition debug has 2 node(s); use cluster.nodes<=2"),
    (["cluster.partition=gpu", "cluster.gpus_per_node=3"],
     "cluster.gpus_per_node=3: the nodes of partition gpu have 2 GPU(s); use cluster.gpus_per_node<=2"),
    (["cluster.partition=gpu", "cluster.cpus_per_task=64"], "cluster.cpus_per_task=64: the nodes of partition gpu have"),
    (["cluster.partition=gpu", "cluster.num_processes=3"],
     "cluster.num_processes=3: cluster.gpus_per_node=2; use cluster.num_processes<=2 (or auto)"),
    (["cluster.gpus_per_node=1"],
     "cluster.gpus_per_node=1: the nodes of partition debug have 0 GPU(s); use cluster.gpus_per_node<=0"),
    (["cluster.time_limit=1:99"],
     "cluster.time_limit=1:99: not a SLURM time limit; use MM, HH:MM:SS or D-HH:MM:SS, e.g. 04:00:00"),
    (["cluster.mem_gb=100000"], "cluster=slurm: sbatch refused the job: Memory specification can not be "
                                "satisfied; Batch job submission failed: Requested node configuration is not available"),
    (["strategy=fsdp"], "strategy=fsdp: FSDP needs CUDA GPUs and this machine has none"),
])
def test_slurm_bad_input_is_one_line_and_nothing_is_queued(tmp_path, overrides, expected):
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", *SLURM, *TINY, *overrides, check=False)
    assert_one_line_error(proc, expected)
    assert not run_dir.exists()  # nothing half-written: a run dir sbatch refused is removed again


def test_a_refused_submission_leaves_a_run_dir_that_was_there_as_it_was(tmp_path):
    """sbatch refuses the job: what xtrain wrote into the user's empty folder is taken back, the folder stays."""
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    proc = xtrain_in_process(f"run_dir={run_dir}", *SLURM, *TINY, "cluster.mem_gb=100000", check=False)
    assert_one_line_error(proc, "cluster=slurm: sbatch refused the job: Memory specification can not be satisfied")
    assert run_dir.is_dir() and not any(run_dir.iterdir())


def test_no_sbatch_on_path_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", *SLURM, check=False, env={"PATH": str(tmp_path)})
    assert_one_line_error(proc, "cluster=slurm: sbatch is not on PATH; submit from a SLURM login node "
                                "(load its module first), or use cluster=local")
    assert not run_dir.exists()


def test_a_batched_sweep_on_slurm_keeps_its_record_and_calls_hydras_callbacks(tmp_path):
    """Hydra's contract, as on this machine (test_hydra_contract.py): one batch after another, each a job array."""
    from hydra_calls import check_jobs, recorded, recording

    sweep_dir, log = tmp_path / "sweep", tmp_path / "calls.jsonl"
    xtrain_in_process("-m", f"run_dir={sweep_dir}", *SLURM, "hydra/sweeper=basic", "hydra.sweeper.max_batch_size=1",
                      "trainer.seed=${hydra:job.num}", "trainer.lr=0.001,0.002", *TINY, *recording(log))
    names = ["0_lr=0.001", "1_lr=0.002"]
    assert [p["overrides"] for p in json.loads((sweep_dir / "sweep.json").read_text())["points"]] == [
        ["trainer.lr=0.001"], ["trainer.lr=0.002"]]
    check_jobs(recorded(log), sweep_dir, names, seeds=[0, 1])
    for num, name in enumerate(names):
        assert f"seed: {num}\n" in (sweep_dir / name / "run.yaml").read_text()
        assert (sweep_dir / name / "slurm.json").exists()


def test_a_bad_sweep_point_queues_nothing(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = xtrain_in_process("-m", f"run_dir={sweep_dir}", *SLURM, "cluster.nodes=1,3", *TINY, check=False)
    assert_one_line_error(proc, "point 1 (cluster.nodes=3): cluster.nodes=3: partition debug has 2 node(s)")
    assert not sweep_dir.exists()


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", *SLURM, "cluster.nodes=2", "cluster.setup=[module load cuda]",
                      "+cluster.sbatch_args.mail-type=END", "dry_run=true")
    assert "topology     2 node(s) x 1 process(es)" in proc.stdout
    assert "#SBATCH --nodes=2" in proc.stdout and "#SBATCH --ntasks-per-node=1" in proc.stdout
    assert "#SBATCH --mail-type=END" in proc.stdout and "module load cuda" in proc.stdout
    assert "#SBATCH --signal=USR2@120" in proc.stdout and "#SBATCH --requeue" in proc.stdout
    assert "srun --unbuffered" in proc.stdout and "--kill-on-bad-exit=1" in proc.stdout
    assert not run_dir.exists()


def test_container_image_goes_on_the_srun_line(tmp_path):
    """Unexecuted here (no pyxis on the test cluster): the exact srun line every node's task starts with."""
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", *SLURM, "cluster.container_image='nvcr.io#nvidia/pytorch:24.05-py3'",
                             "cluster.container_mounts=/data:/data", "cluster.srun_args=['--cpu-bind=none']",
                             "dry_run=true")
    [srun] = [line for line in proc.stdout.splitlines() if line.startswith("srun ")]
    logs = run_dir / "logs"
    assert srun == (f"srun --unbuffered --output {logs}/%j_%t_log.out --cpus-per-task=1 --kill-on-bad-exit=1 "
                    "'--container-image=nvcr.io#nvidia/pytorch:24.05-py3' --container-mounts=/data:/data "
                    f"--cpu-bind=none python3 -u -m submitit.core._submit {logs}")  # the image's interpreter
    proc = xtrain_in_process(f"run_dir={run_dir}", *SLURM, "cluster.container_image=img",
                             "cluster.container_python=/opt/venv/bin/python", "dry_run=true")
    assert "--container-image=img /opt/venv/bin/python -u -m submitit.core._submit" in proc.stdout


def test_status_of_a_sweep_that_was_not_waited_for(tmp_path):
    sweep_dir = tmp_path / "sweep"
    run_xtrain("-m", f"run_dir={sweep_dir}", *SLURM, "cluster.wait=false", "trainer.seed=1,2", *TINY)
    jobs = [job_id(p) for p in sorted(sweep_dir.glob("[0-9]_*"))]
    for job in jobs:
        sacct_state(job, timeout=RUNS)
    out = xtrain_in_process(str(sweep_dir), command="xtrain.status").stdout
    rows = [line.split() for line in out.splitlines()[1:3]]
    assert [r[:3] for r in rows] == [["0_seed=1", "1", "completed"], ["1_seed=2", "2", "completed"]]
    assert [r[-3:] for r in rows] == [["job", f"{job}:", "COMPLETED"] for job in jobs]
    assert [r["status"] for r in sweep_rows(sweep_dir)] == ["completed", "completed"]  # collected into the summary


def test_the_cluster_leaves_the_machines_own_slurm_config_alone(slurm_cluster):
    """The fixture's config lives under its own directory (SLURM_CONF); /etc/slurm/slurm.conf, the machine's own
    (or a sentinel where there is none), is as it was before the cluster started."""
    assert os.environ["SLURM_CONF"] == str(slurm_cluster.conf) and slurm_cluster.conf.is_file()
    assert "generated by start_slurm.sh" in slurm_cluster.conf.read_text()
    assert Path("/etc/slurm/slurm.conf").read_bytes() == slurm_cluster.machine_conf_before
    assert not Path("/etc/slurm/slurmdbd.conf").exists() or "start_slurm" not in Path("/etc/slurm/slurmdbd.conf").read_text()
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(set(nodes)) == ["n1", "n2", "n3", "n4"]  # the clients reach the cluster through SLURM_CONF alone


def test_hsdp_replicates_across_two_nodes_and_shards_within_each(tmp_path, ddp_two_processes):
    """strategy.dp_replicate=auto on 2 nodes x 2 processes: one replica per node, its 2 shards on that node's ranks
    (the FSDP2 seam on the nodes), the same 16 blocks a step as the local 2-process DDP run (micro-batches of 2 to 4
    data-parallel ranks): its curve."""
    run_dir = tmp_path / "run"
    hsdp = [o for o in SHARDED if not o.startswith(("cluster.num_processes", "trainer.batch_size"))]
    run_xtrain(f"run_dir={run_dir}", *ALL_CPUS, "cluster.nodes=2", "cluster.num_processes=2", "strategy=fsdp",
               "strategy.dp_replicate=auto", "trainer.batch_size=2", *hsdp, env=FSDP_ON_CPU)
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["hosts"] == ["n1", "n1", "n2", "n2"]
    assert result["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}
    assert "strategy:\n  name: fsdp" in (run_dir / "run.yaml").read_text() and \
        "dp_replicate: 2" in (run_dir / "run.yaml").read_text()  # auto, resolved: what trained
    assert train_losses(run_dir) == pytest.approx(train_losses(ddp_two_processes), rel=1e-4)
