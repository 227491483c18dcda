"""ZeRO through DeepSpeed's own CPU accelerator over gloo (slow; Accelerate does not support it)."""

from __future__ import annotations

import torch


class ZeroOnCpu:
    def runs_on_cpu(self, what: str, cfg) -> bool | None:
        return True if what == "zero" and not torch.cuda.is_available() else None

    def before_accelerator(self, cfg, kwargs: dict, setup: dict) -> None:
        """Accelerate ignores a DeepSpeed plugin under cpu=True: ZeRO brings its own gloo group instead."""
        if "deepspeed_plugin" not in kwargs or torch.cuda.is_available():
            return
        setup["cpu"] = False
        setup["process_group"]["backend"] = "gloo"
        skip_the_shared_memory_all_reduce()
        if cfg.strategy.offload_optimizer.value != "none":
            accept_torch_adamw_offloaded(kwargs["deepspeed_plugin"])


def accept_torch_adamw_offloaded(deepspeed_plugin) -> None:
    """With strategy.offload_optimizer: torch's AdamW steps on the host copy (DeepSpeedCPUAdam, the GPU path's
    optimizer, would be compiled on first use, minutes on this CPU). DeepSpeed refuses a client optimizer under
    offload unless told."""
    deepspeed_plugin.deepspeed_config["zero_force_ds_cpu_optimizer"] = False


def skip_the_shared_memory_all_reduce() -> None:
    """Before DeepSpeed sets up its process group: no shared-memory all-reduce op. DeepSpeed's CPU accelerator
    compiles it on first use and takes a lock file for every later load; a rank killed while holding it leaves the
    file, and every DeepSpeed run after waits for it forever. gloo's all-reduce serves instead."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


SEAM = ZeroOnCpu()
