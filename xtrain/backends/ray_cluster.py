"""The Ray backend: a run on a Ray cluster's nodes, from a machine of that cluster (its head, or a `ray job submit`'s
entrypoint).

Everything is checked here before anything is written (the address, the nodes that hold a node's task, the run
dir's storage on each); then the run dir is written, as for the other backends, on storage every node sees, and
ray_job.py places the run and follows it (or, with `cluster.wait=false`, hands it to an actor on the cluster). A
sweep's points and a study's trials are each such a run, `n_jobs` at once. Whatever ends a run (its end, a failure,
Ctrl-C here), its tasks are cancelled and its placement group removed: nothing is left on the cluster.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from xtrain.backends import elastic
from xtrain.backends.ray_job import bundle, fitting_nodes, hand_over, ray_package, run_job, sees
from xtrain.config.point import Point
from xtrain.config.schema import RunConfig
from xtrain.core.errors import ConfigError, one_line
from xtrain.launch import plan, preflight

log = logging.getLogger("xtrain")


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
    ray = ray_package()
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
    nodes, fit = [n for n in ray_package().nodes() if n.get("Alive")], fitting_nodes(cfg)
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
        looks = [sees.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                 .remote(str(probe or folder)) for n in nodes]
        seen = ray_package().get(looks, timeout=cfg.cluster.timeout_s)
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

        return "".join(f"# {line}\n" for line in planned.splitlines()) + kuberay.manifest(cfg, bundle(cfg))  # (YAML)
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
    fit, nodes = len(fitting_nodes(widest)), widest.cluster.nodes
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
