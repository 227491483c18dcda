"""Causal language models: built from a transformers config (random init) or loaded pretrained."""

from __future__ import annotations

import collections
import os

from xtrain import meta_init
from xtrain.config import BaseQuantization, ModelArch, ModelConfig, ModelSource
from xtrain.errors import ConfigError


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


def transformers_config(model: ModelConfig, vocab_size: int, block_size: int, eos_token_id: int):
    if model.source is ModelSource.pretrained:
        return pretrained_config(model)
    common = dict(vocab_size=vocab_size, bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    if model.arch is ModelArch.gpt2:
        from transformers import GPT2Config

        return GPT2Config(
            n_embd=model.hidden_size, n_layer=model.num_layers, n_head=model.num_heads,
            n_inner=model.intermediate_size, n_positions=block_size,
            resid_pdrop=model.dropout, embd_pdrop=model.dropout, attn_pdrop=model.dropout, **common,
        )
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=model.hidden_size, num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads or model.num_heads, intermediate_size=model.intermediate_size,
        max_position_embeddings=block_size, attention_dropout=model.dropout, tie_word_embeddings=True, **common,
    )


def build(model: ModelConfig, tokenizer, block_size: int, shard_later: bool = False):
    """The model to train, on CPU in fp32 (Accelerate moves and casts it). `shard_later` (FSDP2, built from
    config): its large tensors on meta, for meta_init.shard to fill each rank's shards."""
    from transformers import AutoModelForCausalLM

    hf_config = transformers_config(model, len(tokenizer), block_size, tokenizer.eos_token_id)
    if model.source is ModelSource.pretrained:
        max_positions = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
        if max_positions and block_size > max_positions:
            raise ConfigError(
                f"data.block_size={block_size}: longer than {model.name_or_path}'s {max_positions} positions; "
                f"use data.block_size<={max_positions}"
            )
        try:
            built = AutoModelForCausalLM.from_pretrained(os.path.expanduser(model.name_or_path), dtype="float32",
                                                         **quantized(model))
        except (OSError, ValueError) as err:
            raise cannot_load(model, err) from None
    elif shard_later:
        built = meta_init.build(lambda: AutoModelForCausalLM.from_config(hf_config))
    else:
        built = AutoModelForCausalLM.from_config(hf_config)
    if getattr(built, "loss_type", None) is None:  # the default transformers picks anyway, after a warning that it had to
        built.loss_type = "ForCausalLM"
    return built


def quantized(model: ModelConfig) -> dict:
    """QLoRA: the frozen base in 4-bit NF4 (bitsandbytes, CUDA only; refused on CPUs by hardware.refusal)."""
    if model.lora.quantize_base is BaseQuantization.none:
        return {}
    import torch
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)}


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


def on_meta(model: ModelConfig, block_size: int):
    """The model with no storage (meta device): for counting parameters and finding its layer classes."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_config = transformers_config(model, model.vocab_size, block_size, eos_token_id=0)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def repeated_block(model) -> str | None:
    """The most frequent class among the children of the model's largest nn.ModuleList (by parameters)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return None
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    counts = collections.Counter(type(child).__name__ for child in largest)
    return sorted(counts, key=lambda name: (-counts[name], name))[0]


def fsdp_wrap_layer(requested: str | None, meta_model) -> str:
    """The block class FSDP wraps: `strategy.wrap_layer`; else the most frequent class the model declares in
    `_no_split_modules`; else the class of the blocks in its largest nn.ModuleList."""
    counts = collections.Counter(type(m).__name__ for m in meta_model.modules())
    present = sorted(counts)
    # the most frequent declared class (transformers 5 declares a set: its order depends on the hash seed)
    declared = sorted((name for name in (getattr(meta_model, "_no_split_modules", None) or []) if name in counts),
                      key=lambda name: (-counts[name], name))
    layer = requested or (declared[0] if declared else None) or repeated_block(meta_model)
    if layer is None:
        raise ConfigError(
            f"strategy.wrap_layer is empty: {type(meta_model).__name__} declares no layer class to wrap "
            "(_no_split_modules) and holds no nn.ModuleList of blocks; set it to the class of its repeated block"
        )
    if layer not in present:
        blocks = [n for n in present if n.endswith(("Block", "Layer"))] or present
        raise ConfigError(
            f"strategy.wrap_layer={layer}: no such layer in {type(meta_model).__name__}; choose one of {', '.join(blocks)}"
        )
    return layer
