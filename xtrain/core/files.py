"""Replacing files and directories so that a reader sees the old version or the new one, never half.

`write_atomic`: the text goes to a temp file of its own (a unique name: two writers at once never share
one), is flushed to disk, renamed over the target, and the directory entry is flushed too.

`replace_dir`: Linux's `renameat2(RENAME_EXCHANGE)` swaps the finished directory with the old one in
one step, on filesystems that support it (ext4, xfs, btrfs, tmpfs, overlayfs). Where it does not (NFS,
Lustre, other kernels), it is two renames: for that moment the old version is at `.tmp-old-<name>` and
`<name>` is missing.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from pathlib import Path

from xtrain.core.errors import one_line
from xtrain.core.memory import size

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def keep_private() -> None:
    """What this process (and what it starts) creates is never group- or world-writable, whatever the umask: a
    checkpoint or a pickle that someone else can replace runs their code as you when it is loaded."""
    os.umask(os.umask(0) | 0o022)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str | bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step; False where this system or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(a))


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory `tmp` to `final`, replacing what was there."""
    tmp, final = Path(tmp), Path(final)
    if not final.exists():
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        shutil.rmtree(tmp)  # now the old version
    else:
        old = final.with_name(f".tmp-old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    fsync_dir(final.parent)


def write_failure(err: Exception, what: str, where: Path, need: int, kept: str, run_dir: str | Path) -> str:
    """Why `what` could not be written to `where`, in one line: what it needed, what is `kept`, how to go on."""
    chain, cause = [], err
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    code = next((e.errno for e in chain if isinstance(e, OSError) and e.errno), None)  # (torch.save hides it)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = None
    if code == errno.ENOSPC or code is None and free is not None and free < need:
        why = f"no space left on the device (it takes about {size(need)}, {size(free or 0)} is free)"
    elif code == errno.EROFS:
        why = "its filesystem is read-only"
    elif code in (errno.EACCES, errno.EPERM):
        why = "permission denied"
    else:
        why = one_line(err)
    return (f"{what} could not be written to {where}: {why}; its partial files are removed and {kept}; make room "
            f"(or fix that), then run the same command with run_dir={run_dir} resume=auto")
