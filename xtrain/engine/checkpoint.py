"""Checkpoints in `<run dir>/checkpoints/step_XXXXXXXX`: written aside, renamed into place, pruned.

A checkpoint is an Accelerate state (`save_state`) plus `xtrain_state.json` (step,
tokens seen, model identity). A directory without that file is not a checkpoint: the
file is written last, just before the rename, so a kill at any moment leaves either the
previous newest checkpoint or a complete new one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
from pathlib import Path

from xtrain.core.errors import ConfigError
from xtrain.core.files import replace_dir
from xtrain.config import schema
from xtrain.distributed import mesh
from xtrain.engine import reshard
from xtrain.core.rundir import CHECKPOINT_NAME, CHECKPOINT_STATE, checkpoint_name, checkpoints_dir, complete_checkpoints

log = logging.getLogger("xtrain")


def newest(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_state(path: str | Path) -> dict:
    return json.loads((Path(path) / CHECKPOINT_STATE).read_text())


def identity(cfg, task=None) -> dict:
    """What a checkpoint records of the run that wrote it: the model (a resume must match it), the strategy and the
    number of processes (a resume may move them: reshard.py) (`task`: the run's, where it has one already)."""
    from xtrain.tasks.registry import task_for

    return {**(task or task_for(cfg)).identity(), "strategy": cfg.strategy.name.value,
            "processes": cfg.cluster.world_size}


def resolve(resume: str, run_dir: str | Path, expected: dict, cfg) -> Path | None:
    """The checkpoint to resume from (None: fresh start), checked against this run's `identity`: the same model, and
    one that can move to this run's strategy and world."""
    if resume == "none":
        return None
    if resume == "auto":
        path = newest(run_dir)
        if path is None:
            return None
    else:
        path = Path(os.path.expanduser(resume))
        if not path.exists():
            raise ConfigError(f"resume={resume}: no such checkpoint; use resume=auto, resume=none or a checkpoint directory")
        if not (path / CHECKPOINT_STATE).is_file():
            newest_inside = newest(path)
            if newest_inside is None:
                raise ConfigError(
                    f"resume={resume}: not an xtrain checkpoint (no {CHECKPOINT_STATE}); "
                    "give <run dir>/checkpoints/step_N or a run dir that has checkpoints"
                )
            path = newest_inside
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


def keep_effective_batch(cfg):
    """`cfg`, resuming: with the grad_accum that keeps its checkpoint's effective batch on this run's processes
    (resume.py)."""
    from xtrain.engine import resume

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
                 "effective batch of %d", mesh.of(cfg).data_parallel, mesh.of(schema.from_container(recorded)).data_parallel,
                 cfg.trainer.grad_accum, kept.trainer.grad_accum, mesh.effective_batch(kept))
    return kept


def remove_partial(run_dir: str | Path) -> None:
    """Remove leftovers of saves that were interrupted (never complete checkpoints)."""
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-") or (CHECKPOINT_NAME.match(p.name) and not (p / CHECKPOINT_STATE).is_file()):
                shutil.rmtree(p, ignore_errors=True)


def save(accelerator, run_dir: str | Path, step: int, state: dict, keep: int, only_trainable: bool = False) -> Path:
    """Every rank calls this; the main process publishes the checkpoint and prunes old ones. `only_trainable`
    (LoRA): the frozen weights are left out (they are the pretrained model's)."""
    root = checkpoints_dir(run_dir)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    hook = accelerator.register_save_state_pre_hook(_drop_frozen) if only_trainable else None
    try:
        with _fsdp_adapter_only(accelerator, only_trainable):
            accelerator.save_state(str(tmp), **_frozen_kwargs(accelerator, only_trainable, saving=True))
    finally:
        if hook is not None:
            hook.remove()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state_file = tmp / CHECKPOINT_STATE
        state_file.write_text(json.dumps({"step": step, **state}, indent=2))
        with open(state_file) as f:
            os.fsync(f.fileno())
        replace_dir(tmp, final)
        for stale in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(stale)
    accelerator.wait_for_everyone()
    return final


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
