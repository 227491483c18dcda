"""cluster=ray on a real Ray cluster of 2 nodes on this machine (tests/ray_cluster.py), in a network namespace of each
test's own, on loopback only: a 2-node run follows the local 2-process run and leaves nothing on the cluster; a
request the cluster cannot hold, an address where nothing answers and a sweep are refused before anything is
written."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_one_line_error, read_metrics, read_result, run_xtrain

SMALL = ["trainer.max_steps=6", "trainer.warmup_steps=2", "trainer.log_every=2", "trainer.eval_every=3",
         "trainer.save_every=3"]


# Ray's core notes, in a namespace with no route out, that it found no external address (it then uses 127.0.0.1)
NO_ROUTE = re.compile(r"^\[[^]]+ W \d+ \d+\] network_util\.cc:\d+: Failed to determine local IP")


def on_ray(tmp_path: Path, *xtrain_args: str, nodes: int = 2) -> subprocess.CompletedProcess:
    """`python -m xtrain cluster=ray ARGS` against a fresh Ray cluster of `nodes` nodes of 1 CPU each, in a network
    namespace of its own (`unshare -n`: Ray binds 127.0.0.1 there); its stderr (Ray's no-route notes left out) as
    the result's, the cluster's own output and what it says was left on it in stdout."""
    command = [sys.executable, "-m", "xtrain", "cluster=ray", "cluster.address={address}", *xtrain_args]
    stderr = tmp_path / "xtrain.stderr"
    harness = [sys.executable, str(REPO / "tests" / "ray_cluster.py"), "--nodes", str(nodes), "--cpus", "1",
               "--stderr", str(stderr), "--", *command]
    script = f"ip link set lo up && exec {shlex.join(harness)}"
    proc = subprocess.run(["unshare", "-n", "bash", "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    proc.stdout += proc.stderr  # (the cluster's)
    proc.stderr = "".join(line for line in stderr.read_text().splitlines(keepends=True) if not NO_ROUTE.match(line))
    return proc


def curve(run_dir) -> list[tuple]:
    return [(r["step"], r.get("train/loss"), r.get("val/loss")) for r in read_metrics(run_dir)
            if "train/loss" in r or "val/loss" in r]


def test_a_2_node_ray_run_follows_the_local_2_process_run_and_leaves_nothing(tmp_path):
    local = tmp_path / "local"
    run_xtrain(f"run_dir={local}", "cluster.num_processes=2", *SMALL)
    ours = tmp_path / "ray"
    proc = on_ray(tmp_path, f"run_dir={ours}", "cluster.nodes=2", "cluster.num_processes=1", *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ray: 2 node(s) placed; rendezvous 127.0.0.1:" in proc.stderr + proc.stdout
    assert "left: 0 placement group(s), CPUs held 0" in proc.stdout
    result = read_result(ours)
    assert result["status"] == "completed" and result["world_size"] == 2 and result["steps"] == 6
    assert len(list((ours / "logs").glob("launcher-node*.log"))) == 2  # (one torchrun a node)
    got, expected = curve(ours), curve(local)
    assert [row[0] for row in got] == [row[0] for row in expected] and len(got) >= 5
    for (_, loss, val), (_, loss_l, val_l) in zip(got, expected):
        assert loss == pytest.approx(loss_l, rel=1e-6, abs=0) if loss is not None else loss_l is None
        assert val == pytest.approx(val_l, rel=1e-6, abs=0) if val is not None else val_l is None


def test_more_nodes_than_the_cluster_has_are_refused_before_anything_is_written(tmp_path):
    proc = on_ray(tmp_path, f"run_dir={tmp_path / 'run'}", "cluster.nodes=3", "cluster.num_processes=1")
    assert_one_line_error(proc, "cluster.nodes=3: the Ray cluster at", "has 2 of its 2 live node(s) with CPU 1",
                          "cluster.nodes=2")
    assert "left: 0 placement group(s)" in proc.stdout and not (tmp_path / "run").exists()


def test_an_address_where_nothing_answers_is_refused_in_one_line(tmp_path):
    proc = run_xtrain(f"run_dir={tmp_path / 'run'}", "cluster=ray", "cluster.address=127.0.0.1:1", "cluster.nodes=2",
                      "cluster.num_processes=1", check=False)
    assert_one_line_error(proc, "cluster.address=127.0.0.1:1: no Ray cluster answers at 127.0.0.1:1",
                          "ray start --head")
    assert not (tmp_path / "run").exists()


def test_rendezvous_settings_and_sweeps_are_refused_under_ray(tmp_path):
    proc = run_xtrain(f"run_dir={tmp_path / 'run'}", "cluster=ray", "cluster.main_process_port=29500", check=False)
    assert_one_line_error(proc, "cluster.main_process_port=29500: Ray places the nodes")
    proc = run_xtrain("-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "cluster=ray", "trainer.lr=1e-3,2e-3", check=False)
    assert_one_line_error(proc, "cluster=ray: a -m sweep's points do not run on Ray yet")
