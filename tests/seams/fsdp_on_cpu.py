"""FSDP2 over gloo: Accelerate takes its FSDP branch only for accelerator process groups, so the gloo group a CPU
run gets is presented to it as an accelerator's. FSDP2 runs over gloo as it is; the one other difference from a GPU
run is unpinned host memory for cpu_offload (pinning needs a GPU)."""

from __future__ import annotations

import torch


class FsdpOnCpu:
    def runs_on_cpu(self, what: str, cfg) -> bool | None:
        return True if what == "fsdp" and not torch.cuda.is_available() else None

    def before_accelerator(self, cfg, kwargs: dict, setup: dict) -> None:
        if "fsdp_plugin" not in kwargs or torch.cuda.is_available():
            return
        from accelerate import PartialState
        from accelerate.utils import DistributedType
        from torch.distributed.fsdp import CPUOffloadPolicy

        PartialState(cpu=True, timeout=setup["process_group"]["timeout"], backend="gloo")
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        plugin = kwargs["fsdp_plugin"]
        if isinstance(plugin.cpu_offload, CPUOffloadPolicy):  # strategy.cpu_offload=true (else OffloadPolicy())
            plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)


SEAM = FsdpOnCpu()
