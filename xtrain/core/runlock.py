"""One trainer per run dir: `<run dir>/.lock`, held by the process that trains into it, and naming that process.

The lock is the kernel's (`flock`, which NFS and Lustre mounted with `flock` carry between machines): it ends
with the process that holds it, however that process ends (kill -9 included), and the next trainer takes it over.
On a filesystem without locks the file's record alone decides: a live process recorded on this machine holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import time
from pathlib import Path

from xtrain.core import owned
from xtrain.core.errors import ConfigError

LOCK = ".lock"

_held: dict[str, list] = {}  # the run dirs this process holds: real path -> [fd, depth]


SAME_JOB_WAIT_S = 180  # a requeued SLURM job waits this long for its own attempt before's lock (a lost node's)
_JOBS = {"slurm_job": "SLURM_JOB_ID", "ray_run": "XTRAIN_RAY_RUN"}  # the lock record's key: the job's variable


def _record() -> dict:
    from xtrain.core.rundir import this_process

    job = {key: os.environ[env] for key, env in _JOBS.items() if os.environ.get(env)}
    return {**this_process(), **job, "command": " ".join(sys.argv)[:300]}


def _same_job(holder: dict) -> bool:
    """The holder is this SLURM job's or Ray run's attempt before (restarted from a node that was lost: a shared
    filesystem lets go of a lost machine's lock only once its lease runs out)."""
    return any(holder.get(key) and holder.get(key) == os.environ.get(env) for key, env in _JOBS.items())


def _busy(run_dir: Path, holder: dict) -> ConfigError:
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"])) if holder.get("started") else "?"
    command = holder.get("command") or ""
    command = f": {command[:100]}{'...' if len(command) > 100 else ''}" if command else ""
    return ConfigError(
        f"run_dir={run_dir}: another process trains into it now (pid {pid} on {host}, started {since}{command}); "
        f"wait for it to end, stop it (kill -TERM {pid} saves a checkpoint; then resume=auto), or choose another run_dir"
    )


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _no_locks(err: OSError) -> bool:
    return err.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def _take(run_dir: Path) -> int | None:
    """The lock's file descriptor, held (None: this filesystem has no locks, and no live process holds the record)."""
    path = run_dir / LOCK
    deadline = time.monotonic() + SAME_JOB_WAIT_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                holder = _read(path)
                if _same_job(holder) and time.monotonic() < deadline:
                    time.sleep(1.0)
                    continue
                raise _busy(run_dir, holder) from None
            if not _no_locks(err):
                raise
            _check_record(run_dir)
            return None
        try:  # (the holder before removed the file as it let go: lock the one that is there now)
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _check_record(run_dir: Path) -> None:
    from xtrain.core.rundir import process_gone

    holder = _read(run_dir / LOCK)
    if holder and holder.get("pid") != os.getpid() and not process_gone(holder) and _here(holder):
        raise _busy(run_dir, holder)


def _here(holder: dict) -> bool:
    import socket

    return holder.get("host") == socket.gethostname()


@contextlib.contextmanager
def holding(run_dir: str | Path, take: bool = True):
    """This process trains into `run_dir` (created if need be) until the block ends; a ConfigError naming the live
    process that does already. Nested holds of one run dir in one process are one. `take=False`: nothing (another
    node of the run holds it)."""
    run_dir = Path(run_dir)
    key = os.path.realpath(run_dir)
    if not take or key in _held:
        if take:
            _held[key][1] += 1
        try:
            yield
        finally:
            if take:
                _held[key][1] -= 1
        return
    owned.check_run_dir(run_dir, parts=False)  # (before its lock file is written: a user's folder stays as it is)
    check_writable(run_dir)
    made = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # (removed again if left empty)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = _take(run_dir)
    except OSError as err:
        _remove_empty(made)
        raise ConfigError(f"run_dir={run_dir}: cannot be written ({err.strerror}); choose a run_dir you can write") from None
    except BaseException:
        _remove_empty(made)
        raise
    record = json.dumps(_record()) + "\n"
    if fd is None:
        (run_dir / LOCK).write_text(record)
    else:
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
    _held[key] = [fd, 1]
    try:
        yield
    finally:
        del _held[key]
        with contextlib.suppress(OSError):
            (run_dir / LOCK).unlink()  # (while still held: a process that opened it before finds it gone, and retries)
        if fd is not None:
            os.close(fd)
        _remove_empty(made)


def _remove_empty(made: list[Path]) -> None:
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()  # (only where empty)


def check_writable(run_dir: Path) -> None:
    """A ConfigError where `run_dir` (or, not there yet, the folder it would be made in) cannot be written."""
    there = next(d for d in (run_dir, *run_dir.parents) if d.exists())
    if there.is_dir() and not os.access(there, os.W_OK | os.X_OK):
        why = "a read-only filesystem" if _read_only(there) else "no permission to write"
        raise ConfigError(f"run_dir={run_dir}: cannot be written ({why} at {there}); choose a run_dir you can write")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_free(run_dir: str | Path) -> None:
    """A ConfigError where `run_dir` is not a folder a run may write into (owned.py), cannot be written, or naming
    the live process that trains into it now, if
    another one does."""
    run_dir = Path(run_dir)
    owned.check_run_dir(run_dir, parts=False)
    check_writable(run_dir)
    path = run_dir / LOCK
    if os.path.realpath(run_dir) in _held or not path.exists():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise _busy(run_dir, _read(path)) from None
        if not _no_locks(err):
            raise
        _check_record(run_dir)
    finally:
        os.close(fd)
