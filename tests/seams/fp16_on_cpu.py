"""fp16 autocast and a loss scaler on the CPU (DDP): Accelerate runs fp16 only on accelerators (on a CPU it trains
fp32). The scale starts high enough that the first steps overflow for real, so the skip path runs."""

from __future__ import annotations

import torch


def _applies(cfg) -> bool:
    return cfg.precision.name.value == "fp16" and cfg.strategy.name.value == "ddp" and not torch.cuda.is_available()


class Fp16OnCpu:
    def runs_on_cpu(self, what: str, cfg) -> bool | None:
        return True if what == "fp16" and _applies(cfg) else None

    def after_accelerator(self, cfg, accelerator) -> None:
        """What Accelerate sets up for fp16 on a GPU, on the CPU."""
        if _applies(cfg):
            accelerator.native_amp = True
            accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)


SEAM = Fp16OnCpu()
