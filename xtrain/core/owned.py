"""xtrain writes only into what is empty or its own, and removes or replaces only what it wrote.

- A run dir is xtrain's when its `run.yaml` is a run config (xtrain writes it before anything else), or when it
  holds nothing but xtrain's checkpoints (copied in to resume from); a sweep dir when it holds `sweep.json`. A run,
  a sweep or a study goes into a folder that is not there, is empty, or is xtrain's; any other folder is refused
  before anything is written, naming what it holds.
- `/`, a home directory and the system's own folders are never a run dir, however they are reached (a symlink).
- A folder xtrain replaces (`model/`, a LoRA run's `adapter/`) lists its files in `MANIFEST` (names, sizes,
  sha256), written last at export: a folder holding a file the manifest does not list is not replaced.
- `checkpoints/` holds only xtrain's names: `step_N` (its state file lists its files), `.tmp-*` saves in flight and
  `step_N.corrupt` set aside.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from xtrain.core.files import write_atomic

MANIFEST = "xtrain_files.json"  # in model/ (and adapter/): {name: {"bytes", "sha256"}} of every file xtrain wrote there

SYSTEM_DIRS = frozenset({"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media", "/mnt",
                         "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var",
                         "/usr/bin", "/usr/lib", "/usr/local", "/usr/share", "/var/lib", "/var/tmp"})

_RUN_KEYS = {"run_dir", "trainer", "strategy", "cluster"}  # top-level keys every run.yaml has
_CHECKPOINT_ENTRY = re.compile(r"^(step_\d{8}(\.corrupt(\.\d+)?)?|\.tmp-.*)$")
_SHOWN = 4


def _shown(names: list[str]) -> str:
    more = f", and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _entries(path: Path) -> list[str]:
    """What a folder holds, its own lock record aside (`.lock`: xtrain's while it holds the JSON record it writes)."""
    names = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name == ".lock" and _is_lock_record(Path(entry.path)):
            continue
        names.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
    return names


def _is_lock_record(path: Path) -> bool:
    try:
        record = json.loads(path.read_text()[:4096] or "{}")
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and (not record or {"pid", "host"} <= record.keys())


def is_run_dir(path: Path) -> bool:
    """`path` holds a run xtrain wrote: its run.yaml is a run config (its top-level keys read from the YAML's nodes,
    never built: a file of someone else's is not expanded)."""
    import yaml

    file = Path(path) / "run.yaml"
    try:
        if not file.is_file() or file.stat().st_size > 4 << 20:
            return False
        node = yaml.compose(file.read_text(), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
        return False
    keys = {k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)} if isinstance(node, yaml.MappingNode) else set()
    return _RUN_KEYS <= keys


def system_refusal(path: Path, setting: str) -> str | None:
    """`path` resolves to `/`, a home directory or a system folder."""
    real = os.path.realpath(path)
    homes = {os.path.realpath(Path.home())}
    what = ("your home directory" if real in homes or os.path.dirname(real) == "/home" else
            "a system directory" if real in SYSTEM_DIRS else None)
    if what is None:
        return None
    shown = f"{path} ({real})" if str(real) != str(path) else str(path)
    return (f"{setting}={shown}: is {what}; xtrain writes a run into a folder of its own: "
            f"choose one, e.g. {setting}=runs/<name>")


def _folder(path: Path, setting: str) -> tuple[str | None, list[str]]:
    """A refusal of `path` whatever it holds (a system folder, a file), or what it holds (nothing: not there)."""
    why = system_refusal(path, setting)
    if why or not os.path.lexists(path):
        return why, []
    if not path.is_dir():
        return f"{setting}={path}: is a file, not a folder; choose a new {setting}", []
    return None, _entries(path)


def run_dir_refusal(path: str | Path, setting: str = "run_dir") -> str | None:
    """Why a run may not write into `path`: a system or home directory, a file, or a folder that holds files and no
    run. None where it may (not there yet, empty, or a run dir)."""
    path = Path(path)
    why, entries = _folder(path, setting)
    if why or not entries or is_run_dir(path) or _checkpoints_only(path, entries):
        return why
    if (path / "sweep.json").is_file():
        return f"{setting}={path}: holds a sweep, not a run; choose a new {setting} (or run the sweep with -m)"
    return (f"{setting}={path}: holds files that are not an xtrain run's ({_shown(entries)}); xtrain writes only "
            f"into an empty folder or a run dir: choose a new {setting}")


def _checkpoints_only(path: Path, entries: list[str]) -> bool:
    """A folder that holds xtrain's checkpoints and nothing else (copied in to resume from: `resume=auto`)."""
    root = path / "checkpoints"
    return entries == ["checkpoints/"] and any(os.scandir(root)) and not checkpoints_foreign(root)


def sweep_dir_refusal(path: str | Path, setting: str = "run_dir") -> str | None:
    """Why a sweep or a study may not write into `path`: as for a run dir, where a sweep dir holds `sweep.json`
    (and Hydra's `multirun.yaml`, which Hydra writes there before xtrain is asked)."""
    path = Path(path)
    why, entries = _folder(path, setting)
    entries = [e for e in entries if e != "multirun.yaml"]
    if why or not entries or (path / "sweep.json").is_file():
        return why
    if is_run_dir(path):
        return f"{setting}={path}: holds a run, not a sweep; choose a new {setting}"
    return (f"{setting}={path}: holds files that are not an xtrain sweep's ({_shown(entries)}); xtrain writes only "
            f"into an empty folder or a sweep dir: choose a new {setting}")


# ---------------------------------------------------------------- folders xtrain replaces: model/, adapter/


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """The folder's files (every one below it), with their sizes and digests, written last."""
    files = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[file.relative_to(folder).as_posix()] = {"bytes": file.stat().st_size, "sha256": file_digest(file)}
    write_atomic(folder / MANIFEST, json.dumps({"files": files}, indent=2) + "\n")


def read_manifest(folder: Path) -> dict | None:
    """The manifest's files, or None where it is missing or cannot be read."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def foreign_files(folder: Path, legacy_ok: bool = False) -> list[str]:
    """The files in `folder` xtrain did not write: those its manifest does not list (all of them, where it has
    none; `legacy_ok`: a folder an earlier xtrain exported, with no manifest, is taken as xtrain's)."""
    if not os.path.lexists(folder):
        return []
    if folder.is_symlink() or not folder.is_dir():
        return [folder.name]
    listed = read_manifest(folder)
    found = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir() or p.is_symlink())
    if listed is None:
        return [] if legacy_ok else found
    return [name for name in found if name != MANIFEST and name not in listed]


def manifest_damage(folder: Path) -> str | None:
    """What differs between `folder` and its manifest (a file missing, cut, or changed), in a few words; None where it
    matches or there is no manifest to check (an earlier xtrain's export)."""
    listed = read_manifest(folder)
    if listed is None:
        return f"its {MANIFEST} cannot be read" if (folder / MANIFEST).exists() else None
    for name, want in listed.items():
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want.get("bytes"):
            return f"{name} holds {file.stat().st_size:,} bytes, {want.get('bytes', 0):,} were written"
    for name, want in listed.items():
        if file_digest(folder / name) != want.get("sha256"):
            return f"{name} does not match the checksum it was written with"
    return None


def checkpoints_foreign(root: Path) -> list[str]:
    """Entries of `checkpoints/` that are not xtrain's names."""
    if not root.is_dir():
        return [root.name] if os.path.lexists(root) else []
    return [e for e in _entries(root) if not _CHECKPOINT_ENTRY.match(e.rstrip("/"))]


EXPORTED = ("model", "adapter")  # the folders a run's export replaces


def export_foreign(run_dir: Path, name: str) -> list[str]:
    """The files in the run dir's export folder `name` (model/, adapter/) that xtrain did not write. A folder with no
    manifest is an earlier xtrain's where result.json records an export (`model_step`)."""
    try:
        exported_before = '"model_step"' in (Path(run_dir) / "result.json").read_text()
    except (OSError, UnicodeDecodeError):
        exported_before = False
    return foreign_files(Path(run_dir) / name, legacy_ok=exported_before)


def parts_refusal(run_dir: str | Path, setting: str = "run_dir") -> str | None:
    """Why a run dir's own folders may not be replaced or pruned: `model/` or `adapter/` holding files its manifest
    does not list, `checkpoints/` holding other names than xtrain's."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    for name in EXPORTED:
        foreign = export_foreign(run_dir, name)
        if foreign:
            return (f"{setting}={run_dir}: {name}/ holds files xtrain did not write ({_shown(foreign)}); a run replaces "
                    f"{name}/ when it exports: move them out of it, or choose a new {setting}")
    foreign = checkpoints_foreign(run_dir / "checkpoints")
    if foreign:
        return (f"{setting}={run_dir}: checkpoints/ holds files xtrain did not write ({_shown(foreign)}); a run prunes "
                f"checkpoints/ as it saves: move them out of it, or choose a new {setting}")
    return None


def check_run_dir(run_dir: str | Path, setting: str = "run_dir", parts: bool = True) -> None:
    """A ConfigError where a run may not write into `run_dir` (`run_dir_refusal`; `parts`: `parts_refusal` too)."""
    from xtrain.core.errors import ConfigError

    why = run_dir_refusal(run_dir, setting) or (parts and parts_refusal(run_dir, setting))
    if why:
        raise ConfigError(why)


def check_sweep_dir(sweep_dir: str | Path, setting: str = "run_dir") -> None:
    from xtrain.core.errors import ConfigError

    why = sweep_dir_refusal(sweep_dir, setting)
    if why:
        raise ConfigError(why)
