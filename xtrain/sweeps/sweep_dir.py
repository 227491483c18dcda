"""A sweep refused before it ran, or only planned (a dry run), leaves its sweep dir as it found it.

Hydra's sweeper writes multirun.yaml into the sweep dir before the launcher checks any point. `kept()` wraps a
command: while it runs, the launcher notes what the dir held (`note`); a refusal that ends the command, or a dry
run (`restore`), puts it back: multirun.yaml as it was, the dir gone where it was not there. Once a point is written
into it (`keep`), it stays.
"""

from __future__ import annotations

import contextlib
import shutil
from contextvars import ContextVar
from pathlib import Path


class SweepDir:
    def __init__(self):
        self.path: Path | None = None
        self.existed = False
        self.record: bytes | None = None

    def note(self, path: Path) -> None:
        record = path / "multirun.yaml"
        self.path, self.existed = path, path.exists()
        self.record = record.read_bytes() if record.exists() else None

    def restore(self) -> None:
        if self.path is None:
            return
        if self.record is not None:
            (self.path / "multirun.yaml").write_bytes(self.record)
        elif not self.existed:
            shutil.rmtree(self.path, ignore_errors=True)
        else:  # (Hydra wrote it into a folder that was there: the folder as it was)
            (self.path / "multirun.yaml").unlink(missing_ok=True)
        self.path = None


    def keep(self) -> None:
        """Points are written into it: from now on it is a sweep's, refused or not."""
        self.path = None


_current: ContextVar[SweepDir | None] = ContextVar("sweep_dir", default=None)


@contextlib.contextmanager
def kept(*refusals: type[BaseException]):
    """While the block runs, a sweep's dir is noted; a `refusals` exception that ends it restores the dir."""
    kept_dir = SweepDir()
    token = _current.set(kept_dir)
    try:
        yield kept_dir
    except refusals:
        kept_dir.restore()
        raise
    finally:
        _current.reset(token)


def note(path: Path) -> None:
    """The launcher, before any point is checked: what the sweep dir holds now."""
    if _current.get() is not None:
        _current.get().note(path)


def keep() -> None:
    """Points were written (a batched sweeper's later batch may still be refused): nothing to restore."""
    if _current.get() is not None:
        _current.get().keep()


def restore() -> None:
    """A dry run's end: the sweep dir as `note` found it."""
    if _current.get() is not None:
        _current.get().restore()
