"""The `precision` settings: mixed precision, and fp8's backend."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Precision(Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    fp8 = "fp8"


class Fp8Backend(Enum):
    te = "te"  # NVIDIA Transformer Engine
    torchao = "torchao"
    msamp = "msamp"


@dataclass
class PrecisionConfig:
    name: Precision = Precision.fp32
    """Mixed precision; each option of the `precision` group sets it."""
    fp8_backend: Fp8Backend = Fp8Backend.te
    """precision=fp8 only: `te` (Transformer Engine), `torchao` or `msamp`."""
