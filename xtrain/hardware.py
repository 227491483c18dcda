"""What this machine can run: checked before launch, so a request is never silently downgraded."""

from __future__ import annotations

from xtrain.config import ConfigError, Precision, RunConfig


def check(cfg: RunConfig) -> None:
    import torch

    precision = cfg.precision.name
    if not torch.cuda.is_available():
        if precision is Precision.fp16:
            raise ConfigError(
                "precision=fp16: needs a CUDA GPU (Accelerate would silently train this CPU run in fp32); "
                "use precision=bf16 (autocast, fast on CPUs with bf16 units) or precision=fp32"
            )
    elif precision is Precision.bf16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision=bf16: this GPU ({torch.cuda.get_device_name()}) does not support bf16; "
            "use precision=fp16 or precision=fp32"
        )
