"""The cache's entries: a directory under `data.cache_dir`, keyed by its content, written once.

An entry is written beside its final name under a lock and renamed into place: two preparers never both write it
(the second waits, then reuses it), and one that is killed leaves only a `.tmp-` dir, which the next preparer
removes before it starts again. The held-out split is drawn by the data's own seed, so it is a property of the data.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger("xtrain")

VAL_SPLIT_SEED = 1234  # the split is a property of the data, not of trainer.seed


def held_out(n: int, fraction: float) -> np.ndarray:
    """The held-out records of `n` (at least one): a draw of `fraction` by the data's own seed, sorted."""
    return np.sort(np.random.default_rng(VAL_SPLIT_SEED).permutation(n)[: max(1, round(n * fraction))])


def split_rows(held: np.ndarray, n: int, split: str) -> np.ndarray:
    """The rows of `split` (train or val) of `n` records, `held` being the val rows."""
    if split == "val":
        return held
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    return np.flatnonzero(keep)


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@contextlib.contextmanager
def locked(final: Path, what: str):
    """Hold `<final>.lock` (flock: released by the kernel when its holder dies, even by SIGKILL)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("data: waiting for another process that prepares %s (%s)", what, final)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_once(final: Path, write, what: str) -> bool:
    """Write the directory `final` with `write(tmp)` unless it exists; True if it was written here."""
    if final.exists():
        return False
    with locked(final, what):
        if final.exists():
            return False
        for stale in final.parent.glob(f".tmp-{final.name}-*"):  # a preparer killed half-way
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
        try:
            write(tmp)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return True


