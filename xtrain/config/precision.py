"""The `precision` settings: mixed precision, and fp8's backend, recipe and layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List

from xtrain.core.errors import ConfigError


class Precision(Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    fp8 = "fp8"


class Fp8Backend(Enum):
    te = "te"  # NVIDIA Transformer Engine
    torchao = "torchao"
    msamp = "msamp"


# Accelerate's recipe class of each backend (in `accelerate.utils`; MS-AMP's only before Accelerate 1.16)
FP8_RECIPES = {Fp8Backend.te: "TERecipeKwargs", Fp8Backend.torchao: "AORecipeKwargs", Fp8Backend.msamp: "MSAMPRecipeKwargs"}


class Fp8Recipe(Enum):
    tensorwise = "tensorwise"  # one scale per tensor (torchao's default; fp8 all-gather under FSDP)
    rowwise = "rowwise"  # one scale per row: more accurate, more scaling work


@dataclass
class PrecisionConfig:
    name: Precision = Precision.fp32
    """Mixed precision; each option of the `precision` group sets it."""
    fp8_backend: Fp8Backend = Fp8Backend.te
    """precision=fp8 only: `te` (Transformer Engine), `torchao` or `msamp`."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise
    """precision.fp8_backend=torchao only: how torchao scales to fp8, `tensorwise` or `rowwise`."""
    fp8_skip: List[str] = field(default_factory=list)
    """precision.fp8_backend=torchao only: linear layers kept in bf16, by a part of their names (e.g.
    `[self_attn]`); the model's input layer and output head always are."""

    def __post_init__(self) -> None:
        if self.name is not Precision.fp8 and self.fp8_backend is not Fp8Backend.te:
            raise ConfigError(f"precision.fp8_backend={self.fp8_backend.value}: a setting of fp8, and this run has "
                              f"precision={self.name.value}; add precision=fp8, or drop it")
        torchao = self.name is Precision.fp8 and self.fp8_backend is Fp8Backend.torchao
        asked = [f"precision.fp8_recipe={self.fp8_recipe.value}"] if self.fp8_recipe is not Fp8Recipe.tensorwise else []
        asked += [f"precision.fp8_skip=[{','.join(self.fp8_skip)}]"] if self.fp8_skip else []
        if asked and not torchao:
            run = (f"precision.fp8_backend={self.fp8_backend.value}" if self.name is Precision.fp8
                   else f"precision={self.name.value}")
            raise ConfigError(f"{asked[0]}: a setting of fp8 with torchao, and this run has {run}; "
                              "add precision=fp8 precision.fp8_backend=torchao, or leave it unset")
