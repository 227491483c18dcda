"""Stop requests: a signal only sets a flag; training ends at the next step boundary.

The loop agrees on the flag across ranks (in the step's one all-reduce), every rank saves a
checkpoint, and the run ends `interrupted`, resumable with `resume=auto` (under SLURM the job
requeues itself). Which signals ask for this depends on the process:

- the process that trains in-process (one process), and the driver of N workers: SIGINT (Ctrl-C), SIGTERM,
  SIGHUP (its terminal closed), SIGUSR1, SIGUSR2 (a spot instance's notice, SLURM's `--signal` warning, a workload
  manager);
- a worker under torchrun: SIGUSR1, SIGUSR2 only; torchrun ends workers with SIGTERM when another
  rank failed, and that must stop at once (`errors.Terminated`).

A second request while the first is pending stops at once (KeyboardInterrupt), as a second Ctrl-C would
(not in workers: their driver repeats the request until they end).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

GRACEFUL = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
IN_WORKERS = (signal.SIGUSR1, signal.SIGUSR2)
DRIVER_ENV = "XTRAIN_DRIVER_PID"  # set for the workers of a local run: the process they never outlive

_request: dict = {}  # {"signal": "SIGUSR2", "at": epoch seconds} once asked
_escalate = [True]


def requested() -> dict | None:
    """{"signal": name, "at": time} if a stop was asked for in this process."""
    return dict(_request) if _request else None


def request(signum: int) -> None:
    if _request:
        if not _escalate[0]:
            return
        raise KeyboardInterrupt(f"stopped at once by a second {signal.Signals(signum).name}")
    _request.update({"signal": signal.Signals(signum).name, "at": time.time()})
    if _escalate[0]:  # (a worker's driver says it)
        logging.getLogger("xtrain").info("%s: stopping at the next step boundary, with a checkpoint (again: at once)",
                                         signal.Signals(signum).name)


def clear() -> None:
    _request.clear()


def _on_signal(signum, frame) -> None:
    request(signum)


_depth = [0]


@contextlib.contextmanager
def on(signals=GRACEFUL, escalate: bool = True):
    """Inside: these signals ask for a stop at the next step boundary (main thread only; elsewhere a no-op).
    Nested uses share the outermost one's request. `escalate=False` (workers, whose driver repeats its
    request until they end): a second signal changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _depth[0]:
        clear()
        _escalate[0] = escalate
    _depth[0] += 1
    previous = {s: signal.signal(s, _on_signal) for s in signals}
    if not escalate:  # a request, from SLURM to every process of the step and then from the driver, must not
        for s in signals:  # fail the system call the C++ below is in (a collective's socket read): restart it
            signal.siginterrupt(s, False)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _depth[0] -= 1
        if not _depth[0]:
            clear()


def ignore_in_child() -> None:
    """preexec_fn for torchrun: it ignores the stop signals (SIGUSR1/2 would kill it: their default action),
    and its workers start ignoring them until they install their own handlers."""
    for s in IN_WORKERS:
        signal.signal(s, signal.SIG_IGN)


def end_with_parent(signum: int = signal.SIGTERM) -> None:
    """This process gets `signum` when its parent dies (Linux's parent-death signal), however the parent died (a
    SIGKILL, the OOM killer): torchrun when its driver does, a worker when its torchrun does. Elsewhere a no-op."""
    import ctypes
    import os
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signum)


def driver_gone() -> bool:
    """A local run's driver has ended (killed outright): its workers are being ended with it, and a rank whose
    collective failed because another rank ended first was stopped, not failed."""
    import os

    import psutil

    pid = int(os.environ.get(DRIVER_ENV, "0"))
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
