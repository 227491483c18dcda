"""Checkpoints in `<run dir>/checkpoints/step_XXXXXXXX`: written aside, renamed into place, verified, pruned.

A checkpoint is an Accelerate state (`save_state`) plus `xtrain_state.json` (step,
tokens seen, model identity, each file's size and digest). A directory without that file is not a
checkpoint: the file is written last, after every file and directory is on disk (fsync), just before the
rename, so a kill at any moment leaves either the previous newest checkpoint or a complete new one. A
checkpoint whose files no longer match (a disk's or a copy's corruption) is not resumed from: `resume=auto`
takes the newest that passes, and sets the others aside (`step_XXXXXXXX.corrupt`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from xtrain.core.errors import ConfigError, WriteFailed
from xtrain.core import files
from xtrain.core.files import fsync_dir, replace_dir
from xtrain.config import schema
from xtrain.parallel import dims
from xtrain.engine import reshard
from xtrain.core.rundir import CHECKPOINT_NAME, CHECKPOINT_STATE, checkpoint_name, checkpoints_dir, complete_checkpoints

log = logging.getLogger("xtrain")


FILES = "files"  # xtrain_state.json's record of every other file: {relative path: {"bytes", "sha256"}}
SET_ASIDE = ".corrupt"  # the suffix of a checkpoint that failed its check, kept for a look, never resumed from


def newest(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_state(path: str | Path) -> dict:
    """A checkpoint's state: its step, counters and the config it trained with (as this version's schema has it)."""
    state = json.loads((Path(path) / CHECKPOINT_STATE).read_text())
    if isinstance(state.get("config"), dict):
        state["config"] = schema.upgraded(state["config"])
    return state


PIECE = 16 << 20  # a file is hashed in pieces of this size, in parallel: its digest is the SHA-256 of theirs


def _digests(files: list[Path], sync: bool = False) -> list[str]:
    """Each file's digest: the SHA-256 of the SHA-256s of its 16 MiB pieces, hashed on up to 8 threads (hashlib and
    reads let go of the GIL: several GB/s where one SHA-256 stream gives ~0.6). `sync`: each file flushed to disk."""
    from concurrent.futures import ThreadPoolExecutor

    def piece(job: tuple[int, int]) -> bytes:
        fd, offset = job
        return hashlib.sha256(os.pread(fd, PIECE, offset)).digest()

    fds = [os.open(file, os.O_RDONLY) for file in files]
    try:
        jobs = [[(fd, offset) for offset in range(0, max(os.fstat(fd).st_size, 1), PIECE)] for fd in fds]
        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
            pieces = [list(pool.map(piece, file_jobs)) for file_jobs in jobs]
        if sync:
            for fd in fds:
                os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return [hashlib.sha256(b"".join(parts)).hexdigest() for parts in pieces]


def record_files(path: Path) -> dict:
    """Every file under the checkpoint being written at `path`: its size and digest, each file and directory
    flushed to disk on the way."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    digests = _digests(files, sync=True)
    for folder in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(folder)
    return {file.relative_to(path).as_posix(): {"bytes": file.stat().st_size, "sha256": digest}
            for file, digest in zip(files, digests)}


_checked: dict[tuple, str | None] = {}  # (path, each file's size and mtime) -> `failure`'s answer, in this process


def failure(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from (its state file unreadable, a file missing, cut short or
    changed since it was written); None where it passes. A checkpoint written before checksums were recorded passes
    on its state file alone."""
    try:
        key = (str(path), *sorted((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in Path(path).rglob("*")))
        if key in _checked:
            return _checked[key]
        state = read_state(path)
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no step recorded")
    except (OSError, ValueError) as err:
        return f"its {CHECKPOINT_STATE} cannot be read ({type(err).__name__}: {err})"
    why = None
    recorded = state.get(FILES, {})
    for name, want in recorded.items():
        file = Path(path) / name
        held = file.stat().st_size if file.is_file() else None
        if held is None:
            why = f"{name} is missing"
        elif held != want["bytes"]:
            why = f"{name} holds {held:,} bytes, {want['bytes']:,} were written"
        if why:
            break
    names = list(recorded) if why is None else []
    for name, digest in zip(names, _digests([Path(path) / name for name in names])):
        if digest != recorded[name]["sha256"]:
            why = f"{name} does not match the checksum it was written with"
            break
    _checked[key] = why
    return why


def set_aside(path: Path) -> Path:
    """Move a checkpoint that failed its check out of the way (`step_N.corrupt`, or `.corrupt.2` ...): kept for a
    look, never resumed from or pruned."""
    target, n = path.with_name(path.name + SET_ASIDE), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{SET_ASIDE}.{n}")
    os.rename(path, target)
    return target


def newest_passing(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that passes its check, and the newer ones that fail it (newest first, with why)."""
    failing = []
    for path in reversed(complete_checkpoints(run_dir)):
        why = failure(path)
        if why is None:
            return path, failing
        failing.append((path, why))
    return None, failing


def _refuse_none_pass(resume: str, failing: list[tuple[Path, str]]) -> None:
    listed = "; ".join(f"{path.name}: {why}" for path, why in failing)
    raise ConfigError(f"resume={resume}: no checkpoint passes its check ({listed}); start again with resume=none "
                      "in a new run_dir, or give resume=<a checkpoint directory> copied from elsewhere")


_reported: set[str] = set()


def _report(failing: list[tuple[Path, str]], chosen: Path) -> None:
    for path, why in failing:
        if str(path) not in _reported:
            _reported.add(str(path))
            log.warning("checkpoint %s fails its check: %s; resuming from %s instead", path, why, chosen.name)


def set_aside_failing(run_dir: str | Path, resume: str = "auto") -> list[dict]:
    """The main process, as a run resumes its own newest checkpoint: the newer ones that fail their check are set
    aside, each named in a line; what was set aside (for the restart's record). A ConfigError where none passes."""
    chosen, failing = newest_passing(run_dir)
    if failing and chosen is None:
        _refuse_none_pass(resume, failing)
    moved = []
    for path, why in failing:
        target = set_aside(path)
        log.warning("checkpoint %s fails its check: %s; set aside as %s, resuming from %s", path, why, target.name,
                    chosen.name)
        moved.append({"checkpoint": path.name, "why": why, "set_aside": target.name})
    return moved


def identity(cfg, task=None) -> dict:
    """What a checkpoint records of the run that wrote it: the model (a resume must match it), the strategy and the
    number of processes (a resume may move them: reshard.py) (`task`: the run's, where it has one already)."""
    from xtrain.tasks.registry import task_for

    return {**(task or task_for(cfg)).identity(), "strategy": cfg.strategy.name.value,
            "processes": cfg.cluster.world_size}


_resolved: dict[tuple, Path | None] = {}  # `resolve`'s answers in this process, by everything they follow from


def resolve(resume: str, run_dir: str | Path, expected: dict, cfg, checked: bool = False) -> Path | None:
    """The checkpoint to resume from (None: fresh start), checked against this run's `identity`: the same model, and
    one that can move to this run's strategy and world; and its files against their checksums, unless `checked` (the
    main process did, and set aside what failed: `set_aside_failing`). Worked out once per process for the same
    question and the same checkpoints on disk (the driver asks as it resolves, checks and writes the run dir)."""
    if resume == "none":
        return None
    key = (resume, str(run_dir), json.dumps(expected, sort_keys=True, default=str), repr(cfg.strategy),
           cfg.cluster.world_size, cfg.model.lora.enabled, checked, _on_disk(run_dir, resume))
    if key not in _resolved:  # (a refusal is not kept: it is raised again)
        _resolved[key] = _resolve(resume, run_dir, expected, cfg, checked)
    return _resolved[key]


def _on_disk(run_dir: str | Path, resume: str) -> tuple:
    """The checkpoints a resolve would look at, as they are now: each one's name and its state file's time."""
    roots = [checkpoints_dir(run_dir)] if resume == "auto" else [Path(os.path.expanduser(resume)),
                                                                 checkpoints_dir(os.path.expanduser(resume))]
    found = []
    for root in roots:
        with contextlib.suppress(OSError):
            found += [(str(p), (p / CHECKPOINT_STATE).stat().st_mtime_ns if (p / CHECKPOINT_STATE).exists() else None)
                      for p in sorted(root.iterdir())]
    return tuple(found)


def _resolve(resume: str, run_dir: str | Path, expected: dict, cfg, checked: bool) -> Path | None:
    if resume == "auto" and checked:
        path = newest(run_dir)
        if path is None:
            return None
    elif resume == "auto":
        path, failing = newest_passing(run_dir)
        if failing and path is None:
            _refuse_none_pass(resume, failing)
        if path is None:
            return None
        _report(failing, path)
    else:
        path = Path(os.path.expanduser(resume))
        if not path.exists():
            raise ConfigError(f"resume={resume}: no such checkpoint; use resume=auto, resume=none or a checkpoint directory")
        if not (path / CHECKPOINT_STATE).is_file():
            newest_inside, failing = newest_passing(path)
            if failing and newest_inside is None:
                _refuse_none_pass(resume, failing)
            if newest_inside is None:
                raise ConfigError(
                    f"resume={resume}: not an xtrain checkpoint (no {CHECKPOINT_STATE}); "
                    "give <run dir>/checkpoints/step_N or a run dir that has checkpoints"
                )
            _report(failing, newest_inside)
            path = newest_inside
        why = None if checked else failure(path)
        if why:
            named = "" if Path(os.path.expanduser(resume)) == path else f" {path}"  # (the checkpoint inside a run dir)
            raise ConfigError(f"resume={resume}:{named} fails its check: {why}; give another checkpoint")
    state = read_state(path)
    saved, wanted = state.get("model", {}), expected["model"]
    if saved != wanted:
        differ = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs run {wanted.get(k)!r}" for k in differ)
        raise ConfigError(f"resume={resume}: checkpoint of another model ({detail}); resume with the same model settings")
    why = reshard.refusal(path, state, cfg, cfg.model.lora.enabled)
    if why:
        raise ConfigError(f"resume={resume}: {why}")
    return path


def export_unfinished(run_dir: str | Path, path: Path, max_steps: int) -> bool:
    """The run dir's own checkpoint `path` has trained all `max_steps`, but the run never recorded its end (killed,
    or failed, in its export): resuming it finishes the export."""
    from xtrain.core.rundir import Status, read_result

    return (path.parent == checkpoints_dir(run_dir) and read_state(path)["step"] == max_steps
            and read_result(Path(run_dir)).get("status") != Status.completed.value)


def keep_effective_batch(cfg):
    """`cfg`, resuming: with the grad_accum that keeps its checkpoint's effective batch on this run's processes
    (resume.py)."""
    from xtrain.engine import resume

    if cfg.resume == "none":
        return cfg
    try:
        path = resolve(cfg.resume, cfg.run_dir, identity(cfg), cfg)
    except ConfigError:
        return cfg  # (preflight says why, after the checks that come first)
    if path is None:
        return cfg
    recorded = read_state(path).get("config")
    kept = resume.keep_effective_batch(cfg, recorded, f"resume={cfg.resume}: {path} trained")
    if kept.trainer.grad_accum != cfg.trainer.grad_accum:
        log.info("resume: %d data-parallel processes (the checkpoint's: %d): trainer.grad_accum %d -> %d keeps its "
                 "effective batch of %d", dims.of(cfg).data_parallel, dims.of(schema.from_container(recorded)).data_parallel,
                 cfg.trainer.grad_accum, kept.trainer.grad_accum, dims.effective_batch(kept))
    return kept


def remove_partial(run_dir: str | Path) -> None:
    """Remove leftovers of saves that were interrupted (`.tmp-step_N`: never complete checkpoints). A `step_N` with
    no state file was not written by this xtrain: it is set aside (`step_N.corrupt`), never resumed from or replaced."""
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name.startswith(".tmp-") and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif CHECKPOINT_NAME.match(p.name) and not (p / CHECKPOINT_STATE).is_file():
                log.warning("checkpoints: %s has no %s: set aside as %s", p.name, CHECKPOINT_STATE, set_aside(p).name)


def prune(path: Path) -> None:
    """Remove a complete checkpoint, where it holds only the files its state lists (a file put in it by hand stays,
    and so does the checkpoint)."""
    try:
        listed = set(json.loads((path / CHECKPOINT_STATE).read_text()).get(FILES, {})) | {CHECKPOINT_STATE}
    except (OSError, ValueError):
        listed = None
    held = {p.relative_to(path).as_posix() for p in path.rglob("*") if not p.is_dir() or p.is_symlink()}
    if listed is None or held - listed:
        log.warning("checkpoints: %s is kept (it holds files xtrain did not write: %s)", path,
                    ", ".join(sorted(held - (listed or set()))[:4]))
        return
    shutil.rmtree(path)


def save(accelerator, run_dir: str | Path, step: int, state: dict, keep: int, only_trainable: bool = False) -> Path:
    """Every rank calls this; the main process publishes the checkpoint and prunes old ones. `only_trainable`
    (LoRA): the frozen weights are left out (they are the pretrained model's). A save that fails (the disk full,
    read-only) removes what it wrote and raises WriteFailed: the newest checkpoint before it is kept."""
    tmp = begin(accelerator, run_dir, step)
    try:
        write_state(accelerator, tmp, only_trainable)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            publish(run_dir, tmp, step, state, keep)
    except Exception as err:
        raise failed(accelerator, err, run_dir, tmp, step) from err
    accelerator.wait_for_everyone()
    return checkpoints_dir(run_dir) / checkpoint_name(step)


def begin(accelerator, run_dir: str | Path, step: int) -> Path:
    """Every rank: the directory step `step`'s checkpoint is written into (made empty by the main process)."""
    tmp = checkpoints_dir(run_dir) / f".tmp-{checkpoint_name(step)}"
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    except Exception as err:
        raise failed(accelerator, err, run_dir, tmp, step) from err
    accelerator.wait_for_everyone()
    return tmp


def write_state(accelerator, tmp: Path, only_trainable: bool) -> None:
    """This rank's part of Accelerate's state into `tmp` (staged instead, inside `staging.deferred`)."""
    hook = accelerator.register_save_state_pre_hook(_drop_frozen) if only_trainable else None
    try:
        with _fsdp_adapter_only(accelerator, only_trainable):
            accelerator.save_state(str(tmp), **_frozen_kwargs(accelerator, only_trainable, saving=True))
    finally:
        if hook is not None:
            hook.remove()


def publish(run_dir: str | Path, tmp: Path, step: int, state: dict, keep: int) -> Path:
    """The main process, once every rank's files are in `tmp`: their sizes and digests (each file flushed to disk),
    the state file last, the rename into place; then the oldest complete checkpoints beyond `keep` pruned."""
    final = checkpoints_dir(run_dir) / checkpoint_name(step)
    files = record_files(tmp)
    with open(tmp / CHECKPOINT_STATE, "w") as f:
        f.write(json.dumps({"step": step, **state, FILES: files}, indent=2))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    replace_dir(tmp, final)
    for stale in complete_checkpoints(run_dir)[:-keep]:
        prune(stale)
    return final


def failed(accelerator, err: Exception, run_dir: str | Path, tmp: Path, step: int) -> WriteFailed:
    """Why the save of step `step` failed, in one line; what it wrote is removed (any rank that failed: the space it
    took is given back)."""
    shutil.rmtree(tmp, ignore_errors=True)
    previous = newest(run_dir)
    need = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file()) if previous else _state_bytes(accelerator)
    kept = f"{previous.name} is kept" if previous else "there is no earlier checkpoint"
    return WriteFailed(files.write_failure(err, f"the checkpoint of step {step}", checkpoints_dir(run_dir), need, kept, run_dir))


def _state_bytes(accelerator) -> int:
    """What a checkpoint of this rank's model and optimizer holds, about (where there is none to measure yet)."""
    import torch

    total = sum(t.numel() * t.element_size() for m in accelerator._models for t in m.state_dict().values()
                if torch.is_tensor(t))
    for optimizer in accelerator._optimizers:
        for values in optimizer.state_dict().get("state", {}).values():
            total += sum(t.numel() * t.element_size() for t in values.values() if torch.is_tensor(t))
    return total * accelerator.num_processes


def load(accelerator, path: Path, cfg) -> None:
    """Every rank: restore model, optimizer, schedule, samplers and RNGs from `path`, written by this run's strategy
    and world or (reshard.py) another's."""
    if not reshard.native(path, read_state(path), cfg):
        reshard.load_moved(accelerator, path)
        return
    only_trainable = cfg.model.lora.enabled
    with _fsdp_adapter_only(accelerator, only_trainable):
        accelerator.load_state(str(path), **_frozen_kwargs(accelerator, only_trainable, saving=False))


def _drop_frozen(models, weights, output_dir) -> None:
    """Accelerate's save hook (plain and DDP models): keep only the weights that train."""
    for model, state in zip(models, weights):
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        for key in [key for key in state if key not in trained]:
            del state[key]


def _frozen_kwargs(accelerator, only_trainable: bool, saving: bool) -> dict:
    from accelerate.utils import DistributedType

    if not only_trainable:
        return {}
    if accelerator.distributed_type is DistributedType.DEEPSPEED:
        return {"exclude_frozen_parameters": True} if saving else {"load_module_strict": False}
    return {} if saving else {"strict": False}


@contextlib.contextmanager
def _fsdp_adapter_only(accelerator, only_trainable: bool):
    """FSDP: Accelerate's own model save and load with `adapter_only=True` (peft models: the adapter's state
    alone), which `save_state`/`load_state` do not pass on."""
    from accelerate import accelerator as module
    from accelerate.utils import DistributedType

    if not (only_trainable and accelerator.distributed_type is DistributedType.FSDP):
        yield
        return
    save, load = module.save_fsdp_model, module.load_fsdp_model
    module.save_fsdp_model = functools.partial(save, adapter_only=True)
    module.load_fsdp_model = functools.partial(load, adapter_only=True)
    try:
        yield
    finally:
        module.save_fsdp_model, module.load_fsdp_model = save, load
