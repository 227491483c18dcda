"""Atomic file and directory replacement: readers see the old version or the new one, never half."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory `tmp` to `final`, replacing what was there."""
    if final.exists():
        old = final.with_name(f".tmp-old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
