"""`trainer.compile`: torch.compile per transformer block (regional: one block compiled, the others hit its
cache), in place, so that parameter names, checkpoints and exports are those of the eager model.

FSDP2 and ZeRO compile through Accelerate's TorchDynamoPlugin, which orders it as they need (FSDP2:
activation checkpointing, then compile, then `fully_shard`; ZeRO: the engine's module, in place). DDP does
not: Accelerate's DDP path compiles copies of the blocks, and every state-dict key gains `_orig_mod.`, so
xtrain compiles a DDP model itself, in place, before `prepare`.
"""

from __future__ import annotations

import torch


# trainer.compile_tuning: inductor times its generated kernels' launch configurations as it compiles them
TUNING = {"coordinate_descent_tuning": True, "max_autotune_pointwise": True}


def compile_blocks(model: torch.nn.Module) -> None:
    """Each repeated block compiled in place (`module.compile()`: hooks added later, FSDP2's among them,
    still run), the rest of the model leaf by leaf, with the settings Accelerate uses for FSDP2."""
    from accelerate.utils.other import compile_regions_fsdp2

    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    compile_regions_fsdp2(model, backend="inductor")


def tuning(trainer):
    """A context for the run: its kernels compiled with `trainer.compile_tuning`'s inductor settings (a patch, so
    that runs one after another in one process, a sweep's points, each compile as asked)."""
    import torch._inductor.config

    return torch._inductor.config.patch(TUNING if trainer.compile_tuning else {})


def compiled_regions(model: torch.nn.Module) -> int:
    """How many modules run compiled (in place or wrapped): what result.json records."""
    return sum(getattr(m, "_compiled_call_impl", None) is not None or isinstance(m, torch._dynamo.OptimizedModule)
               for m in model.modules())
