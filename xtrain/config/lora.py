"""The `model.lora` settings: low-rank adapters (peft) on a frozen pretrained model."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import List

from xtrain.core.errors import ConfigError, changed_settings, positive


class BaseQuantization(Enum):
    none = "none"
    nf4 = "nf4"  # QLoRA: the frozen base in 4 bits (bitsandbytes, CUDA only)


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train low-rank adapters (peft) on a frozen pretrained model instead of every weight."""
    rank: int = 16
    """Rank of each adapter's two low-rank matrices."""
    alpha: float = 32.0
    """Adapters are scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: List[str] = field(default_factory=list)
    """Module names to adapt (peft's matching: a name or a name's ending); empty: every linear layer of the
    blocks (not the output head)."""
    modules_to_save: List[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (e.g. lm_head), saved with the adapter."""
    quantize_base: BaseQuantization = BaseQuantization.none
    """`nf4`: QLoRA, the frozen base loaded in 4 bits (needs a CUDA GPU and bitsandbytes)."""

    def __post_init__(self) -> None:
        asked = changed_settings(self, "model.lora", [f.name for f in fields(self) if f.name != "enabled"])
        if asked and not self.enabled:
            raise ConfigError(f"{asked[0]}: a setting of LoRA, and this run trains every weight "
                              "(model.lora.enabled=false); add model.lora.enabled=true, or drop it")
        if self.enabled:
            positive("model.lora.rank", self.rank)
            positive("model.lora.alpha", self.alpha)
            if not 0 <= self.dropout < 1:
                raise ConfigError(f"model.lora.dropout={self.dropout}: must be in [0, 1)")
