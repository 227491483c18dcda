"""Checkpoints that move: written by N processes under one strategy, resumed by M under another, or exported whole.

Accelerate loads a checkpoint where its files fit the resuming run: a DDP state (`model.safetensors`, `optimizer.bin`)
at any number of processes, an FSDP2 sharded state (torch distributed checkpoint, resharded on load) at any mesh,
FSDP2's full state under FSDP2's full state, a DeepSpeed state at the stage and world that wrote it. Every other move
goes through the form no world owns: the whole model's state dict and the optimizer's state keyed by parameter name
(`torch.distributed.checkpoint.state_dict`), read from whichever files the checkpoint holds (a ZeRO checkpoint through
DeepSpeed's universal checkpoint) and set on the resuming run's model and optimizer, whatever shards it. The schedule,
the RNGs and the loss scaler are Accelerate's files as they are.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from xtrain.config.schema import RunConfig
from xtrain.parallel import stages, strategies
from xtrain.parallel.base import DDP_FORM, DEEPSPEED_FORM, FSDP_FULL_FORM, FSDP_SHARDED_FORM, PIPELINE_FORM

if TYPE_CHECKING:
    import torch

DDP, FSDP_SHARDED, FSDP_FULL, DEEPSPEED, PIPELINE = (DDP_FORM, FSDP_SHARDED_FORM, FSDP_FULL_FORM, DEEPSPEED_FORM,
                                                   PIPELINE_FORM)
MODEL_DCP, OPTIMIZER_DCP, FSDP_FULL_MODEL, OPTIMIZER_FILE = "pytorch_model_fsdp_0", "optimizer_0", "pytorch_model_fsdp.bin", "optimizer.bin"
DEEPSPEED_DIR = "pytorch_model"


def written_as(path: Path) -> str:
    """The form of a checkpoint's model and optimizer files."""
    if (path / MODEL_DCP).is_dir():
        return FSDP_SHARDED
    if (path / FSDP_FULL_MODEL).is_file():
        return FSDP_FULL
    if (path / DEEPSPEED_DIR).is_dir():
        return DEEPSPEED
    if stages.written(path):
        return PIPELINE
    return DDP


def loads_as(cfg: RunConfig) -> str:
    """The form this run's Accelerate loads."""
    return strategies.of(cfg).checkpoint_form(cfg)


def native(path: Path, saved: dict, cfg: RunConfig) -> bool:
    """Accelerate's own load reads this checkpoint for this run (`saved`: the identity the checkpoint records)."""
    form = written_as(path)
    if form != loads_as(cfg):
        return False
    return form != DEEPSPEED or (saved.get("strategy"), processes(path, saved)) == (cfg.strategy.name.value,
                                                                                     cfg.cluster.world_size)


def processes(path: Path, saved: dict) -> int:
    """How many processes wrote the checkpoint (each saved its RNGs)."""
    return saved.get("processes") or len(list(path.glob("random_states_*.pkl"))) or 1


def moved(path: Path, saved: dict, cfg: RunConfig) -> dict:
    """What a resume changes of where the checkpoint trained: {"world": [4, 2], "strategy": ["fsdp", "ddp"],
    "pp": [2, 1], "grad_accum": [1, 2]} (only what differs)."""
    config = saved.get("config", {})
    before = config.get("trainer", {}).get("grad_accum", cfg.trainer.grad_accum)
    pairs = {"world": [processes(path, saved), cfg.cluster.world_size],
             "strategy": [saved.get("strategy", cfg.strategy.name.value), cfg.strategy.name.value],
             "pp": [config.get("strategy", {}).get("pp", 1), cfg.strategy.pp],
             "grad_accum": [before, cfg.trainer.grad_accum]}
    return {key: pair for key, pair in pairs.items() if pair[0] != pair[1]}


def moved_text(found: dict) -> str:
    """`world 4 -> 2, strategy fsdp -> ddp, grad_accum 1 -> 2 (the effective batch kept)`."""
    return ", ".join(f"{key} {old} -> {new}" for key, (old, new) in found.items()) + (
        " (the effective batch kept)" if "grad_accum" in found else "")


def refusal(path: Path, saved: dict, cfg: RunConfig, lora: bool) -> str | None:
    """Why this checkpoint cannot continue under this run's strategy and world (None: it can)."""
    if native(path, saved, cfg):
        return None
    where = f"strategy={saved.get('strategy')} on {processes(path, saved)} process(es)"
    here = f"strategy={cfg.strategy.name.value} on {cfg.cluster.world_size}"
    if loads_as(cfg) == DEEPSPEED:
        return (f"a checkpoint written with {where} cannot continue under {here}: a ZeRO run resumes only its own "
                f"stage's checkpoints at the world that wrote them; resume with strategy=ddp or strategy=fsdp (any "
                f"number of processes), or with {where}")
    if loads_as(cfg) == PIPELINE:
        return (f"a checkpoint written with {where} cannot continue in pipeline stages (strategy.pp="
                f"{cfg.strategy.pp}): a pipeline run resumes pipeline checkpoints (of any strategy.pp); resume with "
                f"strategy.pp=1, or start the pipeline run afresh")
    if lora:
        return (f"a LoRA checkpoint written with {where} cannot continue under {here} (it holds the adapter alone); "
                f"resume with strategy={saved.get('strategy')}")
    return None


@contextlib.contextmanager
def readable(path: Path, main: bool, wait):
    """The checkpoint as whole tensors can be read from it: itself, or (DeepSpeed) its universal form, made by the
    main process in a temporary directory beside it and removed after. `wait`: every rank's barrier."""
    if written_as(path) != DEEPSPEED:
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-universal-", dir=path.parent)) if main else None
    try:
        if main:  # (DeepSpeed writes a `latest_universal` beside its output: inside the temporary directory)
            _to_universal(path / DEEPSPEED_DIR, tmp / "universal")
        found = _broadcast_path(tmp and tmp / "universal")
        wait()
        yield found
        wait()
    finally:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)


def _broadcast_path(path: Path | None) -> Path:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return path
    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _to_universal(deepspeed_dir: Path, out: Path) -> None:
    """DeepSpeed's universal checkpoint of a ZeRO checkpoint: each parameter's fp32 weights and optimizer state whole
    (`zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`, the step and groups in `zero/optimizer_state.pt`)."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(deepspeed_dir), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        ds_to_universal.main(args)


def model_state(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights by name, from a checkpoint in any form (DeepSpeed: `readable`'s universal form)."""
    import torch

    form = written_as(path)
    if form == FSDP_SHARDED:
        return _dcp(path / MODEL_DCP)["model"]
    if form == FSDP_FULL:
        return torch.load(path / FSDP_FULL_MODEL, map_location="cpu", weights_only=True)
    if form == PIPELINE:
        return stages.read(path)[0]
    if (path / "zero").is_dir():  # universal: flat fp32 weights, shaped by DeepSpeed's record; buffers as saved
        shapes, buffers = _zero_shapes_and_buffers(path)
        return {**buffers, **{name: _universal(path, name, "fp32").reshape(shape) for name, shape in shapes.items()}}
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(path / "model.safetensors")
    return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)


def optimizer_state(path: Path, groups: list[list[str]]) -> dict:
    """The optimizer's state keyed by parameter name, as `set_optimizer_state_dict` takes it (`groups`: the names of
    this run's optimizer's parameters, group by group, for the forms that key them by position)."""
    import torch

    form = written_as(path)
    if form == FSDP_SHARDED:
        return _dcp(path / OPTIMIZER_DCP)["optimizer"]
    if form == PIPELINE:  # (by name already; each stage's groups alike: a tied weight's second name left out)
        saved = stages.read(path)[1]
        return {"state": {name: saved["state"][name] for name in sum(groups, [])},
                "param_groups": [{**group, "params": names} for group, names in zip(saved["param_groups"], groups,
                                                                                     strict=True)]}
    if (path / "zero").is_dir():  # universal: each parameter's moments whole, the step and groups in common
        common = torch.load(path / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
        saved, (shapes, _) = common["optimizer_state_dict"], _zero_shapes_and_buffers(path)
        step = next(iter(saved["state"].values()))["step"]
        state = {}
        for name in sum(groups, []):
            moments = {key: _universal(path, name, key).reshape(shapes[name])
                       for key in ("exp_avg", "exp_avg_sq") if (path / "zero" / name / f"{key}.pt").is_file()}
            state[name] = {"step": step.clone(), **moments}
        # (ZeRO flattens each group into one parameter: its hyperparameters, this run's parameters)
        return {"state": state, "param_groups": [{**group, "params": names}
                                                 for group, names in zip(saved["param_groups"], groups, strict=True)]}
    saved = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    if form == FSDP_FULL:
        return saved
    names = sum(groups, [])
    return {"state": {names[i]: value for i, value in saved["state"].items()},
            "param_groups": _named_groups(saved["param_groups"], names)}


def _universal(path: Path, name: str, key: str):
    import torch

    return torch.load(path / "zero" / name / f"{key}.pt", map_location="cpu", weights_only=False)


def _zero_shapes_and_buffers(path: Path) -> tuple[dict, dict]:
    """A universal checkpoint's parameter shapes (by name, as DeepSpeed recorded them) and the model's buffers."""
    import torch

    [states] = sorted(path.glob("*_model_states.pt"))[:1]
    saved = torch.load(states, map_location="cpu", weights_only=False)
    shapes = {name: shape for group in saved["param_shapes"] for name, shape in group.items()}
    return shapes, {name: saved["module"][name] for name in saved.get("buffer_names", [])}


def _named_groups(groups: list[dict], names: list[str]) -> list[dict]:
    """Param groups whose `params` are positions, with names instead (positions count on across the groups)."""
    named, at = [], 0
    for group in groups:
        named.append({**group, "params": names[at:at + len(group["params"])]})
        at += len(group["params"])
    assert at == len(names), f"the checkpoint's optimizer has {at} parameters, this run's {len(names)}"
    return named


def _dcp(directory: Path) -> dict:
    """A torch distributed checkpoint read whole into this process."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        return _load_state_dict_from_keys(checkpoint_id=str(directory))


def with_tied(weights: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`weights` with the names of tied parameters that a checkpoint keeps once (safetensors drops the alias)."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    filled = dict(weights)
    for names in aliases.values():
        present = [n for n in names if n in weights]
        for name in names:
            if present and name not in filled:
                filled[name] = weights[present[0]]
    return filled


def load_moved(accelerator, path: Path) -> None:
    """Every rank: the checkpoint's model and optimizer state set on this run's (whatever shards them), then the
    schedule, RNGs and loss scaler from Accelerate's files."""
    from accelerate.checkpointing import load_accelerator_state
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    [model], [optimizer] = accelerator._models, accelerator._optimizers
    optimizer = getattr(optimizer, "optimizer", optimizer)  # (Accelerate's wrapper)
    whole = StateDictOptions(full_state_dict=True)
    with readable(path, accelerator.is_main_process, accelerator.wait_for_everyone) as source:
        unwrapped = accelerator.unwrap_model(model)
        set_model_state_dict(model, with_tied(model_state(source), unwrapped), options=whole)
        groups = [group["params"] for group in get_optimizer_state_dict(model, optimizer, options=whole)["param_groups"]]
        set_optimizer_state_dict(model, optimizer, optimizer_state(source, groups), options=whole)
    scaler = accelerator.scaler if (path / "scaler.pt").is_file() else None
    load_accelerator_state(str(path), [], [], accelerator._schedulers, accelerator._dataloaders,
                           accelerator.process_index, scaler)
