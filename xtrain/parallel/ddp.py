"""DDP: every rank a replica of the whole model, gradients all-reduced (one process: no wrapping at all)."""

from __future__ import annotations

from xtrain.config.schema import RunConfig
from xtrain.parallel.base import Parallelism


class Ddp(Parallelism):
    name = "DDP"
    accelerate_type = "MULTI_GPU"

    def launch_config(self, cfg: RunConfig, facts, files: dict, cuda: bool) -> dict:
        """Without CUDA a DDP run is MULTI_CPU (gloo); never MULTI_GPU there: its workers would each train alone."""
        kind = "MULTI_GPU" if cuda else "MULTI_CPU"
        return {"distributed_type": kind if cfg.cluster.world_size > 1 else "NO", "use_cpu": not cuda}

    def accelerate_types(self, world: int) -> set[str]:
        return {"MULTI_CPU", "MULTI_GPU"} if world > 1 else {"NO"}

    def trains_in_process(self, world: int) -> bool:
        return world == 1

    def steps_fused(self, cfg: RunConfig) -> bool:
        return True

    def builds_on_meta(self, cfg: RunConfig) -> bool:
        """On a GPU made there directly, not on the host and then moved (not under LoRA, which wraps it first)."""
        import torch

        from xtrain.parallel.base import built_from_config

        return built_from_config(cfg) and torch.cuda.is_available() and not cfg.model.lora.enabled

    def state_bytes(self, cfg: RunConfig, state: float) -> tuple[float, float, float]:
        """Autocast keeps fp32 weights and gradients whatever the precision (the buckets are views of them)."""
        return 4, 4, state
