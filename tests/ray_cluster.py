"""A real Ray cluster of `--nodes` nodes on this machine, for the Ray tests: `python tests/ray_cluster.py --nodes 2
--cpus 1 -- COMMAND...` starts it, runs COMMAND with RAY_ADDRESS set to it (and XTRAIN_RAY_ADDRESS, for the
command's `cluster.address=`), and stops it; COMMAND's exit code is this script's. Run inside a network namespace
of the test's own (`unshare -n`, loopback up): Ray binds 127.0.0.1 there, never the machine's external address."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def run_cluster() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=1)
    parser.add_argument("--stderr", help="a file for COMMAND's stderr (else this script's)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.cpus, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=args.cpus, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    try:
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        env = {**os.environ, "RAY_ADDRESS": cluster.address}
        with open(args.stderr or os.devnull, "w") as err:
            code = subprocess.run([arg.replace("{address}", cluster.address) for arg in command], env=env,
                                  stderr=err if args.stderr else None).returncode
        print(f"left: {cluster_left(cluster.address)}", flush=True)
        return code
    finally:
        cluster.shutdown()


def cluster_left(address: str) -> str:
    """What the cluster still holds: placement groups not removed, CPUs reserved (a second after, for Ray to free them)."""
    import time

    import ray
    from ray.util import placement_group_table

    ray.init(address=address, logging_level="ERROR")
    try:
        for _ in range(20):
            groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
            held = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
            if not groups and not held:
                break
            time.sleep(0.5)
        return f"{len(groups)} placement group(s), CPUs held {held:g}"
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(run_cluster())
