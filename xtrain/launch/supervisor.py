"""N worker processes per node through torch's elastic launcher (torchrun), supervised by the driver.

The driver has written the run dir; torchrun (`python -m xtrain.launch.agent`, torchrun's own elastic agent with
its ranks forked, or spawned on an accelerator's build of torch) runs `xtrain.launch.worker.run([RUN_DIR])` per
local rank. Local rank 0's output reaches the terminal; torchrun's own messages go to `logs/launcher-node<R>.log`. If a worker fails, torchrun stops the others and the driver
shows the failing rank's own error first. SIGINT to the driver stops the whole process tree
(torchrun first, then anything left, by force after a grace period); SIGTERM / SIGUSR1 / SIGUSR2
ask the workers to stop at a step boundary with a checkpoint (xtrain/core/stopping.py).
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from xtrain.config.cluster import ClusterConfig
from xtrain.core import machine, rundir, seams, stopping
from xtrain.core.errors import ConfigError, LaunchFailed
from xtrain.core.rundir import ERRORS_DIR
from xtrain.launch import forkserver

RANK0_PREFIX = "[default0]:"
GRACE_S = 10
LINGER_S = 60  # a tree still there this long after its run recorded its end is stopped


def linger_s() -> float:
    return seams.first("linger_s") or LINGER_S


def free_port() -> int:
    """A port nothing listens on, for torchrun's rendezvous, drawn below the kernel's ephemeral range: a port the
    kernel hands out (port 0) is one it also gives the local end of outgoing connections, and one of those (a gloo
    connection of another run on this machine) could take it before torchrun listens on it."""
    low = ephemeral_ports()[0]
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(max(1024, low - 10_000), low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is full: any free port
        s.bind(("", 0))
        return s.getsockname()[1]


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes the local ports of outgoing connections from (Linux; others: IANA's)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def threads_per_process(processes: int) -> int:
    """Split this node's cores (in a SLURM job: the ones it was given) between its workers (torchrun's
    default is 1 thread each)."""
    return max(1, machine.usable_cores() // processes)


@dataclass(frozen=True)
class Topology:
    nodes: int
    node_rank: int
    processes_per_node: int
    main_process_ip: str
    main_process_port: int | None  # None: a free port (one node only)

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node


def torchrun_command(topology: Topology, workdir: Path, port: int, module_args: list[str]) -> list[str]:
    t = topology
    return [
        sys.executable, "-m", "xtrain.launch.agent",
        f"--nnodes={t.nodes}", f"--node-rank={t.node_rank}", f"--nproc-per-node={t.processes_per_node}",
        f"--master-addr={t.main_process_ip}", f"--master-port={port}",
        f"--log-dir={workdir / 'logs' / f'node{t.node_rank}'}", "--tee=3", "--local-ranks-filter=0",
        "-m", *module_args,
    ]


def _pump(stream, terminal, log_file) -> None:
    """Local rank 0's lines to the terminal (prefix removed), torchrun's own lines to its log. Bytes that are
    not UTF-8 are replaced, and a terminal that is gone (closed: EIO) takes no more lines, the log does: never
    fatal, since a reader that stopped would leave the pipe to fill and the workers to block on their next print."""
    for raw in stream:
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(RANK0_PREFIX) and terminal is not None:
            try:
                terminal.write(line[len(RANK0_PREFIX):])
                terminal.flush()
                continue
            except OSError:
                terminal = None
        log_file.write(line.removeprefix(RANK0_PREFIX))
        log_file.flush()


def stop_tree(proc: subprocess.Popen | forkserver.Forked) -> None:
    """SIGTERM to torchrun (it stops its workers), then SIGKILL to whatever is left after a grace period."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def supervise(topology: Topology, workdir: Path, module_args: list[str], env: dict,
              step_boundary: bool = False, ended: Callable[[], bool] | None = None) -> int:
    """Run the workers under torchrun; return its exit code, or -signum if a signal stopped them at once.
    `ended()`: the run has recorded its end; a tree still alive `linger_s()` after that is stopped (exit code 0).

    SIGINT and SIGTERM stop the whole tree at once. With `step_boundary` (training workers) SIGINT, SIGTERM,
    SIGUSR1 and SIGUSR2 instead ask the workers to stop at the next step boundary with a checkpoint
    (SIGUSR1 to each, once it listens: one that is still starting gets it when it does); a second one
    stops the tree at once."""
    port = topology.main_process_port or free_port()
    for stale in (workdir / ERRORS_DIR).glob("rank*.json"):
        stale.unlink()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads_per_process(topology.processes_per_node)),
        # when the run started: this process's start, or the sweep point's (set by the sweep)
        "XTRAIN_LAUNCH_TIME": str(machine.launch_time()),
        stopping.DRIVER_ENV: str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    log_path = workdir / "logs" / f"launcher-node{topology.node_rank}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stopped_by: list[int] = []
    told: set[int] = set()  # workers that were sent the stop request while they listened for it
    with open(log_path, "a") as log_file:
        # in a session of its own: the terminal's Ctrl-C reaches the driver, which stops all
        proc = forkserver.popen(torchrun_command(topology, workdir, port, module_args), env,
                                "stopping" if step_boundary else "ending")
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, log_file), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, log_file), daemon=True)]
        for t in pumps:
            t.start()

        def at_once(signum, frame):
            stopped_by.append(signum)
            stop_tree(proc)

        def at_step_boundary(signum, frame):
            if stopping.requested():
                at_once(signum, frame)
            else:
                stopping.request(signum)
                _tell_workers(proc, told)
                log_file.write(f"xtrain: {signal.Signals(signum).name}: asking the workers to stop at a step boundary\n")

        handlers = {signal.SIGINT: at_once, signal.SIGTERM: at_once}
        if step_boundary:
            handlers.update({s: at_step_boundary for s in stopping.GRACEFUL})
        previous = {s: signal.signal(s, handler) for s, handler in handlers.items()}
        ended_at = None
        try:
            while True:
                try:
                    code = proc.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    if step_boundary and stopping.requested() and not stopped_by:  # (also: asked before they started)
                        _tell_workers(proc, told)
                    if ended is not None and ended_at is None and ended():
                        ended_at = time.time()
                    if ended_at is not None and time.time() - ended_at > linger_s():
                        log_file.write(f"xtrain: the run recorded its end {linger_s():g} s ago and its processes are "
                                       "still there: stopped them\n")
                        stop_tree(proc)
                        proc.wait()
                        code = 0
                        break
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        for t in pumps:
            t.join(timeout=5)
    if stopped_by:
        return -stopped_by[0]
    asked = stopping.requested() if step_boundary else None
    return -signal.Signals[asked["signal"]] if asked and code != 0 else code  # asked, and they did not end well


def _tell_workers(proc: subprocess.Popen | forkserver.Forked, told: set[int]) -> None:
    """SIGUSR1 to each of torchrun's own children, the workers (not what they start: the signal's default
    action would end it), once each listens for it. Only once: a signal interrupts the system call a
    worker is in (a collective's socket read, a checkpoint's write), and the C++ below may not retry it."""
    try:
        workers = psutil.Process(proc.pid).children()
    except psutil.NoSuchProcess:
        return
    for p in workers:
        if p.pid in told or not _catches(p.pid, signal.SIGUSR1):
            continue
        try:
            p.send_signal(signal.SIGUSR1)
            told.add(p.pid)
        except psutil.NoSuchProcess:
            pass


def _catches(pid: int, signum: int) -> bool:
    """The process has a handler for `signum` (Linux: SigCgt in /proc; elsewhere assumed)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return True
    return bool(caught >> (signum - 1) & 1)


def recorded_its_end(result: dict, before: dict) -> bool:
    """This attempt's trainer wrote its final result.json: completed, pruned, or stopped at a step boundary
    with a checkpoint. Every rank's part (checkpoint, model) is done by then."""
    status = result.get("status")
    stopped = status == rundir.Status.interrupted and "stop" in result
    return result != before and (status in (rundir.Status.completed, rundir.Status.pruned) or stopped)


FAILURE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def killed_rank(launcher_log: Path, node_rank: int, run_dir: Path) -> dict | None:
    """The rank torchrun saw fail that left no error of its own (killed outright: SIGKILL, the OOM killer, a crash),
    from torchrun's last report in this node's launcher log, as `rundir.first_rank_error` gives one. A rank killed
    by a signal comes first: the ranks that failed in the same instant lost their peer in a collective (their own
    error says "connection closed"), and torchrun's "first observed" cannot tell them apart within a second."""
    try:
        text = launcher_log.read_text(errors="replace")
    except OSError:
        return None
    report = text[text.rfind("Failures:"):] if "Failures:" in text else ""
    failures = [(int(r), int(e)) for r, e in FAILURE.findall(report)]
    silent = [(r, e) for r, e in failures if not (run_dir / ERRORS_DIR / f"rank{r}.json").exists()]
    signalled = [(r, e) for r, e in silent if e < 0]
    if not (signalled or silent):
        return None
    rank, exitcode = (signalled or silent)[-1]  # (the root cause is listed last)
    if exitcode < 0:
        how = f"was killed by {signal.Signals(-exitcode).name}"
        how += " (by hand, or the kernel's OOM killer: see dmesg)" if exitcode == -signal.SIGKILL else ""
    else:
        how = f"exited with code {exitcode} without an error of its own (a crash in native code?)"
    return {"rank": rank, "summary": f"its process {how}", "terminated": False, "config_error": False,
            "diverged": False, "one_line": True, "traceback": "", "node": node_rank, "signalled": exitcode < 0}


def run(cluster: ClusterConfig, run_dir: Path) -> dict:
    """The CLI's multi-process run: workers train from the run dir; failures become LaunchFailed / ConfigError."""
    c = cluster
    topology = Topology(c.nodes, c.node_rank, c.processes_per_node, c.main_process_ip, c.main_process_port)
    with stopping.on(()):  # this run's stop request (a signal to this driver), not an earlier one's
        before = rundir.read_result(run_dir)  # a resumed run's shows how its last attempt ended
        code = supervise(topology, run_dir, ["xtrain.launch.worker", str(run_dir)], {}, step_boundary=True,
                         ended=lambda: recorded_its_end(rundir.read_result(run_dir), before))
        asked = stopping.requested()
    error = rundir.first_rank_error(run_dir)
    killed = killed_rank(run_dir / "logs" / f"launcher-node{c.node_rank}.log", c.node_rank, run_dir) if code > 0 else None
    if killed is not None and (error is None or error["terminated"] or killed["signalled"]):
        error = killed  # (the rank that failed first could not say why)
    if code < 0 and error is not None and not error["terminated"]:
        code = 1  # stopped because a rank on another node failed (SLURM ends a job's tasks when one fails)
    if code < 0:
        name = signal.Signals(-code).name
        rundir.record_end(run_dir, "interrupted", f"stopped by {name}", started_only=True)
        raise LaunchFailed(f"stopped by {name}; all workers ended", 128 - code)
    if code != 0:
        if error is None:
            raise LaunchFailed(f"torchrun exited with code {code} before any worker reported (see {run_dir / 'logs'})", 1)
        if error["config_error"]:  # (a metric that cannot take its inputs, found at the first eval)
            rundir.record_end(run_dir, "failed", error["summary"], started_only=True, a_rank_failed=True)
            raise ConfigError(error["summary"])
        rundir.record_end(run_dir, "failed", f"rank {error['rank']}: {error['summary']}", started_only=True,
                          a_rank_failed=True)
        if not error.get("one_line", error.get("diverged")):  # that one line says it all
            sys.stderr.write(error["traceback"])
        raise LaunchFailed(
            f"rank {error['rank']} failed: {error['summary']}\n"
            f"all {c.world_size} workers stopped; every rank's output: {run_dir / 'logs'}", 1,
        )
    result = rundir.read_result(run_dir)
    if asked and result.get("stop") and c.node_rank == 0:  # the workers heard SIGUSR1 from us: name the signal
        result = rundir.update_result(run_dir, {"stop": {**result["stop"], **asked},
                                                "error": result["error"].replace("SIGUSR1", asked["signal"], 1)})
    return result
