"""The `model` settings: the built-in model's shapes (built from config, random init) or a pretrained one, and
LoRA (`model.lora`, lora.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from xtrain.config.fields import not_read_by, setting
from xtrain.config.lora import LoraConfig
from xtrain.core.errors import ConfigError, changed_settings, positive


class ModelSource(Enum):
    config = "config"  # built from a transformers config, random init
    pretrained = "pretrained"  # from_pretrained(model.name_or_path)


class ModelArch(Enum):
    gpt2 = "gpt2"
    llama = "llama"




@dataclass
class ModelConfig:
    source: ModelSource = ModelSource.config
    """`config`: build `arch` with the sizes below, random init; `pretrained`: load `name_or_path`."""
    arch: ModelArch = setting(ModelArch.gpt2, only=("config",))
    """Architecture for `source=config`: transformers' GPT-2 (its tanh GELU in torch's one-kernel form) or Llama."""
    name_or_path: Optional[str] = None
    """For `source=pretrained`: a hub id or a local directory holding the model and its tokenizer."""
    hidden_size: int = setting(128, only=("config",))
    """Width of the built-in model (`source=config`)."""
    num_layers: int = setting(4, only=("config",))
    """Transformer blocks of the built-in model."""
    num_heads: int = setting(4, only=("config",))
    """Attention heads of the built-in model (hidden_size must divide by it)."""
    num_kv_heads: Optional[int] = setting(None, only=("config",))
    """Llama only: key/value heads for grouped-query attention (default: num_heads)."""
    intermediate_size: int = setting(512, only=("config",))
    """Width of the built-in model's MLP."""
    vocab_size: int = setting(2048, only=("config",))
    """Size of the byte-level BPE tokenizer trained on the corpus (built-in models only)."""
    dropout: float = setting(0.0, only=("config",))
    """Dropout of the built-in model (attention, residual and embedding)."""
    lora: LoraConfig = field(default_factory=LoraConfig)

    def check_source(self) -> None:
        """(After the task's checks, whose refusals of a built model say more.)"""
        if self.source is ModelSource.config and self.name_or_path:
            raise ConfigError(f"model.name_or_path={self.name_or_path}: a pretrained model's, and this run builds a "
                              f"{self.arch.value} from config with random weights; use model=hf to load it, or drop it")

    def __post_init__(self) -> None:
        if self.lora.enabled and self.source is ModelSource.config:
            raise ConfigError(
                "model.lora.enabled=true: the model is built from config with random weights, and LoRA adapts "
                "trained ones; use model=hf model.name_or_path=<a pretrained model>"
            )
        if self.source is ModelSource.pretrained and not self.name_or_path:
            raise ConfigError("model.name_or_path is empty: model=hf needs a hub id or a local model directory")
        for asked in changed_settings(self, "model", not_read_by(self, self.source.value)):
            raise ConfigError(f"{asked}: a setting of a model built from config, and model=hf loads "
                              f"{self.name_or_path} with its own; drop it")
        if self.num_kv_heads is not None and self.arch is not ModelArch.llama:
            raise ConfigError(f"model.num_kv_heads={self.num_kv_heads}: grouped-query attention is Llama's; "
                              "use model=tiny_llama, or drop it")
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            positive(f"model.{name}", getattr(self, name))
        if self.vocab_size < 260:
            raise ConfigError(f"model.vocab_size={self.vocab_size}: must be >= 260 (256 bytes + special tokens)")
        if self.num_kv_heads is not None and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads}: must divide model.num_heads={self.num_heads}"
            )
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size}: must be divisible by model.num_heads={self.num_heads}"
            )
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.dropout={self.dropout}: must be in [0, 1)")
