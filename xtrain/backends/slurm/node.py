"""On every node of a SLURM job: its place in the job (from SLURM's environment), its workers through the
local backend, and after a stop at a step boundary, the job's requeue.

submitit pickles `run_node` by reference: its import path, `xtrain.backends.slurm.node.run_node`, is part of every
queued job.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

from xtrain.backends import elastic
from xtrain.backends.slurm.monitor import query
from xtrain.config.cluster import ClusterConfig
from xtrain.config.schema import RunConfig
from xtrain.core import rundir
from xtrain.core.errors import ConfigError, LaunchFailed, Stopped
from xtrain.core.files import keep_private

log = logging.getLogger("xtrain")

PORT_BASE, PORT_SPAN = 20000, 10000  # rendezvous ports: below Linux's ephemeral range


def rendezvous_port(job_id: str) -> int:
    return PORT_BASE + int(job_id) % PORT_SPAN


def node_topology(cfg: RunConfig) -> RunConfig:
    """This node's place in the job, from SLURM: node rank, the first node as rendezvous, the job's port."""
    import submitit

    env = submitit.JobEnvironment()
    cluster = replace(cfg.cluster, node_rank=env.node, main_process_ip=env.hostnames[0],
                      main_process_port=rendezvous_port(os.environ["SLURM_JOB_ID"]))
    return replace(cfg, cluster=cluster)


def run_node(run_dir: str) -> dict:
    """One node's task: its workers train the prepared run dir. Runs in submitit's process on the node.

    A stop signal (SLURM's warning before the time limit, `scancel --signal=USR2`) ends training at a step
    boundary with a checkpoint on every node; node 0 then requeues the job, which resumes in the same run
    dir (progress.resume_setting). A job requeued without warning resumes from its newest checkpoint."""
    from xtrain.core import machine, stopping
    from xtrain.launch import hardware
    from xtrain.backends import local
    from xtrain.launch.supervisor import threads_per_process
    from xtrain.launch.worker import configure_logging

    os.environ[machine.NODE_SIDE] = "1"  # this process and its workers run the job; they submit nothing
    keep_private()
    configure_logging()
    logging.getLogger("submitit").propagate = False  # it has a handler of its own
    path = Path(run_dir)
    cfg = node_topology(on_the_nodes_given(path))
    first = cfg.cluster.node_rank == 0
    if first:
        log.info("job %s on %s; rendezvous %s:%d%s", os.environ.get("SLURM_JOB_ID"),
                 os.environ.get("SLURM_JOB_NODELIST"), cfg.cluster.main_process_ip, cfg.cluster.main_process_port,
                 f"; restart {restart_count()}" if restart_count() else "")
    # from here on, submitit's own handlers (requeue at once, with no checkpoint) are replaced; a warning
    # that comes after the run ended is ignored (not the default action, which ends the task: FAILED)
    for signum in stopping.IN_WORKERS:
        signal.signal(signum, signal.SIG_IGN)
    with stopping.on(stopping.GRACEFUL):
        try:
            import torch

            torch.set_num_threads(threads_per_process(cfg.cluster.processes_per_node))  # the cores SLURM gave
            hardware.check(cfg)  # this node's own GPUs
            return (local.run_recorded if first else local.run_here)(cfg, path)
        except Stopped:
            if first:
                requeue_or_end(cfg.cluster, path)
            return {"status": "stopped"}
        except LaunchFailed as err:
            if err.exit_code < 128:
                raise
            log.info("%s", err)  # SLURM ended this allocation (scancel, scontrol requeue): no traceback
            return {"status": "interrupted"}
        except ConfigError as err:
            if first:
                rundir.record_end(path, "failed", str(err))
            raise


def on_the_nodes_given(path: Path) -> RunConfig:
    """run.yaml's run on the nodes SLURM gave this allocation (a job of `cluster.min_nodes`-`cluster.nodes`): on
    fewer or more than run.yaml's, node 0 writes it again with them and the grad_accum that keeps the effective batch
    (the workers read it), and the other nodes wait until it has."""
    import submitit

    from xtrain.config import schema
    from xtrain.core.files import write_atomic

    file = path / rundir.RUN_CONFIG
    written = schema.load(str(file))
    env = submitit.JobEnvironment()
    given = elastic.on_nodes(written, env.num_nodes)
    if given is written:
        return written
    moved = (f"{rundir.MOVED} to {env.num_nodes} of the job's {written.cluster.nodes} node(s) (restart "
             f"{restart_count()}): grad_accum {written.trainer.grad_accum} -> {given.trainer.grad_accum}")
    text = elastic.run_yaml_on(path, given, moved)
    if env.node == 0:
        log.info("SLURM gave %d of the job's %d node(s): trainer.grad_accum %d -> %d keeps the effective batch",
                 env.num_nodes, written.cluster.nodes, written.trainer.grad_accum, given.trainer.grad_accum)
        write_atomic(file, text)
    deadline = time.time() + written.cluster.timeout_s
    while file.read_text() != text:
        if time.time() > deadline:
            raise LaunchFailed(f"node {env.node}: node 0 did not write {file} for {env.num_nodes} node(s) within "
                               f"cluster.timeout_s={written.cluster.timeout_s}", 1)
        time.sleep(0.2)
    return given


def restart_count() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def requeue_or_end(cluster: ClusterConfig, path: Path) -> None:
    """After a stop at a step boundary (every rank has saved): requeue this job, unless it has been
    restarted `cluster.max_requeues` times already; then the run ends `interrupted`, resumable by hand.
    After SIGTERM, SLURM's own way of ending a job, what happens next is SLURM's (it may requeue it)."""
    import submitit

    result = rundir.read_result(path)
    stop, limit, restarts = result["stop"], cluster.max_requeues, restart_count()
    stopped = f"stopped by {stop['signal']} at step {stop['step']} with a checkpoint"
    if stop["signal"] == "SIGTERM":  # SLURM itself is ending the job (scancel, scontrol requeue, time limit)
        log.info("%s; SLURM is ending the job", stopped)
        return
    if restarts >= limit:
        error = (f"{stopped}; not requeued: the job has been restarted {restarts} time(s), "
                 f"cluster.max_requeues={limit}; continue with run_dir={path} resume=auto")
        rundir.update_result(path, {"error": error})
        log.info("%s", error)
        return
    job_id = submitit.JobEnvironment().job_id  # <array>_<task> for a point of a sweep
    nodes = nodes_to_ask(cluster, os.environ.get("SLURM_JOB_PARTITION"))
    fewer = f" on {nodes} node(s): the others cannot run now" if nodes < cluster.nodes else ""
    rundir.update_result(path, {"status": rundir.Status.requeued.value,
                                "error": f"{stopped}; requeued (restart {restarts + 1} of at most {limit}){fewer}"})
    log.info("%s: requeueing SLURM job %s%s", stopped, job_id, fewer)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # SLURM ends this allocation's processes as it requeues
    query(["scontrol", "requeue", job_id])
    if fewer:  # (a pending job's node count can be lowered: it starts on them, node 0 then writes run.yaml anew)
        query(["scontrol", "update", f"JobId={job_id}", f"NumNodes={nodes}", f"NumTasks={nodes}"])  # (a task a node)


def nodes_to_ask(cluster: ClusterConfig, partition: str | None) -> int:
    """The nodes a requeued job asks for: `cluster.nodes`, or with `cluster.min_nodes` as many of the partition's
    as can run now (not drained, draining or down), never fewer than min_nodes."""
    if cluster.min_nodes is None or cluster.min_nodes == cluster.nodes:
        return cluster.nodes
    states = query(["sinfo", "-h", "-N", "-o", "%T", *(["-p", partition] if partition else [])]).split()
    usable = sum(not state.rstrip("*~#!%$@^-").startswith(("drain", "down", "fail", "maint", "reserved"))
                 and not state.endswith("*") for state in states)
    return max(cluster.min_nodes, min(cluster.nodes, usable))
