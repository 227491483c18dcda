"""From a validated RunConfig to a written run dir: preflight checks, then `run.yaml` and its exports.

Every backend (backends/local.py, backends/slurm.py), the sweep and the CLI come through here: the
driver checks everything it can before anything starts, creates the run dir and writes `run.yaml`
(plus the equivalent `accelerate_config.yaml` / `deepspeed.json`); workers only ever read the run dir.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
import uuid
from pathlib import Path

import yaml

from xtrain.config import schema
from xtrain.config.cluster import ClusterConfig, ClusterKind
from xtrain.config.schema import RunConfig
from xtrain.config.task import check_monitor
from xtrain.core import owned, rundir, runlock
from xtrain.core.errors import ConfigError
from xtrain.core.files import write_atomic
from xtrain.parallel import fp8, plugins, strategies, zero
from xtrain.engine import callbacks, checkpoint, goodput, optim, resume
from xtrain.launch import hardware, plan
from xtrain.launch.prepared import Prepared
from xtrain.tasks.facts import model_facts
from xtrain.tasks.registry import task_for

log = logging.getLogger("xtrain")

ACCELERATE_CONFIG = "accelerate_config.yaml"
DEEPSPEED_CONFIG = zero.CONFIG_FILE


def preflight(cfg: RunConfig, planning: bool = False) -> Prepared:
    """Checks of the machine and the world outside the config (files, models, checkpoints); what they found (the
    task, the model's facts, the checkpoint to resume from), for the backend to write the run dir from.
    What only a cluster can tell (partitions, nodes) its backend checks (`check`) before this. `planning` (a dry
    run): what this machine's hardware cannot run is for the plan to say, not a refusal; every other check holds."""
    if not planning or hardware.submitting_to_slurm(cfg.cluster):  # (a SLURM request's GPUs are the plan's, not this machine's)
        hardware.check(cfg)
    c = cfg.cluster
    if not planning and launch_refusal(cfg):
        raise ConfigError(launch_refusal(cfg))
    gpus = hardware.node_gpus(cfg)
    if gpus and c.processes_per_node > gpus:
        where = f"cluster.gpus_per_node={gpus}" if hardware.submitting_to_slurm(cfg.cluster) else f"this node has {gpus} GPU(s)"
        raise ConfigError(
            f"cluster.num_processes={c.num_processes}: {where}; use cluster.num_processes<={gpus} (or auto)"
        )
    strategies.of(cfg).check_machine(cfg)
    task = task_for(cfg)
    arrays = task.check()  # (the metrics first: the monitor names one of what they compute)
    check_monitor(cfg.trainer, cfg.task, task.directions(), arrays)
    callbacks.check(cfg, dry_run=cfg.dry_run)
    optim.check(cfg)
    n_params, facts = model_facts(cfg, task)  # checks strategy.wrap_layer against the model
    strategies.of(cfg).check(cfg, facts)
    if fp8.with_torchao(cfg):
        fp8.check(cfg.precision, facts.fp8_layers, facts.model_class)
    if not planning:  # (a dry run's plan shows what does not fit)
        plan.check_fits(cfg)
        plan.check_memory(cfg)
        if hardware.slow_precision(cfg):
            log.warning("speed: %s", hardware.slow_precision(cfg))
    resume_from = checkpoint.resolve(cfg.resume, cfg.run_dir, checkpoint.identity(cfg, task), cfg)
    state = None
    if resume_from is not None:
        state = checkpoint.read_state(resume_from)
        max_steps = cfg.trainer.max_steps  # (None: max_epochs, which the run works out)
        finishing = max_steps is not None and checkpoint.export_unfinished(cfg.run_dir, resume_from, max_steps)
        if max_steps is not None and state["step"] >= max_steps and not finishing:
            raise ConfigError(
                f"resume={cfg.resume}: {resume_from} has already trained {state['step']} steps; "
                f"trainer.max_steps={cfg.trainer.max_steps} leaves nothing to do: raise trainer.max_steps "
                "(with resume_changes=apply)"
            )
        resume.applicable_changes(cfg.resume_changes, state.get("config"), schema.to_container(cfg), f"resume={cfg.resume}: {resume_from}")
    elif cfg.resume == "auto":
        log.info("resume=auto: %s holds no checkpoint; starting fresh", cfg.run_dir)
    check_failure_rate(cfg, resume_from)
    return Prepared(cfg, task, n_params, facts, resume_from, None if state is None else state["step"])


def check_failure_rate(cfg: RunConfig, resume_from: Path | None) -> None:
    """`trainer.save_every=auto` plans for a failure rate: `cluster.mtbf_hours`, or the failures the run dir's own
    restarts show."""
    if cfg.trainer.save_every != "auto" or cfg.cluster.mtbf_hours is not None:
        return
    own = resume_from is not None and resume_from.parent == rundir.checkpoints_dir(cfg.run_dir)
    if goodput.observed_mtbf_s(rundir.read_result(Path(cfg.run_dir)) if own else {}) is None:
        raise ConfigError("trainer.save_every=auto: needs the failure rate it plans for; set cluster.mtbf_hours (the "
                          "mean hours between failures that end a run on these nodes, e.g. cluster.mtbf_hours=24), "
                          "or a number of steps")


def launch_refusal(cfg: RunConfig) -> str | None:
    """What a launch of several local nodes lacks (a dry run's plan says it; a run is refused)."""
    c = cfg.cluster
    if c.kind is ClusterKind.local and c.nodes > 1 and c.main_process_port is None:
        return (f"cluster.main_process_port is empty: cluster.nodes={c.nodes} needs the same port on every node, "
                "e.g. cluster.main_process_port=29500")
    return None


def export_accelerate_files(cfg: RunConfig, facts: plugins.ModelFacts, path: Path) -> None:
    """The same run for plain `accelerate launch --config_file <run dir>/accelerate_config.yaml`."""
    files = {}
    for name, text in strategies.of(cfg).launch_files(cfg, facts).items():
        write_atomic(path / name, text)
        files[name] = str(path / name)
    exported = plugins.accelerate_config(cfg, facts, files, cuda=hardware.node_gpus(cfg) > 0)
    write_atomic(path / ACCELERATE_CONFIG, yaml.safe_dump(exported))


LAUNCH_FILE = "launch.json"  # node 0's token for this launch (cluster=local with several nodes)
TOKEN_KEY = "xtrain/launch"


def _store(cluster: ClusterConfig, serve: bool):
    """The rendezvous port's TCP store, for the launch handshake only (torchrun takes the port after it)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    c = cluster
    return TCPStore(c.main_process_ip, c.main_process_port, None, serve, timedelta(seconds=c.timeout_s),
                    wait_for_workers=False)


def announce(cfg: RunConfig, path: Path) -> None:
    """Node 0, its run dir written: a fresh token in it and on the rendezvous port, until every node has it."""
    token = uuid.uuid4().hex
    write_atomic(path / LAUNCH_FILE, json.dumps({"token": token, "nodes": cfg.cluster.nodes}) + "\n")
    store = _store(cfg.cluster, serve=True)
    store.set(TOKEN_KEY, token)
    deadline = time.time() + cfg.cluster.timeout_s
    while store.add(f"{TOKEN_KEY}/acks", 0) < cfg.cluster.nodes - 1:
        if time.time() > deadline:
            raise ConfigError(
                f"cluster.nodes={cfg.cluster.nodes}: only {store.add(f'{TOKEN_KEY}/acks', 0) + 1} node(s) came to "
                f"{cfg.cluster.main_process_ip}:{cfg.cluster.main_process_port} within cluster.timeout_s="
                f"{cfg.cluster.timeout_s}; start every node with the same cluster.main_process_ip/port"
            )
        time.sleep(0.1)


def wait_for_run_dir(cfg: RunConfig) -> Path:
    """Nodes other than 0 use the run dir node 0 writes for this launch (a shared filesystem): they learn its
    token at the rendezvous port, whichever node started first, and read run.yaml once the token is there."""
    try:
        store = _store(cfg.cluster, serve=False)
        token = store.get(TOKEN_KEY).decode()
    except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError is a RuntimeError
        raise ConfigError(
            f"cluster.node_rank={cfg.cluster.node_rank}: node 0 did not answer at {cfg.cluster.main_process_ip}:"
            f"{cfg.cluster.main_process_port} within cluster.timeout_s={cfg.cluster.timeout_s} "
            f"({type(err).__name__}); start node 0 with the same cluster.main_process_ip/port"
        ) from None
    path = Path(cfg.run_dir)
    deadline = time.time() + 60  # a shared filesystem may show node 0's files a little later
    while _token_in(path) != token:
        if time.time() > deadline:
            raise ConfigError(
                f"run_dir={cfg.run_dir}: node 0's run dir for this launch is not there (its {LAUNCH_FILE} holds another "
                "token, or none); give every node the same run_dir, on a filesystem they share"
            )
        time.sleep(0.2)
    store.add(f"{TOKEN_KEY}/acks", 1)
    return path


def _token_in(path: Path) -> str | None:
    try:
        return json.loads((path / LAUNCH_FILE).read_text())["token"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def write_or_wait(prepared: Prepared) -> Path:
    """After `preflight`: the run dir with run.yaml (node 0), or node 0's run dir once written (other nodes)."""
    cfg = prepared.cfg
    if cfg.cluster.node_rank > 0:
        return wait_for_run_dir(cfg)
    path = write_run_dir(prepared)
    if cfg.cluster.nodes > 1 and cfg.cluster.kind is ClusterKind.local:
        announce(cfg, path)
    return path


@contextlib.contextmanager
def taken_back_if_refused(path: Path):
    """What a launch writes into the run dir `path` is taken back if it is refused (a ConfigError) before anything
    ran (before its trainer recorded a start in result.json): the entries it added removed, the files it rewrote
    (run.yaml, the accelerate files) restored, and `path` itself removed where it was not there. Nothing else is
    touched: a run dir may hold files of the user's."""
    existed = path.is_dir()
    before = {p.name for p in path.iterdir()} if existed else set()
    kept = {name: (path / name).read_bytes() for name in (rundir.RUN_CONFIG, rundir.PREPARED, ACCELERATE_CONFIG,
                                                            DEEPSPEED_CONFIG)
            if (path / name).is_file()}
    recorded = rundir.result_bytes(path)
    try:
        yield
    except ConfigError:
        if rundir.result_bytes(path) != recorded:  # it started: what it wrote stays
            raise
        for entry in (path.iterdir() if path.is_dir() else []):
            if entry.name not in before:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        for name, content in kept.items():
            write_atomic(path / name, content)
        if not existed and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        raise


def check_free(cfg: RunConfig) -> None:
    """Refuse to start over a run that is there already (unless resuming), or into a run dir that another process
    trains into now; or into a folder that is not empty and holds no run, or whose model/ or checkpoints/ hold files
    xtrain did not write (core/owned.py)."""
    runlock.check_free(cfg.run_dir)
    owned.check_run_dir(cfg.run_dir)
    if cfg.resume == "none" and rundir.holds_run(Path(cfg.run_dir)):
        raise ConfigError(
            f"run_dir={cfg.run_dir}: already holds a run; continue it with resume=auto, or choose a new run_dir"
        )


def create_run_dir(cfg: RunConfig, resume_from: Path | None = None) -> Path:
    """Create the run dir and write run.yaml; refuse to start over a run that is there already. A run dir resumed on
    another world or strategy (from its checkpoint `resume_from`) keeps run.yaml's history of such moves, one
    comment line more."""
    check_free(cfg)
    path = Path(cfg.run_dir)
    path.mkdir(parents=True, exist_ok=True)
    history = moves(cfg, path, resume_from)
    write_atomic(path / rundir.RUN_CONFIG, "".join(f"{line}\n" for line in history) + schema.to_yaml(cfg))
    return path


def moves(cfg: RunConfig, path: Path, resume_from: Path | None) -> list[str]:
    """run.yaml's history lines: the earlier ones, and this resume's where its checkpoint moves."""
    from xtrain.engine import reshard

    history = rundir.moves_recorded(path)
    if resume_from is not None:
        state = checkpoint.read_state(resume_from)
        found = reshard.moved(resume_from, state, cfg)
        line = f"{rundir.MOVED} at step {state['step']}: {reshard.moved_text(found)}"
        if found and history[-1:] != [line]:
            history.append(line)
    return history


def write_run_dir(prepared: Prepared) -> Path:
    """The run dir with run.yaml, the record of what the launch found (prepared.json) and the equivalent accelerate
    files (after `preflight`)."""
    cfg = prepared.cfg
    path = create_run_dir(cfg, prepared.checkpoint)
    prepared.write(path)
    export_accelerate_files(cfg, prepared.facts, path)
    return path
