"""A pretrained Hugging Face model's config, identity and load errors: what causal_lm and seq_cls share."""

from __future__ import annotations

import os

from xtrain.config.schema import ModelConfig, ModelSource
from xtrain.core.errors import ConfigError


def cannot_load(model: ModelConfig, err: BaseException) -> ConfigError:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return ConfigError(
        f"model.name_or_path={model.name_or_path}: cannot be loaded ({first[:200]}); "
        "give a local model directory, or a hub id that is in the Hugging Face cache (or reachable)"
    )


def pretrained_config(model: ModelConfig):
    """The pretrained model's transformers config; raises ConfigError if it cannot be loaded."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(os.path.expanduser(model.name_or_path))
    except (OSError, ValueError) as err:
        raise cannot_load(model, err) from None


def identity(model: ModelConfig) -> dict:
    """What a checkpoint must match to be resumed into this model."""
    if model.source is ModelSource.pretrained:
        found = {"source": "pretrained", "name_or_path": model.name_or_path}
        if model.lora.enabled:
            lora = model.lora
            found["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules),
                             "modules_to_save": list(lora.modules_to_save)}
        return found
    return {
        "source": "config", "arch": model.arch.value, "hidden_size": model.hidden_size, "num_layers": model.num_layers,
        "num_heads": model.num_heads, "num_kv_heads": model.num_kv_heads, "intermediate_size": model.intermediate_size,
        "vocab_size": model.vocab_size,
    }
