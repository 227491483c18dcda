"""Several processes from one run config: real DDP on CPU (gloo), failures that stop everything, no orphans."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import (FAIL_ON_RANK_1, REPO, read_result, run_xtrain, seams, start_xtrain, train_losses)

RUN = ["trainer.max_steps=8", "trainer.log_every=2", "trainer.eval_every=4", "trainer.save_every=4",
       "trainer.warmup_steps=2"]


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Live processes whose command line names this run dir (driver, torchrun, its forked workers)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_dir) in part for part in p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def one_process_batch_16(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("single") / "run"
    run_xtrain(f"run_dir={run_dir}", "trainer.batch_size=16", *RUN)
    return run_dir


def test_two_processes_follow_one_process_with_twice_the_batch(tmp_path, one_process_batch_16):
    """2 processes x batch 8 == 1 process x batch 16 (fp32, same seed): same loss curve, halves of the same data."""
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", "cluster.num_processes=2", "trainer.batch_size=8", *RUN)
    result, single = read_result(run_dir), read_result(one_process_batch_16)
    assert result["world_size"] == 2 and "2 processes (DDP)" in proc.stdout and result["backend"] == "gloo"  # real DDP, not 2 lone trainings
    assert "2 x" not in proc.stdout.split("launching")[0]
    assert train_losses(run_dir) == pytest.approx(train_losses(one_process_batch_16), rel=1e-4)
    assert result["val_loss"] == pytest.approx(single["val_loss"], rel=1e-4)
    rank0, rank1 = result["first_batch_sums"]
    assert rank0 != rank1  # each rank got its own shard ...
    assert rank0 + rank1 == single["first_batch_sums"][0]  # ... and together they are the 16-sequence batch
    assert "1 CPU threads each" in proc.stdout  # 2 cores split between 2 workers


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="what a CPU run exports")
def test_exported_accelerate_config_is_the_cpu_run_it_came_from(ddp_two_processes):
    """Accelerate's own `accelerate test` on the run's file: a CPU run, never ranks that each train alone.
    (Plain `accelerate launch` starts several CPU processes only through mpirun; without it, one.)"""
    import yaml

    config_file = ddp_two_processes / "accelerate_config.yaml"
    exported = yaml.safe_load(config_file.read_text())
    assert (exported["distributed_type"], exported["use_cpu"], exported["num_processes"]) == ("MULTI_CPU", True, 2)
    bin_dir = Path(sys.executable).parent  # `accelerate test` starts `accelerate-launch` from PATH
    proc = subprocess.run([str(bin_dir / "accelerate"), "test", "--config_file", str(config_file)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode == 0 and "Test is a success" in proc.stdout, proc.stdout + proc.stderr
    states = [line for line in proc.stdout.splitlines() if "Distributed environment:" in line]
    assert len(states) == 1 and "Device: cpu" in proc.stdout  # one CPU process, not two lone ones


@pytest.mark.parametrize("first", [0, 1])
def test_two_nodes_on_one_machine_whichever_starts_first(tmp_path, started, one_process_batch_16, first):
    """cluster.nodes=2: node 0 writes the run dir and hands node 1 this launch's token at main_process_ip:port
    (no clocks): node 1 waits for it if it came first, and takes it if node 0 is there already."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    common = [f"run_dir={run_dir}", "cluster.nodes=2", "cluster.num_processes=1", "cluster.main_process_ip=127.0.0.1",
              f"cluster.main_process_port={port}", "trainer.batch_size=8", *RUN]
    if first == 1:
        node1 = started(*common, "cluster.node_rank=1")
        time.sleep(3)
        node0 = started(*common, "cluster.node_rank=0")
    else:
        run_dir.mkdir()  # an earlier launch that stopped before its first step: its run.yaml and token
        shutil.copy(one_process_batch_16 / "run.yaml", run_dir / "run.yaml")
        (run_dir / "launch.json").write_text('{"token": "an earlier launch"}')
        node0 = started(*common, "cluster.node_rank=0")
        deadline = time.time() + 120
        while "an earlier launch" in (run_dir / "launch.json").read_text():  # node 0 has written this launch's
            assert time.time() < deadline and node0.poll() is None
            time.sleep(0.2)
        time.sleep(2)
        node1 = started(*common, "cluster.node_rank=1")
    for node in (node0, node1):
        out, err = node.communicate(timeout=300)
        assert node.returncode == 0, err
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["world_size"] == 2
    assert train_losses(run_dir) == pytest.approx(train_losses(one_process_batch_16), rel=1e-4)
    assert (run_dir / "logs" / "launcher-node0.log").exists() and (run_dir / "logs" / "launcher-node1.log").exists()


def test_a_failing_rank_stops_every_worker_and_is_reported_first(tmp_path):
    """Rank 1 raises (fault injected by a sitecustomize on the test side): all workers stop within seconds."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAIL_ON_RANK_1)
    run_dir = tmp_path / "run"
    began = time.monotonic()
    proc = run_xtrain(f"run_dir={run_dir}", "cluster.num_processes=2", "trainer.batch_size=8", *RUN, check=False,
                      env={"PYTHONPATH": f"{inject}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()
    assert last[-2] == "xtrain: error: rank 1 failed: RuntimeError: injected failure on rank 1"
    assert last[-1].startswith("all 2 workers stopped; every rank's output:")
    assert 'raise RuntimeError("injected failure on rank 1")' in proc.stderr  # rank 1's own traceback
    assert "ChildFailedError" not in proc.stderr and "torch.distributed.elastic" not in proc.stderr
    assert "ChildFailedError" in (run_dir / "logs" / "launcher-node0.log").read_text()  # kept, out of the way
    result = read_result(run_dir)
    assert result["status"] == "failed" and result["error"].startswith("rank 1: RuntimeError: injected failure")
    assert time.monotonic() - began < 120
    assert processes_of(run_dir) == []


HANG_AT_EXIT_ON_RANK_1 = '''
import os, time
exit_as_shipped = os._exit


def exit_or_hang(code):  # a rank's (a fork's) last call, once training is over
    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    exit_as_shipped(code)


os._exit = exit_or_hang
'''


@pytest.mark.parametrize("ending", ["completed", "stopped"])
def test_a_rank_that_hangs_after_the_run_ended_is_stopped_and_the_run_keeps_its_end(tmp_path, ending):
    """Rank 1 never exits after training (injected): the driver stops the tree a minute after the run recorded
    its end, instead of waiting on it for ever. The end: all steps, or a stop at a step boundary (SIGUSR1, as
    SLURM's warning signal: a rank of a 2-node job hung so at its requeue, and its other node waited 5 min).
    The wait is 60 s; here 3 s (XTRAIN_TEST_LINGER_S), the same behaviour sooner."""
    linger = 3
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(HANG_AT_EXIT_ON_RANK_1)
    run_dir = tmp_path / "run"
    began = time.monotonic()
    driver = start_xtrain(f"run_dir={run_dir}", "cluster.num_processes=2", "trainer.batch_size=8", *RUN,
                          env={"PYTHONPATH": f"{inject}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                               **seams("timings"), "XTRAIN_TEST_LINGER_S": str(linger)})
    try:
        if ending == "stopped":
            while not ((run_dir / "metrics.jsonl").exists() and len(train_losses(run_dir)) >= 1):
                assert driver.poll() is None, driver.communicate()
                time.sleep(0.2)
            driver.send_signal(signal.SIGUSR1)
        out, err = driver.communicate(timeout=linger + 240)
    finally:
        if driver.poll() is None:
            driver.kill()
    result = read_result(run_dir)
    if ending == "completed":
        assert driver.returncode == 0, err
        assert result["status"] == "completed" and (run_dir / "model" / "model.safetensors").exists()
    else:
        assert driver.returncode == 128 + signal.SIGUSR1, err
        assert result["status"] == "interrupted" and result["stop"]["step"] < 8
        assert (run_dir / "checkpoints" / f"step_{result['stop']['step']:08d}").is_dir()
    assert time.monotonic() - began < linger + 120
    assert "its processes are still there: stopped them" in (run_dir / "logs" / "launcher-node0.log").read_text()
    assert processes_of(run_dir) == []


def test_a_resumed_run_is_not_taken_for_ended_by_its_last_attempts_result():
    """A resumed run's result.json shows its last attempt's end until the new attempt writes its own."""
    from xtrain.launch.supervisor import recorded_its_end

    stopped = {"status": "interrupted", "stop": {"step": 6}, "steps": 6}
    assert not recorded_its_end(stopped, before=stopped)
    assert not recorded_its_end({"status": "running"}, before=stopped)
    assert recorded_its_end({"status": "interrupted", "stop": {"step": 12}, "steps": 12}, before=stopped)
    assert recorded_its_end({"status": "completed", "steps": 16}, before=stopped)
    assert recorded_its_end({"status": "pruned", "stop": {"step": 8}}, before={})
    assert not recorded_its_end({"status": "interrupted", "error": "stopped by SIGINT"}, before={})
    assert not recorded_its_end({"status": "failed"}, before={})


@pytest.fixture
def started():
    """Start drivers; any still running when the test ends (a failed assertion) are stopped with their tree."""
    drivers: list[subprocess.Popen] = []

    def launch(*overrides: str, env: dict | None = None) -> subprocess.Popen:
        drivers.append(start_xtrain(*overrides, env=env))
        return drivers[-1]

    yield launch
    for driver in drivers:
        if driver.poll() is None:
            tree = [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(recursive=True)]
            for p in tree:
                p.kill()
            psutil.wait_procs(tree, timeout=10)


@pytest.mark.parametrize("sig,times", [(signal.SIGINT, 2), (signal.SIGTERM, 1)])
def test_signal_to_the_driver_stops_every_worker(tmp_path, started, sig, times):
    """A second Ctrl-C stops every worker at once; a SIGTERM (as a first Ctrl-C) at the step boundary."""
    run_dir = tmp_path / "run"
    driver = started(f"run_dir={run_dir}", "cluster.num_processes=2", "trainer.batch_size=8",
                     "trainer.max_steps=100000", "trainer.log_every=1")
    deadline = time.monotonic() + 120
    while not ((run_dir / "metrics.jsonl").exists() and len(train_losses(run_dir)) >= 2):
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    agent_and_forks = [p for p in processes_of(run_dir) if "xtrain.launch.agent" in p.cmdline()]
    workers = [p for p in agent_and_forks if p.ppid() in {a.pid for a in agent_and_forks}]  # the agent's forks
    assert len(workers) == 2
    for _ in range(times):
        driver.send_signal(sig)
        time.sleep(0.1)  # (two signals at once are one)
    out, err = driver.communicate(timeout=180)  # a step, a checkpoint and the exit, on 2 cores that a SLURM stream shares
    assert driver.returncode == 128 + sig
    if times == 2:  # at once
        assert "stopped by SIGINT; all workers ended" in err
    else:  # at the step boundary, with a checkpoint (tests/test_stop.py)
        assert "stopped by SIGTERM at step" in err and "resume=auto" in err
    psutil.wait_procs(workers, timeout=5)
    assert processes_of(run_dir) == []
    assert read_result(run_dir)["status"] == "interrupted"


def test_torchruns_port_is_drawn_below_the_kernels_ephemeral_range():
    """Not a port the kernel may meanwhile give the local end of an outgoing connection: a run's torchrun once
    failed to listen (EADDRINUSE) on the port the kernel had just called free, taken by another run's gloo."""
    from xtrain.launch.supervisor import ephemeral_ports, free_port

    low, _ = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports) and len(ports) > 1


def test_a_rank_imports_neither_deepspeed_nor_datasets_for_accelerates_type_checks():
    """Accelerate tests a model against DeepSpeed's engine and a multi-process run's dataset against `datasets`'
    IterableDataset, importing each to do so (0.2 s and 0.45 s of every rank's start-up); nothing is one before
    its library is imported."""
    code = (
        "import sys, torch\n"
        "import xtrain.engine.accelerator\n"
        "from accelerate.data_loader import prepare_data_loader\n"
        "from accelerate.utils import extract_model_from_parallel\n"
        "loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)\n"
        "assert len(prepare_data_loader(loader, num_processes=2, process_index=1, put_on_device=False)) == 2\n"
        "extract_model_from_parallel(torch.nn.Linear(2, 2))\n"
        "print('IMPORTED', [m for m in ('deepspeed', 'datasets') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "IMPORTED []" in out


def test_two_runs_at_once_on_one_machine_do_not_collide_and_spawned_ranks_train_as_forked_ones(tmp_path, started):
    """Each local launch picks a free rendezvous port. The second run's ranks start as on a GPU build of torch, each
    a fresh interpreter (the spawn start method, through its test seam), and train exactly as the forked ones."""
    runs = [tmp_path / "a", tmp_path / "b"]
    drivers = [started(f"run_dir={run}", "cluster.num_processes=2", "trainer.batch_size=8", "trainer.max_steps=6",
                       "trainer.log_every=3", "trainer.eval_every=6", "trainer.save_every=6",
                       env={**seams("timings"), "XTRAIN_TEST_SPAWN_RANKS": "1"} if run.name == "b" else None) for run in runs]
    for driver in drivers:
        _, err = driver.communicate(timeout=300)
        assert driver.returncode == 0, err
    results = [read_result(run) for run in runs]
    assert all(r["status"] == "completed" and r["world_size"] == 2 for r in results)
    assert results[0]["rendezvous"] != results[1]["rendezvous"]
    started_as = [(run / "logs" / "launcher-node0.log").read_text() for run in runs]
    assert "2 rank(s) of xtrain.launch.worker, forked" in started_as[0]
    assert "2 rank(s) of xtrain.launch.worker, each a fresh interpreter (spawn)" in started_as[1]
    assert train_losses(runs[1]) == train_losses(runs[0]) and results[1]["val_loss"] == results[0]["val_loss"]


STUCK_ON_RANK_0 = '''
import os
import time
import xtrain.tasks.causal_lm.task

build_as_shipped = xtrain.tasks.causal_lm.task.CausalLM.build


def build(self, accelerator):
    if os.environ.get("RANK") == "0":
        time.sleep(3600)  # as a rank reading from a filesystem that stopped answering
    return build_as_shipped(self, accelerator)


xtrain.tasks.causal_lm.task.CausalLM.build = build
'''


def test_a_rank_stuck_outside_collectives_is_ended_by_the_timeout(tmp_path):
    """Rank 0 blocks building its model and data (fault injected by a sitecustomize); rank 1 waits in a
    collective until cluster.timeout_s, then the run ends with a message that says so."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(STUCK_ON_RANK_0)
    run_dir = tmp_path / "run"
    began = time.monotonic()
    proc = run_xtrain(f"run_dir={run_dir}", "cluster.num_processes=2", "cluster.timeout_s=10", "trainer.batch_size=2",
                      check=False, timeout=240,
                      env={"PYTHONPATH": f"{inject}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 1
    assert "rank 1 failed: a collective timed out after 10 s (cluster.timeout_s): another rank is stuck or has died" \
        in proc.stderr
    assert time.monotonic() - began < 120
    assert processes_of(run_dir) == []


def test_a_drivers_agents_are_forks_of_one_server_each_as_popen_would_start_it(tmp_path, monkeypatch):
    """Two launches from one driver: both agents are children of the same server (its imports done once), each with
    its own launch's command line, working directory and environment, its output through its pipes, and its end as
    Popen gives it: a rank's exit code, or -signal. XTRAIN_AGENT_FORKSERVER=0: the agent is started anew."""
    from xtrain.launch import forkserver
    from xtrain.launch.supervisor import Topology, free_port, torchrun_command

    env = {**os.environ, "XTRAIN_PROBE": "set by the launch", "PYTHONUNBUFFERED": "1"}
    agents = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        args = torchrun_command(Topology(1, 0, 1, "127.0.0.1", None), tmp_path / name, free_port(),
                                ["tests.agent_probe", name, str(tmp_path / name / "go")])
        agents[name] = forkserver.popen(args, {**env, "XTRAIN_LAUNCH_TIME": str(time.time())}, "ending")
    a, b = agents["a"], agents["b"]
    server = psutil.Process(a.pid).parent()
    assert server.pid == psutil.Process(b.pid).ppid() != os.getpid()
    assert server.ppid() == os.getpid() and " ".join(server.cmdline()).startswith("xtrain.launch.forkserver:")
    for name, agent in agents.items():
        line = " ".join(psutil.Process(agent.pid).cmdline()).strip()
        assert line.startswith(f"{sys.executable} -m xtrain.launch.agent --nnodes=1") and line.endswith(
            f"tests.agent_probe {name} {tmp_path / name / 'go'}")
    (tmp_path / "a" / "go").write_text("3")
    out, err = a.stdout.read().decode(), a.stderr.read().decode()
    assert a.wait(timeout=60) == 1  # (torchrun's own code for a failed rank)
    assert f"probe a in {REPO} with set by the launch" in out + err and "exitcode  : 3" in out + err
    assert b.poll() is None
    b.kill()
    assert b.wait(timeout=60) == -signal.SIGKILL
    monkeypatch.setenv("XTRAIN_AGENT_FORKSERVER", "0")
    anew = forkserver.popen(args, env, "ending")
    assert isinstance(anew, subprocess.Popen) and psutil.Process(anew.pid).ppid() == os.getpid()
    anew.kill()
    anew.communicate(timeout=60)
