"""A real Ray cluster of `--nodes` nodes on this machine, for the Ray tests: `python tests/ray_cluster.py --nodes 2
--cpus 1 -- COMMAND...` starts it, runs COMMAND with RAY_ADDRESS set to it (and XTRAIN_RAY_ADDRESS, for the
command's `cluster.address=`), and stops it; COMMAND's exit code is this script's. `--lose-node-when FILE`: as soon
as FILE exists, the last node added is lost as a machine is: every process of it killed at once (its raylet, its
Ray workers and what they started), and the cluster told nothing. `--interrupt-when FILE`: as soon as FILE exists,
COMMAND gets SIGINT (Ctrl-C). `--watch TEXT`: as COMMAND ends, the processes whose command line holds TEXT (a run
dir) are counted among what is left. `--serve FILE`: start the cluster, write its address to FILE and keep it until
SIGTERM; `--address ADDRESS`: run COMMAND against that cluster instead of one of its own (run in the server's
network namespace). Run inside a network namespace of the test's own (`unshare -n`, loopback up): Ray binds 127.0.0.1
there, never the machine's external address."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def run_cluster() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=1)
    parser.add_argument("--serve", help="start the cluster, write its address to this file, keep it until SIGTERM")
    parser.add_argument("--address", help="run COMMAND against the cluster at this address (one --serve started)")
    parser.add_argument("--stderr", help="a file for COMMAND's stderr (else this script's)")
    parser.add_argument("--lose-node-when", help="a file whose existence makes the last node added lost")
    parser.add_argument("--interrupt-when", help="a file whose existence sends COMMAND SIGINT")
    parser.add_argument("--watch", help="processes whose command line holds this are counted as left")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.address:
        return run_against(args, args.address)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # (the cluster shut down as the process ends)
    cluster, added = start_cluster(args.nodes, args.cpus)
    try:
        if not args.serve:
            return run_against(args, cluster.address, lose=lambda: kill_node(cluster, added[-1]))
        with open(args.serve + ".tmp", "w") as file:
            file.write(cluster.address)
        os.replace(args.serve + ".tmp", args.serve)
        while True:
            signal.pause()
    finally:
        cluster.shutdown()


def start_cluster(nodes: int, cpus: int):
    """A cluster of `nodes` nodes of `cpus` CPUs each on 127.0.0.1, and the nodes added after its head."""
    from ray.cluster_utils import Cluster

    # (a dead node noticed within ~3 s: its health checked every second, three misses)
    # (and no Ray worker started before a task asks for one: each is an interpreter importing Ray, on CPUs the tests share)
    # (and no warning that the disk is nearly full: the machines the tests run on share theirs, and the raylets'
    # warnings reach every driver's stderr, between a refusal's one line)
    system = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3, "enable_worker_prestart": False,
              "local_fs_capacity_threshold": 1.0}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False, "_system_config": system})
    added = [cluster.add_node(num_cpus=cpus, node_ip_address="127.0.0.1") for _ in range(nodes - 1)]
    cluster.wait_for_nodes()
    return cluster, added


def run_against(args, address: str, lose=None) -> int:
    """COMMAND run against the cluster at `address`, then what is left on it reported; COMMAND's exit code."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = {**os.environ, "RAY_ADDRESS": address}
    with open(args.stderr or os.devnull, "w") as err:
        proc = subprocess.Popen([arg.replace("{address}", address) for arg in command], env=env,
                                stderr=err if args.stderr else None)
        if args.lose_node_when and wait_for(args.lose_node_when, proc):
            lose()
        if args.interrupt_when and wait_for(args.interrupt_when, proc):
            proc.send_signal(signal.SIGINT)
        code = proc.wait()
    print(f"left: {cluster_left(address)}", flush=True)
    if args.watch:
        print(f"processes left: {processes_of(args.watch)}", flush=True)
    return code


def wait_for(file: str, proc: subprocess.Popen) -> bool:
    """`file` exists (True), or `proc` ended first (False)."""
    while not os.path.exists(file):
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    return True


def processes_of(text: str) -> int:
    """The processes whose command line holds `text` (a few seconds given for them to end)."""
    import psutil

    for _ in range(20):
        found = [p for p in psutil.process_iter(["cmdline"])
                 if p.pid != os.getpid() and any(text in arg for arg in p.info["cmdline"] or [])]
        if not found:
            return 0
        time.sleep(0.5)
    return len(found)


def kill_node(cluster, node) -> None:
    """`node` lost as a machine is: every process of it killed at once, the cluster told nothing."""
    import contextlib

    import psutil
    from ray._private import ray_constants

    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    tree = [raylet, *raylet.children(recursive=True)]
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGSTOP)  # (none of them acts on the others' deaths first)
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    cluster.remove_node(node, allow_graceful=False)
    print(f"lost: a node of {len(tree)} process(es)", flush=True)


def cluster_left(address: str) -> str:
    """What the cluster still holds: placement groups not removed, CPUs reserved, actors alive (given ten seconds to
    let go)."""
    import ray
    from ray._private import state
    from ray.util import placement_group_table

    ray.init(address=address, logging_level="ERROR")
    try:
        for _ in range(20):
            groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
            held = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
            actors = [a for a in state.actors().values() if a["State"] != "DEAD"]
            if not groups and not held and not actors:
                break
            time.sleep(0.5)
        return f"{len(groups)} placement group(s), CPUs held {held:g}, actors alive {len(actors)}"
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(run_cluster())
