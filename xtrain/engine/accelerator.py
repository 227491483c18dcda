"""The Accelerator of a run: built from the run config and its plugins, then checked to be what was asked.

Accelerate falls back silently (FSDP to DDP on a CPU, N processes to N lone ones): `check_setup` stops a
run that got anything other than the requested strategy and world. `fsdp_units` records what FSDP
actually sharded. The suite's CPU seams (core/seams.py) change the plugins and the Accelerator here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate import data_loader as accelerate_data_loader
from accelerate.utils import other as accelerate_other
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    ProjectConfiguration,
)

from xtrain.config.schema import RunConfig
from xtrain.core import seams
from xtrain.parallel import plugins, strategies
from xtrain.engine import tracking


def _imported(module: str):
    """Whether `module` is imported: an object can only be an instance of its classes once it is."""
    import sys

    return lambda: module in sys.modules


# Accelerate tests objects against classes of libraries it imports for the test, wherever they are installed: its
# unwrap (`extract_model_from_parallel`, under `unwrap_model` and `prepare`) a model against DeepSpeed's engine
# (0.2 s of every run's start-up), and `prepare_data_loader` a multi-process run's dataset against `datasets`'
# IterableDataset (0.45 s of every rank's, pandas included). No model is a DeepSpeed engine before DeepSpeed is
# imported (ZeRO runs import it as they build their plugin), no dataset a `datasets` one before `datasets` is.
accelerate_other.is_deepspeed_available = _imported("deepspeed")
accelerate_data_loader.is_datasets_available = _imported("datasets")


def plugin_kwargs(cfg: RunConfig, facts: plugins.ModelFacts) -> dict:
    """The Accelerator's plugins, made on this rank's own GPU: FSDP1's cpu_ram_efficient_loading captures the
    current device as its plugin is made (Accelerate sets the rank's device only later), which would put every
    rank's weights on GPU 0 first."""
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return plugins.accelerator_kwargs(cfg, facts)


def build_accelerator(cfg: RunConfig, run_dir: Path, facts: plugins.ModelFacts) -> Accelerator:
    kwargs = plugin_kwargs(cfg, facts)
    # a collective that waits longer than this (a stuck or dead rank) raises instead of hanging
    timeout = timedelta(seconds=cfg.cluster.timeout_s)
    # Without cpu=True a CUDA-less multi-process launch silently trains N independent models.
    setup = {"cpu": not torch.cuda.is_available(), "process_group": {"timeout": timeout}}
    seams.each("before_accelerator", cfg, kwargs, setup)
    process_group = InitProcessGroupKwargs(**setup["process_group"])
    accelerator = Accelerator(
        cpu=setup["cpu"],
        # DDP's gradient buckets are views of the gradients, not a second copy of them
        kwargs_handlers=[*kwargs.pop("kwargs_handlers", []), process_group,
                         DistributedDataParallelKwargs(gradient_as_bucket_view=True)],
        **kwargs,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.trainer.grad_accum, sync_with_dataloader=False
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.trainer.seed),
        # The schedule is defined in optimizer steps; it is stepped by hand, and not after a skipped step.
        step_scheduler_with_optimizer=False,
        log_with=tracking.log_with(cfg.tracker, run_dir),
        project_config=ProjectConfiguration(
            project_dir=str(run_dir), logging_dir=str(run_dir / tracking.TENSORBOARD_DIR)
        ),
    )
    seams.each("after_accelerator", cfg, accelerator)
    return accelerator


def check_setup(cfg: RunConfig, distributed_type: DistributedType, num_processes: int) -> None:
    """Accelerate falls back silently (FSDP to DDP, N processes to N lone ones): train only what was asked."""
    world = cfg.cluster.world_size
    if distributed_type.value not in strategies.of(cfg).accelerate_types(world) or num_processes != world:
        raise RuntimeError(
            f"strategy={cfg.strategy.name.value} on {world} process(es): Accelerate set up {distributed_type.value} on "
            f"{num_processes}; stopping rather than training something else"
        )


def fsdp_units(model: torch.nn.Module) -> dict[str, int]:
    """What FSDP sharded as units, by the class of the wrapped module; `activation_checkpointed`: layers
    recomputed in backward. Recorded in result.json: the wrap policy as it was applied, not as it was asked."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    units: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):  # FSDP1 wraps; FSDP2 changes the class in place
            module = module.module
        elif not isinstance(module, FSDPModule):
            continue
        if isinstance(module, CheckpointWrapper):
            if isinstance(module._checkpoint_wrapped_module, FSDPModule):
                continue  # Accelerate shards both the wrapper and the layer inside: one unit, counted once
            module = module._checkpoint_wrapped_module
        name = next(c.__name__ for c in type(module).__mro__ if not issubclass(c, (FSDPModule, CheckpointWrapper)))
        units[name] = units.get(name, 0) + 1
    checkpointed = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    return {**units, "activation_checkpointed": checkpointed} if checkpointed else units


class _DropNote(logging.Filter):
    """A library's note that is expected here and that a user cannot act on."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


_NOTES = [
    # at every save: tied embeddings are stored once
    ("accelerate.utils.other", _DropNote("Removed shared tensor")),
    # when EOS (= pad id) starts or ends a block: xtrain packs documents into full blocks, nothing is padded
    ("transformers.modeling_utils", _DropNote("We strongly recommend passing in an `attention_mask`")),
    # under FSDP2 x TP: gradient norms and full state dicts gathered over the mesh's two axes in two collectives
    ("torch.distributed.tensor._redistribute", _DropNote("sequential all_")),
]


@contextlib.contextmanager
def library_notes_quieted():
    """While training: libraries' notes that are expected here are dropped; afterwards everything is as it was."""
    for name, note in _NOTES:
        logging.getLogger(name).addFilter(note)
    try:
        with warnings.catch_warnings():
            # DeepSpeed 0.19 calls these at every ZeRO step, and torch 2.13 warns each time
            warnings.filterwarnings(
                "ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                FutureWarning,
            )
            # peft 0.21 asks every model it wraps for this deprecated attribute, and transformers 5 warns
            warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated", FutureWarning)
            # torch 2.13 under a mesh: Accelerate slices its flattened data-parallel axes from the root mesh
            warnings.filterwarnings("ignore", r"Slicing a flattened dim from root mesh", UserWarning)
            # FSDP2 on a causal LM's output, which transformers returns as a view (nothing here writes into it)
            warnings.filterwarnings("ignore", r"FSDP2-wrapped module .* returned a view tensor", UserWarning)
            yield
    finally:
        for name, note in _NOTES:
            logging.getLogger(name).removeFilter(note)
