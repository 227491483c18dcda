"""A Ray run's job (cluster=ray): what places it on the cluster and follows it, attempt by attempt.

Each attempt is one placement group of `cluster.nodes` bundles (STRICT_SPREAD: one a node) and one task a bundle
running that node's workers through the local backend (torchrun's rendezvous on the first node), as a SLURM job's
task does. A lost node ends the attempt; the run restarts from its newest checkpoint on the live nodes (down to
`cluster.min_nodes`, grad_accum keeping the effective batch), at most `cluster.max_restarts` times, recorded in
result.json as on SLURM. Whatever ends an attempt, its tasks are cancelled and its group removed. Ray pickles the
task functions by reference: `xtrain.backends.ray_job._train_node` is part of every placed run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from xtrain.backends import elastic
from xtrain.config import schema
from xtrain.config.schema import RunConfig
from xtrain.core import machine, rundir
from xtrain.core.errors import ConfigError, LaunchFailed, one_line

log = logging.getLogger("xtrain")


def ray_package():
    """The ray package, or a one-line ConfigError where it is not installed."""
    try:
        import ray
    except ImportError:
        raise ConfigError("cluster=ray: the ray package is not installed here; pip install 'ray>=2.40' "
                          "(the version the cluster runs), or use cluster=local or cluster=slurm") from None
    return ray


def bundle(cfg: RunConfig) -> dict[str, float]:
    """What each node's task reserves: its CPUs (one a process, or `cluster.cpus_per_node`), its GPUs
    (`cluster.gpus_per_node`; by default one a process where this machine has GPUs) and `cluster.resources`."""
    c = cfg.cluster
    reserved = {"CPU": float(c.cpus_per_node or c.processes_per_node)}
    gpus = int(c.gpus_per_node) if c.gpus_per_node != "auto" else c.processes_per_node if machine.visible_gpus() else 0
    if gpus:
        reserved["GPU"] = float(gpus)
    return {**reserved, **{name: float(amount) for name, amount in c.resources.items()}}


def fitting_nodes(cfg: RunConfig) -> list[dict]:
    """The cluster's live nodes that can hold one node's task."""
    need = bundle(cfg)
    return [n for n in ray_package().nodes() if n.get("Alive")
            and all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items())]


def hand_over(path: Path) -> dict:
    """cluster.wait=false: the written run dir handed to a detached actor on the cluster, which runs `run_job` there
    (its placement, its restarts) and then exits; this returns once the actor is alive."""
    ray = ray_package()
    actor = ray.remote(_DetachedRun).options(name=f"xtrain:{path}", lifetime="detached", num_cpus=0,
                                              max_restarts=0).remote()
    ray.get(actor.ready.remote())
    actor.run.remote(str(path))
    log.info("ray: the run goes on on the cluster (cluster.wait=false); see it with: python -m xtrain.status %s", path)
    return {"status": "handed over"}


class _DetachedRun:
    """cluster.wait=false: the driver's part of a run (`run_job`), in an actor that outlives the command."""

    def ready(self) -> bool:
        return True

    def run(self, run_dir: str) -> None:
        from xtrain.launch.worker import configure_logging

        configure_logging()
        path = Path(run_dir)
        try:
            run_job(schema.load(str(path / rundir.RUN_CONFIG)), path)
        except Exception as err:  # (recorded in result.json)
            log.info("%s", one_line(err))
        finally:
            ray_package().actor.exit_actor()


class NodeLost(Exception):
    """An attempt ended because a node of its placement group was lost (its task died with it): `node_ids`, the
    lost nodes' (Ray may still count them alive for a few seconds)."""

    def __init__(self, message: str, node_ids: set[str]):
        super().__init__(message)
        self.node_ids = node_ids


def run_job(cfg: RunConfig, path: Path, cancel=None) -> dict:
    """The written run dir trained by one task a node; the first node's result. A node's failure is the run's
    (LaunchFailed, or its ConfigError), as on the other backends. A lost node ends the attempt; the run restarts from
    its newest checkpoint on the live nodes (down to `cluster.min_nodes`), at most `cluster.max_restarts` times.
    `cancel` (a threading.Event; a sweep's point): set, the run is cancelled as by Ctrl-C."""
    import uuid

    written = schema.load(str(path / rundir.RUN_CONFIG))
    run_id, restarts, lost_ids = uuid.uuid4().hex[:12], 0, set()
    while True:
        attempt = _on_live_nodes(written, path, restarts, lost_ids)
        try:
            return _attempt(attempt, path, run_id, restarts, cancel)
        except NodeLost as lost:
            restarts, lost_ids = _restart_or_end(written, path, str(lost), restarts), lost_ids | lost.node_ids
        except KeyboardInterrupt as err:  # (Ctrl-C here; a rank that saw its peers cancelled first may say `failed`)
            rundir.update_result(path, {"status": rundir.Status.interrupted.value,
                                        "error": str(err) or "stopped at once by Ctrl-C"},
                                 only_if=lambda now: now.get("status") in ("running", "failed"))
            raise
        except BaseException as err:  # (the tasks were cancelled before they could record it)
            interrupted = getattr(err, "exit_code", 1) >= 128
            rundir.record_end(path, rundir.Status.interrupted if interrupted else rundir.Status.failed,
                              one_line(err), started_only=True)
            raise


def _restart_or_end(cfg: RunConfig, path: Path, lost: str, restarts: int) -> int:
    """After a lost node: the restart's number, recorded in result.json; or the run's end, where it has had
    `cluster.max_restarts`."""
    limit = cfg.cluster.max_restarts
    if restarts >= limit:
        error = (f"{lost}; not restarted: the run has been restarted {restarts} time(s), cluster.max_restarts={limit}; "
                 f"continue with run_dir={path} resume=auto")
        rundir.update_result(path, {"status": rundir.Status.failed.value, "error": error})
        raise LaunchFailed(error, 1)
    log.info("%s: restarting the run from its newest checkpoint (restart %d of at most %d)", lost, restarts + 1, limit)
    rundir.update_result(path, {"status": rundir.Status.requeued.value, "lost_at": time.time(),
                                "error": f"{lost}; restarted (restart {restarts + 1} of at most {limit})"})
    return restarts + 1


def _on_live_nodes(cfg: RunConfig, path: Path, restarts: int, lost_ids: set[str]) -> RunConfig:
    """The run on as many of its nodes as the cluster's live nodes hold now (at first: all of them; after a lost
    node: down to `cluster.min_nodes`, waiting up to `cluster.timeout_s` for that many), run.yaml written again where
    that is another number of nodes than it says."""
    from xtrain.core.files import write_atomic

    if not restarts:
        return cfg
    fewest, deadline = cfg.cluster.min_nodes or cfg.cluster.nodes, time.time() + cfg.cluster.timeout_s
    while (live := min(cfg.cluster.nodes, len([n for n in fitting_nodes(cfg) if n["NodeID"] not in lost_ids]))
           ) < fewest and time.time() < deadline:
        time.sleep(2.0)
    given = elastic.on_nodes(cfg, max(live, fewest))  # (fewer live than min_nodes: the placement waits for them)
    file, now = path / rundir.RUN_CONFIG, schema.load(str(path / rundir.RUN_CONFIG))
    if now.cluster.nodes != given.cluster.nodes:
        log.info("ray: %d of the run's %d node(s) (restart %d): trainer.grad_accum %d -> %d keeps the effective batch",
                 given.cluster.nodes, cfg.cluster.nodes, restarts, now.trainer.grad_accum, given.trainer.grad_accum)
        write_atomic(file, elastic.run_yaml_on(path, given, (
            f"{rundir.MOVED} to {given.cluster.nodes} of the run's {cfg.cluster.nodes} node(s) (restart {restarts}): "
            f"grad_accum {now.trainer.grad_accum} -> {given.trainer.grad_accum}")))
    return given


def _attempt(cfg: RunConfig, path: Path, run_id: str, restart: int, cancel) -> dict:
    """One attempt: a placement group of `cluster.nodes` bundles, one task a bundle; the first node's result.
    Whatever ends it, nothing of it is left on the cluster."""
    ray = ray_package()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    nodes, need = cfg.cluster.nodes, bundle(cfg)
    group = placement_group([need] * nodes, strategy="STRICT_SPREAD")
    tasks = []
    try:
        ready, _ = _wait([group.ready()], 1, cfg.cluster.timeout_s, cancel)
        if not ready:
            raise LaunchFailed(f"the Ray cluster gave no {nodes} node(s) with {need} within cluster.timeout_s="
                               f"{cfg.cluster.timeout_s} s (its nodes are busy, or went away)", 1)
        on = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(nodes)]
        address, port = ray.get(_rendezvous.options(scheduling_strategy=on[0], num_cpus=0).remote())
        log.info("ray: %d node(s) placed; rendezvous %s:%d", nodes, address, port)
        resources = {"num_cpus": need["CPU"], "num_gpus": need.get("GPU", 0),
                     "resources": {k: v for k, v in need.items() if k not in ("CPU", "GPU")}}
        env = {"XTRAIN_RAY_RUN": run_id, **({machine.RESTART_ENV: str(restart)} if restart else {})}
        tasks = [_node.options(scheduling_strategy=on[i], **resources).remote(str(path), i, address, port, env)
                 for i in range(nodes)]
        return _outcome(tasks, _placed_on(group), cancel)[0]
    finally:
        _, unfinished = ray.wait(tasks, num_returns=len(tasks), timeout=0) if tasks else ([], [])
        for task in unfinished:  # (a failure on one node, or Ctrl-C here: the others stopped too)
            ray.cancel(task, force=True)
        remove_placement_group(group)


LOST_GRACE_S = 60.0  # after a node's task fails, how long the others have to end (a lost node is noticed meanwhile)


def _outcome(tasks: list, nodes: dict[int, str], cancel) -> list:
    """Every node's result; or, where one failed: NodeLost where a node of the group is gone (its task died with it,
    or Ray says it is dead), else the first node's failure as the run's."""
    ray = ray_package()
    from ray.exceptions import RayError, RayTaskError, TaskCancelledError

    pending, failures, deadline = list(tasks), {}, None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.time())
        done, pending = _wait(pending, 1, timeout, cancel)
        if not done:
            break  # (the others are cancelled as the attempt ends)
        try:
            ray.get(done[0])
        except RayError as err:
            failures[tasks.index(done[0])] = err
            deadline = deadline or time.time() + LOST_GRACE_S
    if not failures:
        return ray.get(tasks)
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    gone = sorted({i for i, err in failures.items() if not isinstance(err, (RayTaskError, TaskCancelledError))}
                  | {i for i, node in nodes.items() if node not in alive})
    if gone:
        what = ", ".join(f"node {i} on Ray node {nodes.get(i, '?')[:8]}: "
                         f"{type(failures[i]).__name__ if i in failures else 'dead'}" for i in gone)
        raise NodeLost(f"lost {len(gone)} of the run's {len(tasks)} node(s) ({what})", {nodes[i] for i in gone})
    first = failures[min(failures)]
    cause = getattr(first, "cause", None)
    if isinstance(first, RayTaskError) and isinstance(cause, BaseException) and not isinstance(cause, TaskCancelledError):
        raise cause from None
    raise LaunchFailed(f"a node's task failed: {' '.join(str(first).split())[:300]}", 1) from None


def _wait(refs: list, num_returns: int, timeout: float | None, cancel) -> tuple[list, list]:
    """`ray.wait`, a second at a time: Ctrl-C here (or `cancel` set) raises KeyboardInterrupt at once."""
    ray = ray_package()
    deadline = None if timeout is None else time.time() + timeout
    while True:
        step = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.time()))
        done, pending = ray.wait(refs, num_returns=num_returns, timeout=step)
        if cancel is not None and cancel.is_set():
            raise KeyboardInterrupt
        if len(done) >= num_returns or deadline is not None and time.time() >= deadline:
            return done, pending


def _placed_on(group) -> dict[int, str]:
    """The node ID each bundle of the placement group is on."""
    from ray.util import placement_group_table

    return {int(i): node for i, node in placement_group_table(group).get("bundles_to_node_id", {}).items()}


def _remote(function):
    """`function` as a Ray task (made as the module is used: Ray is imported only by runs on it)."""
    holder: dict = {}

    class Lazy:
        def options(self, **options):
            if "task" not in holder:
                holder["task"] = ray_package().remote(max_retries=0)(function)
            return holder["task"].options(**options)

    return Lazy()


def _free_rendezvous() -> tuple[str, int]:
    """On the first node: its address, and a port free there for torchrun's rendezvous."""
    import ray

    from xtrain.launch.supervisor import free_port

    return ray.util.get_node_ip_address(), free_port()


def _train_node(run_dir: str, node_rank: int, address: str, port: int, env: dict[str, str]) -> dict:
    """One node's task: its workers train the written run dir (the first node records how the run ended)."""
    import os

    from xtrain.backends import local
    from xtrain.launch.worker import configure_logging

    for key in ("XTRAIN_RAY_RUN", machine.RESTART_ENV):  # (a worker Ray reuses keeps what a task before set)
        os.environ.pop(key, None)
    os.environ.update(env)
    configure_logging()
    path = Path(run_dir)
    cfg = schema.load(str(path / rundir.RUN_CONFIG))
    cfg = replace(cfg, cluster=replace(cfg.cluster, node_rank=node_rank, main_process_ip=address,
                                       main_process_port=port))
    return (local.run_recorded if node_rank == 0 else local.run_here)(cfg, path)


def _path_exists(path: str) -> bool:
    return Path(path).exists()


_rendezvous, _node, sees = _remote(_free_rendezvous), _remote(_train_node), _remote(_path_exists)
