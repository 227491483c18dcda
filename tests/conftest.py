"""Shared fixtures: every test runs the real CLI, offline, with a fresh cache per session."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

import tiers
from xtrain.backends.registry import resolve_auto
from xtrain.config import schema
from xtrain.config.schema import RunConfig

# The suite's xdist workers share the machine's cores, so its training processes are often more threads than
# cores. libgomp's threads then spin at every barrier while the thread they wait for is off the CPU: two 2-thread
# runs at once on 2 cores each trained at 1/12 of their speed alone (measured: 1,280 vs 15,068 tokens/s); waiting
# passively, each at about half. And a single-process run takes one thread, a worker's share: on a 2-core
# machine with the other core busy, a 60-step run of the default model took 19.4 s of CPU on one thread against 21.1
# on two, and less time too (19.4 vs 21.2 s). (Multi-process runs split the cores as users' do: xtrain sets each
# worker's threads.) Set before torch loads (none of the imports above loads it), for this process and every
# process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles a process's kernels in a pool of worker processes (one per core), each of which imports torch:
# 5 s of CPU more for each process that compiles, in no less time, where the workers already fill the cores
# (measured: a 20-step compiled run on a cold cache, 41.6 s of CPU with the pool against 36.5 s without, both 36 s).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SEAMS = Path(__file__).resolve().parent / "seams"


def seams(*names: str) -> dict[str, str]:
    """The environment that installs the named seams (tests/seams/<name>.py) in a run and every process it starts."""
    return {"XTRAIN_SEAMS": ",".join(str(SEAMS / f"{name}.py") for name in names)}


ZERO_ON_CPU, FSDP_ON_CPU, FP16_ON_CPU, FP8_ON_CPU = (seams(f"{kind}_on_cpu") for kind in ("zero", "fsdp", "fp16", "fp8"))

# A short run of the default model and data: a few seconds on a 2-core CPU.
SHORT = ["trainer.max_steps=12", "trainer.warmup_steps=2", "trainer.log_every=4", "trainer.eval_every=6",
         "trainer.save_every=6"]


# The runs a test stops, kills or requeues mid-run, where what the model learns is not the point: the default model
# at a quarter of its width with one layer (a tenth of its CPU a step); PACED: each step also lasts 0.25 s or more,
# asleep (tests/pacing.py, imported from the repository), so that a signal sent at one step lands long before the last.
SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=128", "model.num_heads=2"]
PACED = [*SMALL, "trainer.callbacks=[{_target_: tests.pacing.Pace, seconds: 0.25}]"]

# Two processes with gradient accumulation: the run every sharded strategy is compared with DDP on.
SHARDED = ["cluster.num_processes=2", "trainer.batch_size=4", "trainer.grad_accum=2", "trainer.max_steps=20",
           "trainer.warmup_steps=4", "trainer.log_every=2", "trainer.eval_every=10", "trainer.save_every=10"]


# Where the suite was started in the background of a non-interactive shell, SIGINT is ignored, and an ignored
# signal stays ignored in every process started from here: the Ctrl-C tests' commands would never see theirs.
# A terminal's foreground command, what they stand for, always can.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The longest test files by their measured time on a 2-core CPU, the longest first (the rest follow in collection
# order). Order only decides balance: a free worker takes the next file in line.
LONGEST_FIRST = ("test_tune.py", "test_ray.py", "test_fsdp_on_cpu.py", "test_zero_on_cpu.py", "test_finetune.py", "test_launch.py",
                 "test_sweep.py", "test_data.py", "test_compile.py", "test_pipeline.py", "test_mesh.py", "test_custom_task.py",
                 "test_fp8_on_cpu.py", "test_own_loop.py", "test_resume.py", "test_train.py", "test_seq_cls.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Under `pytest -n 3 --dist loadgroup --no-loadscope-reorder` (make test): the SLURM tests are one unit of work
    (one worker starts the test cluster, once), every other test file one unit (its module fixtures built once),
    the SLURM unit first and then the longest files. The SLURM tests spend much of their time waiting on the
    scheduler, so a third worker on 2 cores fills time the CPU would idle."""
    def unit(item) -> str:
        return "slurm" if "slurm_cluster" in item.fixturenames else item.path.name

    def rank(item) -> int:
        name = unit(item)
        return -1 if name == "slurm" else LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    for item in items:
        item.add_marker(pytest.mark.xdist_group(unit(item)))
        item.add_marker(getattr(pytest.mark, tiers.tier(item)))
    items.sort(key=rank)


@pytest.fixture(autouse=True)
def tier_kept(request, monkeypatch):
    """A unit or component test that starts a process fails: tests/tiers.py gave it the wrong tier."""
    if request.node.get_closest_marker("e2e"):
        yield
        return
    started = []
    as_shipped = subprocess.Popen.__init__

    def recorded(self, args, *rest, **kwargs):
        started.append(args)
        as_shipped(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", recorded)
    yield
    assert not started, (f"{request.node.name} starts a process ({started[0]}), and tests/tiers.py makes it a "
                         "unit or component test: add what starts it to tiers.E2E")


@pytest.fixture(scope="session", autouse=True)
def isolated_env(tmp_path_factory):
    """No hub access, no stray Accelerate/W&B settings, one tokenizer/data cache for the session."""
    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_", "WANDB_", "HYDRA_")):
            del os.environ[key]
    # Inductor's compiled kernels: one cache for the session's workers, cold at its start (a run's first compile is
    # what a fresh machine pays, and test_compile measures it), never the one a previous session left in /tmp
    session = tmp_path_factory.getbasetemp()
    session = session.parent if os.environ.get("PYTEST_XDIST_WORKER") else session
    os.environ.update(
        TORCHINDUCTOR_CACHE_DIR=str(session / "inductor"),
        XTRAIN_CACHE_DIR=str(tmp_path_factory.mktemp("cache")),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_SILENT="true",
    )
    yield


# What a process reads as it starts (an injected sitecustomize, torch's thread count and logs, W&B's home): a run
# given any of these gets a process of its own.
AT_START = ("PYTHONPATH", "OMP_NUM_THREADS", "TORCH_LOGS", "HOME")


def run_xtrain(*overrides: str, check: bool = True, timeout: float = 600, env: dict | None = None,
               own_process: bool = False, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m xtrain ...`: the real CLI in this process (`xtrain_in_process`: no new interpreter's ~4 s of
    imports), or in a process of its own where the test is about that process (`own_process`: its exact output) or
    needs it (an `env` of AT_START)."""
    if not own_process and not set(env or {}) & set(AT_START):
        return xtrain_in_process(*overrides, check=check, env=env, cwd=cwd)
    proc = subprocess.run(
        [sys.executable, "-m", "xtrain", *overrides],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"xtrain {' '.join(overrides)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def xtrain_in_process(*overrides: str, check: bool = True, env: dict | None = None, cwd: Path = REPO,
                      command: str = "xtrain") -> subprocess.CompletedProcess:
    """`python -m xtrain ...` (or another `command`: `xtrain.eval`, `xtrain.status`, ...) run by this process (the
    real command's `main`, from the repository as a subprocess's working directory), as a process started now: exit
    code, stdout and stderr as a subprocess's (an exception that would end the process is its traceback and exit code
    1). Afterwards this process is as it was: its environment, Hydra, Accelerate's state, SLURM's partitions (read
    once per process)."""
    import importlib
    import io
    import traceback

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton

    from xtrain.commands import cli

    main = cli.main if command == "xtrain" else importlib.import_module(command).main
    argv, saved_env, hydra_state, was_in = sys.argv, dict(os.environ), Singleton.get_state(), os.getcwd()
    modules_before = set(sys.modules)
    sys.argv = [command, *overrides]
    os.environ.update({"XTRAIN_LAUNCH_TIME": str(time.time()), **(env or {})})  # its time to first step: its own
    os.chdir(cwd)
    _forget_slurm_partitions()  # read by this process's own tests too (compose_run)
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit:
                raise
            except BaseException:  # what the interpreter would print before exiting 1
                traceback.print_exc()
                code = 1
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv = argv
        os.chdir(was_in)
        os.environ.clear()
        os.environ.update(saved_env)
        GlobalHydra.instance().clear()
        Singleton.set_state(hydra_state)  # Hydra as it was: this process runs other Hydra apps too
        _forget_the_run()
        _forget_modules_of(Path(cwd), set(sys.modules) - modules_before)
    if check and code != 0:
        raise AssertionError(f"{command} {' '.join(overrides)} exited {code}:\n{out.getvalue()}\n{err.getvalue()}")
    return subprocess.CompletedProcess([command, *overrides], code, out.getvalue(), err.getvalue())


def _forget_the_run() -> None:
    """What a run leaves in its process that a later one in the same process must not see."""
    if "accelerate" in sys.modules:  # (a refused run may never have loaded it)
        from xtrain.backends.local import release_memory

        release_memory()
    _forget_slurm_partitions()


def _forget_modules_of(project: Path, imported: set[str]) -> None:
    """A user project's modules the run imported (two projects may both have a `mydata`): a process of its own
    would not have kept them."""
    if project.resolve() == REPO:
        return
    for name in imported:
        where = getattr(sys.modules.get(name), "__file__", None) or ""
        if where.startswith(str(project.resolve())):
            del sys.modules[name]


def _forget_slurm_partitions() -> None:
    """SLURM's partitions are read once per process: a run must ask the cluster as it is now."""
    if "xtrain.backends.slurm.submit" in sys.modules:
        sys.modules["xtrain.backends.slurm.submit"].partitions.cache_clear()


def example_project(tmp_path_factory, name: str, extra: dict[str, str]) -> Path:
    """examples/<name> copied outside the package (its modules import only from there), with more modules of the
    test's own (`extra`: file name -> source)."""
    where = tmp_path_factory.mktemp("project") / name
    shutil.copytree(REPO / "examples" / name, where, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    for file, source in extra.items():
        (where / file).write_text(source)
    return where


def start_xtrain(*overrides: str, env: dict | None = None, quiet: bool = False, cwd: Path = REPO) -> subprocess.Popen:
    """`python -m xtrain` in the background: its output in pipes (text), or dropped (`quiet`)."""
    out = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen([sys.executable, "-m", "xtrain", *overrides], cwd=cwd, stdout=out, stderr=out, text=True,
                            env={**os.environ, **(env or {})})


def finished(proc: subprocess.Popen, timeout: float = 600) -> None:
    """Wait for a run started with `start_xtrain` (a reference run alongside the one under test); it succeeded."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{out}\n{err}"


def model_weights(run_dir: Path) -> dict:
    """The final model's tensors (model/model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(run_dir / "model" / "model.safetensors")


def assert_equal_weights(a: Path, b: Path) -> None:
    """The two runs' final models are bitwise equal."""
    import torch

    expected, got = model_weights(a), model_weights(b)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), (a, b, name)


def logged(run_dir: Path) -> list[tuple]:
    """Every logged row as (step, train loss, val loss)."""
    return [(r["step"], r.get("train/loss"), r.get("val/loss")) for r in read_metrics(run_dir)]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def shared_run(tmp_path_factory, name: str, *overrides: str) -> Path:
    """A run that tests only read, made once per session for every xdist worker: the first to ask makes it under
    a lock, the others wait for it there and read the same run dir."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "shared" / name
    shared.mkdir(parents=True, exist_ok=True)
    run_dir, done = shared / "run", shared / "done"
    with open(shared / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            if run_dir.exists():  # another worker's attempt failed (its test says why): try once more
                shutil.rmtree(run_dir)
            run_xtrain(f"run_dir={run_dir}", *overrides)
            done.touch()
    return run_dir


@pytest.fixture(scope="session")
def short_run(tmp_path_factory) -> Path:
    """One short default-config run shared by the tests that only read its outputs."""
    return shared_run(tmp_path_factory, "short", *SHORT)


def train_losses(run_dir: Path) -> list[float]:
    return [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]


@pytest.fixture(scope="session")
def ddp_two_processes(tmp_path_factory) -> Path:
    """The DDP reference for the sharded strategies (`SHARDED`)."""
    return shared_run(tmp_path_factory, "ddp", "strategy=ddp", *SHARDED)


def compose_run(*overrides: str, resolve: bool = True) -> RunConfig:
    """The typed config as the launcher sees it (num_processes=auto resolved for this machine, unless not `resolve`)."""
    from hydra import compose, initialize_config_module

    from xtrain.commands import cli

    cli.register_schemas()
    with initialize_config_module(config_module="xtrain.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["run_dir=/tmp/unused", *overrides])
    return resolve_auto(schema.from_container(cfg)) if resolve else schema.from_container(cfg)


def refusal(*overrides: str) -> str:
    """The line `python -m xtrain` refuses `overrides` with (after `xtrain: error: `), found in this process by its
    checks alone: Hydra's composition, the typed config and its resolution, then preflight, which writes nothing."""
    from xtrain.commands import cli
    from xtrain.core.errors import ConfigError
    from xtrain.launch import preflight

    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    argv, sys.argv = sys.argv, ["xtrain", *overrides]  # (a refusal quotes the override as the user typed it)
    try:
        preflight.preflight(compose_run(*overrides))
    except (ConfigError, HydraException, OmegaConfBaseException, yaml.YAMLError) as err:
        return cli.refusal_line(err)
    finally:
        sys.argv = argv
    raise AssertionError(f"{' '.join(overrides)}: not refused")


def assert_one_line_error(proc, *expected: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# Injected faults are decided when they are called: the ranks are forks of a process (the launcher's agent) that
# ran this sitecustomize before any rank existed.
FAIL_ON_RANK_1 = '''
import os
import xtrain.engine.evaluation

evaluate_as_shipped = xtrain.engine.evaluation.evaluate


def evaluate(*args, **kwargs):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("injected failure on rank 1")
    return evaluate_as_shipped(*args, **kwargs)


xtrain.engine.evaluation.evaluate = evaluate
'''


def kill_after_checkpoint(proc: subprocess.Popen, checkpoint_dir: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (checkpoint_dir / "xtrain_state.json").exists():
        assert proc.poll() is None, "run ended before it could be killed"
        assert time.monotonic() < deadline, "checkpoint never appeared"
        time.sleep(0.05)
    time.sleep(0.5)  # let it train a few steps past the checkpoint: they must not count
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def wandb_records(path: Path):
    """Records of a W&B transaction log (.wandb: LevelDB log format, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(log: Path) -> tuple[list[dict], dict]:
    """An offline W&B run's logged rows and config, from its .wandb file."""
    history, config = [], {}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return history, config


SLURM_SCRIPTS = REPO / "tests" / "slurm"
SLURM_BASE = Path("/tmp/xtrain-slurm-test")
MACHINE_SLURM_CONF = Path("/etc/slurm/slurm.conf")


@dataclass
class SlurmCluster:
    conf: Path  # the cluster's own slurm.conf (SLURM_CONF for every client)
    machine_conf_before: bytes  # /etc/slurm/slurm.conf as it was before the cluster started
    frozen: dict[str, list] = field(default_factory=dict)  # a lost node's processes, until it starts again

    def _pid_file(self, name: str) -> Path:
        return SLURM_BASE / "pids" / f"{name}.pid"

    def stop(self, name: str, lose_node: bool = False) -> None:
        """Stop one daemon: `slurmctld` as an operator would (SIGTERM, its state saved), or (`lose_node`) a node's
        `slurmd-nX` with everything running on that node frozen (SIGSTOP), as a node lost from the network looks
        to the others: no answer and no connection reset, its peers' collectives waiting. `start` ends them."""
        pid = int(self._pid_file(name).read_text())
        if lose_node:  # the node's processes: those in its UTS namespace (start_slurm.sh gives each node its own)
            namespace = os.readlink(f"/proc/{pid}/ns/uts")
            for proc in psutil.process_iter():
                with contextlib.suppress(OSError, psutil.Error):
                    if os.readlink(f"/proc/{proc.pid}/ns/uts") == namespace:
                        proc.suspend()
                        self.frozen.setdefault(name, []).append(proc)
            return
        os.kill(pid, signal.SIGTERM)
        psutil.wait_procs([psutil.Process(pid)], timeout=30) if psutil.pid_exists(pid) else None

    def start(self, name: str) -> None:
        """Start a daemon `stop` stopped, as start_slurm.sh does (slurmctld recovers its saved state); a lost
        node's frozen processes are killed first, as a node that reboots loses them."""
        lost = self.frozen.pop(name, [])
        for proc in lost:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(lost, timeout=30)
        if name == "slurmctld":
            argv = ["/usr/sbin/slurmctld", "-D"]
        else:
            node = name.split("-")[1]
            argv = ["unshare", "--uts", "sh", "-c", f"hostname {node} && exec /usr/sbin/slurmd -D -N {node}"]
        with open(SLURM_BASE / "log" / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
        self._pid_file(name).write_text(f"{proc.pid}\n")
        if name == "slurmctld":
            deadline = time.time() + 60
            while subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
                assert time.time() < deadline, "slurmctld did not come back"
                time.sleep(0.5)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real 2-node SLURM cluster on this machine (tests/slurm/start_slurm.sh: munge, slurmdbd, slurmctld,
    slurmd n1 and n2), its config under its own directory, stopped after the session with every daemon it
    started. The machine's own /etc/slurm/slurm.conf is left as it was: where there is none, a sentinel
    stands there while the cluster runs, so that a test can tell that nothing wrote it."""
    if os.geteuid() != 0:
        pytest.skip("the SLURM tests start a cluster's daemons (munge, slurmctld, slurmd), which needs root")
    conf = SLURM_BASE / "etc" / "slurm.conf"
    env = {**os.environ, "SLURM_BASE": str(SLURM_BASE), "SLURM_CONF": str(conf)}
    sentinel = not MACHINE_SLURM_CONF.exists()
    if sentinel:
        MACHINE_SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        MACHINE_SLURM_CONF.write_text("# sentinel of xtrain's tests: no SLURM cluster of this machine's own\n")
    before = MACHINE_SLURM_CONF.read_bytes()
    try:
        proc = subprocess.run(["bash", str(SLURM_SCRIPTS / "start_slurm.sh")], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            pytest.fail(f"the test SLURM cluster did not start:\n{proc.stderr[-3000:]}")
        os.environ.update(SLURM_BASE=str(SLURM_BASE), SLURM_CONF=str(conf))
        yield SlurmCluster(conf, before)
    finally:
        subprocess.run(["bash", str(SLURM_SCRIPTS / "stop_slurm.sh")], capture_output=True, text=True, env=env)
        for key in ("SLURM_BASE", "SLURM_CONF"):
            os.environ.pop(key, None)
        if sentinel and MACHINE_SLURM_CONF.read_bytes() == before:
            MACHINE_SLURM_CONF.unlink()
