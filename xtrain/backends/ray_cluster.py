"""The Ray backend: a run on a Ray cluster's nodes, from a machine of that cluster (its head, or a `ray job submit`'s
entrypoint).

The run dir is validated and written here, as for the other backends, on storage every node sees. Then one
placement group of `cluster.nodes` bundles (STRICT_SPREAD: one a node) holds the nodes, and one Ray task a bundle
runs that node's workers through the local backend (launch/supervisor.py's torchrun, the rendezvous on the first
node's address), as a SLURM job's task does: the loop and the run dir are the same. Whatever ends the run (its end,
a failure, Ctrl-C here), the tasks are cancelled and the placement group removed: nothing is left on the cluster.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

from xtrain.config.point import Point
from xtrain.config.schema import RunConfig
from xtrain.core import machine
from xtrain.core.errors import ConfigError, LaunchFailed
from xtrain.launch import plan, preflight

log = logging.getLogger("xtrain")


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("cluster=ray: the ray package is not installed here; pip install 'ray>=2.40' "
                          "(the version the cluster runs), or use cluster=local or cluster=slurm") from None
    return ray


def bundle(cfg: RunConfig) -> dict[str, float]:
    """What each node's task reserves: its CPUs (one a process, or `cluster.cpus_per_node`) and, where the machines
    have GPUs, one a process."""
    c = cfg.cluster
    reserved = {"CPU": float(c.cpus_per_node or c.processes_per_node)}
    if machine.visible_gpus():
        reserved["GPU"] = float(c.processes_per_node)
    return reserved


def resolve(cfg: RunConfig) -> RunConfig:
    """Nothing beyond `num_processes` (one per GPU of this machine, a node of the cluster)."""
    return cfg


def head_address(cfg: RunConfig) -> str:
    """`cluster.address` as host:port (`auto`: RAY_ADDRESS, else the cluster `ray start` recorded on this machine),
    answering: a one-line ConfigError where nothing does (Ray's own connect retries for minutes)."""
    import os
    import socket
    import tempfile

    address = cfg.cluster.address
    if address.startswith("ray://"):
        raise ConfigError(f"cluster.address={address}: a Ray Client address; run xtrain on a machine of the cluster "
                          "(its head, or through ray job submit) and give its GCS address (host:6379), or auto")
    if address == "auto":
        recorded = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        address = os.environ.get("RAY_ADDRESS") or (recorded.read_text().strip() if recorded.is_file() else "")
        if not address:
            raise ConfigError("cluster.address=auto: this machine belongs to no Ray cluster (no RAY_ADDRESS, nothing "
                              "started with ray start); start one (ray start --head) or give its head's host:port")
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=5):
            pass
    except (OSError, ValueError) as err:
        raise ConfigError(f"cluster.address={cfg.cluster.address}: no Ray cluster answers at {address} ({err}); "
                          "start one (ray start --head) or give its head's host:port") from None
    return address


def connect(cfg: RunConfig) -> None:
    """This process joined to the cluster at `cluster.address`, or a one-line ConfigError."""
    ray = _ray()
    if ray.is_initialized():
        return
    address = head_address(cfg)
    try:
        ray.init(address=address, logging_level=logging.ERROR, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(f"cluster.address={cfg.cluster.address}: no Ray cluster answers there ({reason}); start one "
                          "(ray start --head) or give its head's host:port") from None


def check(cfg: RunConfig) -> None:
    """The cluster has `cluster.nodes` live nodes that each hold one node's bundle. (Ray places the nodes: the
    rendezvous settings of cluster=local are not the user's to give.)"""
    c = cfg.cluster
    for key, default in (("node_rank", 0), ("main_process_ip", "127.0.0.1"), ("main_process_port", None)):
        if getattr(c, key) != default:
            raise ConfigError(f"cluster.{key}={getattr(c, key)}: Ray places the nodes and their rendezvous under "
                              f"cluster=ray; leave cluster.{key} unset")
    ray = _ray()
    connect(cfg)
    need = bundle(cfg)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fit = [n for n in nodes if all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items())]
    if len(fit) < cfg.cluster.nodes:
        what = ", ".join(f"{k} {v:g}" for k, v in need.items())
        raise ConfigError(f"cluster.nodes={cfg.cluster.nodes}: the Ray cluster at {cfg.cluster.address} has "
                          f"{len(fit)} of its {len(nodes)} live node(s) with {what} for a node's task; use "
                          f"cluster.nodes={max(1, len(fit))}, fewer processes a node, or a larger cluster")


def describe(cfg: RunConfig, script: bool = True) -> str:
    """A dry run: every check the real run makes (the cluster's nodes included), the plan, the placement group."""
    check(cfg)
    preflight.check_free(cfg)
    preflight.preflight(cfg, planning=True)
    from xtrain.launch import hardware

    request = (f"ray: a placement group of {cfg.cluster.nodes} bundle(s) of "
               f"{ {k: v for k, v in bundle(cfg).items()} } (STRICT_SPREAD: one a node) at {cfg.cluster.address}")
    return "\n".join([plan.render(plan.for_this_machine(cfg, hardware.refusal(cfg))), request])


def run(cfg: RunConfig) -> dict:
    """`python -m xtrain cluster=ray ...`: check, write the run dir, run one task a node, return the run's result."""
    from xtrain.backends import local
    from xtrain.core import runlock

    if cfg.dry_run:
        print(describe(cfg))
        return {"dry_run": True}
    check(cfg)
    with runlock.holding(cfg.run_dir, take=True):  # (released before the first node's task takes it)
        prepared = preflight.preflight(cfg)
        local.prepare_data(cfg, prepared.task)
        path = preflight.write_run_dir(prepared)
    return run_job(cfg, path)


def run_job(cfg: RunConfig, path: Path) -> dict:
    """The written run dir trained by one task a node; the first node's result. A node's failure is the run's
    (LaunchFailed, or its ConfigError), as on the other backends."""
    ray = _ray()
    from ray.exceptions import RayTaskError, TaskCancelledError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    nodes, need = cfg.cluster.nodes, bundle(cfg)
    group = placement_group([need] * nodes, strategy="STRICT_SPREAD")
    tasks = []
    try:
        ready, _ = ray.wait([group.ready()], timeout=cfg.cluster.timeout_s)
        if not ready:
            raise LaunchFailed(f"the Ray cluster gave no {nodes} node(s) with {need} within cluster.timeout_s="
                               f"{cfg.cluster.timeout_s} s (its nodes are busy, or went away)", 1)
        on = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(nodes)]
        address, port = ray.get(_rendezvous.options(scheduling_strategy=on[0], num_cpus=0).remote())
        log.info("ray: %d node(s) placed; rendezvous %s:%d", nodes, address, port)
        resources = {"num_cpus": need["CPU"], "num_gpus": need.get("GPU", 0)}
        tasks = [_node.options(scheduling_strategy=on[i], **resources).remote(str(path), i, address, port)
                 for i in range(nodes)]
        results = ray.get(tasks)
        return results[0]
    except RayTaskError as err:
        cause = err.cause if isinstance(err.cause, BaseException) else None
        if cause is not None and not isinstance(cause, TaskCancelledError):
            raise cause from None
        raise LaunchFailed(f"a node's task failed: {' '.join(str(err).split())[:300]}", 1) from None
    finally:
        _, unfinished = ray.wait(tasks, num_returns=len(tasks), timeout=0) if tasks else ([], [])
        for task in unfinished:  # (a failure on one node, or Ctrl-C here: the others stopped too)
            ray.cancel(task, force=True)
        remove_placement_group(group)


def _remote(function):
    """`function` as a Ray task (made as the module is used: Ray is imported only by runs on it)."""
    holder: dict = {}

    class Lazy:
        def options(self, **options):
            if "task" not in holder:
                holder["task"] = _ray().remote(max_retries=0)(function)
            return holder["task"].options(**options)

    return Lazy()


def _free_rendezvous() -> tuple[str, int]:
    """On the first node: its address, and a port free there for torchrun's rendezvous."""
    import ray

    from xtrain.launch.supervisor import free_port

    return ray.util.get_node_ip_address(), free_port()


def _train_node(run_dir: str, node_rank: int, address: str, port: int) -> dict:
    """One node's task: its workers train the written run dir (the first node records how the run ended)."""
    from xtrain.backends import local
    from xtrain.config import schema
    from xtrain.core import rundir
    from xtrain.launch.worker import configure_logging

    configure_logging()
    path = Path(run_dir)
    cfg = schema.load(str(path / rundir.RUN_CONFIG))
    cfg = replace(cfg, cluster=replace(cfg.cluster, node_rank=node_rank, main_process_ip=address,
                                       main_process_port=port))
    return (local.run_recorded if node_rank == 0 else local.run_here)(cfg, path)


_rendezvous, _node = _remote(_free_rendezvous), _remote(_train_node)


# ---------------------------------------------------------------- a sweep's points: not on Ray yet


def scripts(points: list[Point], sweep_dir: Path, **options) -> list[str]:
    return []


def check_points(points: list[Point], **options) -> None:
    raise ConfigError("cluster=ray: a -m sweep's points do not run on Ray yet; sweep with cluster=local or "
                      "cluster=slurm, or run each point as its own cluster=ray run")


def run_points(points, sweep_dir: Path, on_end: Callable[[Point], None], **options) -> bool:
    check_points(points)
    return False
