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
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from xtrain.backends import elastic
from xtrain.config import schema
from xtrain.config.point import Point
from xtrain.config.schema import RunConfig
from xtrain.core import machine, rundir
from xtrain.core.errors import ConfigError, LaunchFailed, one_line
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
    """What each node's task reserves: its CPUs (one a process, or `cluster.cpus_per_node`), its GPUs
    (`cluster.gpus_per_node`; by default one a process where this machine has GPUs) and `cluster.resources`."""
    c = cfg.cluster
    reserved = {"CPU": float(c.cpus_per_node or c.processes_per_node)}
    gpus = int(c.gpus_per_node) if c.gpus_per_node != "auto" else c.processes_per_node if machine.visible_gpus() else 0
    if gpus:
        reserved["GPU"] = float(gpus)
    return {**reserved, **{name: float(amount) for name, amount in c.resources.items()}}


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
        ray.init(address=address, namespace="xtrain", logging_level=logging.ERROR, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(f"cluster.address={cfg.cluster.address}: no Ray cluster answers there ({reason}); start one "
                          "(ray start --head) or give its head's host:port") from None


def check(cfg: RunConfig) -> None:
    """The cluster has `cluster.nodes` live nodes that each hold one node's bundle, and each sees the run dir's
    storage as this machine does. (Ray places the nodes: the rendezvous settings of cluster=local are not the user's
    to give.)"""
    c = cfg.cluster
    if c.kuberay and not cfg.dry_run:
        raise ConfigError("cluster.kuberay=true: prints KubeRay's RayCluster manifest for this run under dry_run=true "
                          "and starts nothing; add dry_run=true, or drop cluster.kuberay")
    for key, default in (("node_rank", 0), ("main_process_ip", "127.0.0.1"), ("main_process_port", None)):
        if getattr(c, key) != default:
            raise ConfigError(f"cluster.{key}={getattr(c, key)}: Ray places the nodes and their rendezvous under "
                              f"cluster=ray; leave cluster.{key} unset")
    elastic.check_fewer(cfg)
    connect(cfg)
    need = bundle(cfg)
    nodes, fit = [n for n in _ray().nodes() if n.get("Alive")], _fitting_nodes(cfg)
    if len(fit) < cfg.cluster.nodes:
        what = ", ".join(f"{k} {v:g}" for k, v in need.items())
        raise ConfigError(f"cluster.nodes={cfg.cluster.nodes}: the Ray cluster at {cfg.cluster.address} has "
                          f"{len(fit)} of its {len(nodes)} live node(s) with {what} for a node's task; use "
                          f"cluster.nodes={max(1, len(fit))}, fewer processes a node, or a larger cluster")
    check_visible(cfg, fit)


def check_visible(cfg: RunConfig, nodes: list[dict]) -> None:
    """The run dir's storage is the same on every node that may hold the run: a file written here (and removed) is
    seen there. A dry run writes none: it asks only that the folder be there."""
    import uuid

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    folder = Path(cfg.run_dir).resolve()
    while not folder.is_dir():
        folder = folder.parent
    probe = None if cfg.dry_run else folder / f".xtrain-visible-{uuid.uuid4().hex[:12]}"
    if probe is not None:
        probe.write_text("xtrain: is this folder the same on every node of the Ray cluster?\n")
    try:
        looks = [_sees.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                 .remote(str(probe or folder)) for n in nodes]
        seen = _ray().get(looks, timeout=cfg.cluster.timeout_s)
    finally:
        if probe is not None:
            probe.unlink(missing_ok=True)
    blind = sorted({n["NodeManagerAddress"] for n, ok in zip(nodes, seen) if not ok})
    if blind:
        raise ConfigError(f"run_dir={cfg.run_dir}: the Ray node(s) at {', '.join(blind)} do not see {folder} as this "
                          "machine does (a file written here is not there); put the run dir on storage every node "
                          "mounts at the same path (NFS, a shared volume)")


def describe(cfg: RunConfig, script: bool = True) -> str:
    """A dry run: every check the real run makes (the cluster's nodes included), the plan, the placement group.
    `cluster.kuberay`: the checks that need no cluster, the plan, and a RayCluster manifest that holds the run."""
    from xtrain.launch import hardware

    if cfg.cluster.kuberay:
        elastic.check_fewer(cfg)
    else:
        check(cfg)
    preflight.check_free(cfg)
    preflight.preflight(cfg, planning=True)
    planned = plan.render(plan.for_this_machine(cfg, hardware.refusal(cfg)))
    if cfg.cluster.kuberay:
        from xtrain.backends import kuberay

        return "".join(f"# {line}\n" for line in planned.splitlines()) + kuberay.manifest(cfg)  # (all of it YAML)
    request = (f"ray: a placement group of {cfg.cluster.nodes} bundle(s) of "
               f"{ {k: v for k, v in bundle(cfg).items()} } (STRICT_SPREAD: one a node) at {cfg.cluster.address}")
    return "\n".join([planned, request])


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
    if not cfg.cluster.wait:
        return hand_over(path)
    return run_job(cfg, path)


def hand_over(path: Path) -> dict:
    """cluster.wait=false: the written run dir handed to a detached actor on the cluster, which runs `run_job` there
    (its placement, its restarts) and then exits; this returns once the actor is alive."""
    ray = _ray()
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
            _ray().actor.exit_actor()


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
        except BaseException as err:  # (Ctrl-C here: the tasks were cancelled before they could record it)
            interrupted = isinstance(err, KeyboardInterrupt) or getattr(err, "exit_code", 1) >= 128
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
    while (live := min(cfg.cluster.nodes, len([n for n in _fitting_nodes(cfg) if n["NodeID"] not in lost_ids]))
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


def _fitting_nodes(cfg: RunConfig) -> list[dict]:
    """The cluster's live nodes that can hold one node's task."""
    need = bundle(cfg)
    return [n for n in _ray().nodes() if n.get("Alive")
            and all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items())]


def _attempt(cfg: RunConfig, path: Path, run_id: str, restart: int, cancel) -> dict:
    """One attempt: a placement group of `cluster.nodes` bundles, one task a bundle; the first node's result.
    Whatever ends it, nothing of it is left on the cluster."""
    ray = _ray()
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
    ray = _ray()
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
    ray = _ray()
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
                holder["task"] = _ray().remote(max_retries=0)(function)
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


_rendezvous, _node, _sees = _remote(_free_rendezvous), _remote(_train_node), _remote(_path_exists)


# ---------------------------------------------------------------- a sweep's points, a study's trials


def scripts(points: list[Point], sweep_dir: Path, **options) -> list[str]:
    """A sweep's job scripts, as a dry run shows them: none (each point is placed as it starts)."""
    return []


def check_points(points: list[Point], *, n_jobs: int = 1, setting: str = "hydra.launcher.n_jobs") -> None:
    """Each point's request against the cluster, and `n_jobs` points of the most nodes any asks for at once: the
    cluster must hold them all (a point that waited for another's nodes would run out its cluster.timeout_s)."""
    if n_jobs < 1:
        raise ConfigError(f"{setting}={n_jobs}: must be >= 1")
    for point in points:
        try:
            check(point.cfg)
        except ConfigError as err:
            raise ConfigError(f"point {point.num} ({point.label}): {err}") from None
    if not points:
        return
    widest = max(points, key=lambda p: p.cfg.cluster.nodes).cfg
    fit, nodes = len(_fitting_nodes(widest)), widest.cluster.nodes
    if n_jobs * nodes > fit:
        raise ConfigError(f"{setting}={n_jobs}: {n_jobs} points of {nodes} node(s) at once need {n_jobs * nodes} "
                          f"nodes, and the Ray cluster at {widest.cluster.address} has {fit} that hold a point's node; "
                          f"use {setting}={max(1, fit // nodes)}")


def run_points(points, sweep_dir: Path, on_end: Callable[[Point], None], *, n_jobs: int = 1) -> bool:
    """Run already-written points, each a Ray run of its own (its placement group, its restarts), `n_jobs` at once;
    `on_end` each as it ends (its outcome is in its result.json). A point that fails is recorded and the others go
    on; Ctrl-C here cancels every running point (nothing left on the cluster). `points` may be a source instead,
    asked for the next point whenever a slot is free (None: none now; a study's)."""
    import functools
    import threading
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    take = points if callable(points) else functools.partial(next, iter(points), None)
    cancel, running = threading.Event(), {}
    if n_jobs > 1:
        log.info("%d points at a time", n_jobs)
    with ThreadPoolExecutor(n_jobs) as pool:
        try:
            while True:
                while len(running) < n_jobs and (point := take()) is not None:
                    log.info("point %d started on Ray: %s", point.num, point.label)
                    running[pool.submit(_run_point, point, cancel)] = point
                if not running:
                    return True
                done, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                for future in done:
                    on_end(running.pop(future))
        except KeyboardInterrupt:
            cancel.set()  # (each point's tasks cancelled, its group removed, its end recorded)
            wait(running)
            raise


def _run_point(point: Point, cancel) -> None:
    """One point, its failure recorded in its result.json (by `run_job`) and logged."""
    try:
        run_job(point.cfg, point.path, cancel)
    except Exception as err:
        log.info("point %d: %s", point.num, one_line(err))
