"""A driver's torchrun agents, forked from one process of its own that has imported what every agent imports.

An agent started anew spends 4-9 s of CPU importing torch, transformers and the training loop before it forks its
ranks (`agent.py`). A driver that launches more than once (a sweep's or a study's points, the test suite's runs)
pays that once: its first launch starts this server (`python -m xtrain.launch.forkserver`), which imports them and
then forks an agent for each launch. The agent is what `subprocess.Popen` would have started: its command line,
environment, working directory, standard streams, session and `preexec` are the launch's own, and `Forked` answers
as a `Popen` does (pid, pipes, `poll`, `wait`, its exit code or `-signal`).

One server serves launches whose environment is the same but for what is only read once a run has started
(`LATE`): torch and transformers read some variables as they are imported. It ends when its driver does (a
parent-death signal, however the driver ended), and each agent when the server does, as an agent started anew
ends with its driver. It ignores the stop signals a scheduler sends every process of a job: the agent decides
what they mean. Where any of this is missing (not Linux) or fails, or `XTRAIN_AGENT_FORKSERVER=0` says so, the
launch starts its agent anew.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from typing import Callable

from xtrain.core import stopping

log = logging.getLogger("xtrain")

SWITCH = "XTRAIN_AGENT_FORKSERVER"  # "0": each agent started anew
# read by a run, never at import (XTRAIN_SEAMS: loaded at the first question, xtrain/core/seams.py)
LATE = frozenset({"XTRAIN_LAUNCH_TIME", "XTRAIN_SEAMS", "PYTEST_CURRENT_TEST"})
TITLE = 16384  # the room a forked agent has for its command line (`ps` shows the launch's own)
KEPT = 2  # servers a driver keeps, for its last environments
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, *stopping.IN_WORKERS)  # by the server only

_servers: dict[tuple, "_Server"] = {}
_lock = threading.Lock()


class Forked:
    """A forked agent, as `subprocess.Popen` shows a process it started."""

    def __init__(self, args: list[str], pid: int, report: socket.socket, stdout, stderr):
        self.args, self.pid, self.stdout, self.stderr = args, pid, stdout, stderr
        self.returncode: int | None = None
        self._report = report

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._report], [], [], 0)[0]:
            self._read_code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._report], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_code()
        return self.returncode

    def _read_code(self) -> None:
        code = _receive(self._report)
        self._report.close()
        # (the server gone before its agent ended: the agent ended with it, by SIGKILL)
        self.returncode = -signal.SIGKILL if code is None else code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(args: list[str], env: dict, preexec: str) -> subprocess.Popen | Forked:
    """`python -m xtrain.launch.agent ...` (`args`) with its stdout and stderr piped, in a session of its own, after
    `preexec` ("stopping": it ignores the stop signals; either way it ends with its driver): forked from this
    driver's server for `env`, or, where there cannot be one, started anew."""
    if (sys.platform.startswith("linux") and args[1:3] == ["-m", "xtrain.launch.agent"]
            and os.environ.get(SWITCH, "1") != "0"):
        try:
            return _server(env).fork(args, env, preexec)
        except OSError as err:  # (the server could not start, or is gone: this launch starts its agent anew)
            log.debug("agent fork server: %s; starting the agent anew", err)
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
                            preexec_fn=preexec_of(preexec))


def preexec_of(name: str) -> Callable[[], None]:
    return {"stopping": _stopping_child, "ending": _ending_child}[name]


def _stopping_child() -> None:
    """The agent of training workers ignores the stop signals (stopping.ignore_in_child), and it ends when the
    driver does, however the driver ended (`_ending_child`)."""
    stopping.ignore_in_child()
    _ending_child()


def _ending_child() -> None:
    """torchrun ends when the driver does (here: when the server, which ends with the driver, does): SIGKILL, not
    its own shutdown on SIGTERM, which can hang with its workers gone (seen: its main thread waiting on a lock
    forever). Each worker then gets SIGTERM as its parent ends."""
    stopping.end_with_parent(signal.SIGKILL)


def _server(env: dict) -> "_Server":
    key = (os.getpid(), tuple(sorted((k, v) for k, v in env.items() if k not in LATE)))
    with _lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            for old in [k for k in _servers if k[0] != os.getpid()]:  # (a fork of the driver: not its servers)
                del _servers[old]
            while len(_servers) >= KEPT:
                _servers.pop(next(iter(_servers))).stop()
            server = _servers[key] = _Server(env)
        else:
            _servers[key] = _servers.pop(key)  # (the most recent last)
        return server


class _Server:
    def __init__(self, env: dict):
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        started: queue.Queue = queue.Queue()
        # Started from a thread that lives as long as the server: its parent-death signal comes when the thread
        # that started it ends, and a launch may come from a thread that ends before the driver does.
        threading.Thread(target=self._keep, args=(env, theirs, started), daemon=True,
                         name="xtrain-agent-forkserver").start()
        self._proc = started.get()
        theirs.close()
        if isinstance(self._proc, BaseException):
            raise OSError(f"could not start: {self._proc}")
        if self._control.recv(16) != b"ready":
            self._proc.wait()
            raise OSError(f"ended as it started (exit code {self._proc.returncode})")

    def _keep(self, env: dict, theirs: socket.socket, started: queue.Queue) -> None:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "xtrain.launch.forkserver", str(theirs.fileno()), " " * TITLE],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=lambda: stopping.end_with_parent(signal.SIGKILL))
        except OSError as err:
            started.put(err)
            return
        started.put(proc)
        proc.wait()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> None:
        self._control.close()  # (it ends as it reads that; its agents run on until they end)

    def fork(self, args: list[str], env: dict, preexec: str) -> Forked:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        request = {"args": args, "env": env, "cwd": os.getcwd(), "preexec": preexec, "umask": _umask(),
                   "ignored": [int(s) for s in stopping.GRACEFUL if signal.getsignal(s) is signal.SIG_IGN]}
        try:
            with self._lock:
                socket.send_fds(self._control, [json.dumps(request).encode()], [theirs.fileno(), 0, out_w, err_w])
            pid = _receive(ours)
        except OSError:
            for fd in (out_r, err_r):
                os.close(fd)
            ours.close()
            raise
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            theirs.close()
        if not pid:
            os.close(out_r)
            os.close(err_r)
            raise OSError("it did not fork the agent")
        return Forked(args, pid, ours, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))


def _receive(sock: socket.socket) -> int | None:
    data = sock.recv(8, socket.MSG_WAITALL)
    return struct.unpack("q", data)[0] if len(data) == 8 else None


def _send(sock: socket.socket, number: int) -> None:
    try:
        sock.sendall(struct.pack("q", number))
    except OSError:  # (the driver is gone)
        pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------- the server's side


def serve(control: socket.socket) -> None:
    """Import what every agent imports, then fork one for each request until the driver closes `control`."""
    from xtrain.launch import agent

    for s in IGNORED:
        signal.signal(s, signal.SIG_IGN)
    agent.preload("xtrain.launch.worker")
    _retitle(["xtrain.launch.forkserver:", "torchrun agents of", f"pid {os.getppid()}"])
    woken_r, woken_w = os.pipe()
    os.set_blocking(woken_w, False)
    signal.set_wakeup_fd(woken_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (it wakes the loop below, which reaps)
    control.send(b"ready")
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(woken_r, selectors.EVENT_READ)
    reports: dict[int, socket.socket] = {}
    done = False  # the driver is done with this server: it ends once its agents have
    while not (done and not reports):
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is woken_r:
                os.read(woken_r, 4096)
                continue
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 4)
            if not message:
                done = True
                selector.unregister(control)
                continue
            report = socket.socket(fileno=fds[0])
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                for fd in (woken_r, woken_w, ready_r):
                    os.close(fd)
                selector.close()
                control.close()
                _run_agent(json.loads(message), fds[1:], ready_w)
            for fd in (*fds[1:], ready_w):
                os.close(fd)
            # as Popen returns: once the agent is what it will run as (or has ended before)
            while True:
                try:
                    os.read(ready_r, 1)
                    break
                except InterruptedError:
                    continue
            os.close(ready_r)
            _send(report, pid)
            reports[pid] = report
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if (report := reports.pop(pid, None)) is not None:
                _send(report, os.waitstatus_to_exitcode(status))
                report.close()


def _run_agent(request: dict, std: list[int], ready: int) -> None:
    """In the fork: become the process `Popen(request["args"], ...)` would have started (then say so on `ready`),
    and run the agent."""
    code = 1
    try:
        _retitle(request["args"])
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGCHLD, *IGNORED):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s in request["ignored"]:
            signal.signal(s, signal.SIG_IGN)
        os.setsid()
        for target, fd in enumerate(std):
            os.dup2(fd, target)
        if ready < 3:  # (kept apart from what closerange closes)
            ready = os.dup(ready)
        os.dup2(ready, 3)
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))
        os.umask(request["umask"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = os.getcwd()  # (`python -m`'s first entry: the directory it was started in)
        from xtrain.launch import agent

        preexec_of(request["preexec"])()
        sys.argv = [agent.__file__, *request["args"][3:]]
        os.close(3)  # (the server reads its end's close: this process is ready)
        agent.main()
        code = 0
    except SystemExit as exit_:
        if isinstance(exit_.code, int) or exit_.code is None:
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:  # what the interpreter would print before exiting 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _retitle(args: list[str]) -> None:
    """This process's command line (`/proc/PID/cmdline`, what `ps` shows) made `args`, in the room its own had."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # (arg_start, arg_end: stat's 48th and 49th)
        import ctypes

        text = "\0".join(args).encode()[: end - start - 1]
        ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)
    except (OSError, ValueError, IndexError):
        pass


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
