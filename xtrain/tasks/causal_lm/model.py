"""Causal language models: built from a transformers config (random init) or loaded pretrained."""

from __future__ import annotations

import logging
import os

from xtrain.config.schema import BaseQuantization, ModelArch, ModelConfig, ModelSource
from xtrain.core.errors import ConfigError
from xtrain.parallel import meta_init
from xtrain.tasks.pretrained import cannot_load, pretrained_config

log = logging.getLogger("xtrain")


def transformers_config(model: ModelConfig, vocab_size: int, block_size: int, eos_token_id: int):
    if model.source is ModelSource.pretrained:
        return pretrained_config(model)
    common = dict(vocab_size=vocab_size, bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    if model.arch is ModelArch.gpt2:
        from transformers import GPT2Config

        return GPT2Config(
            n_embd=model.hidden_size, n_layer=model.num_layers, n_head=model.num_heads,
            n_inner=model.intermediate_size, n_positions=block_size,
            resid_pdrop=model.dropout, embd_pdrop=model.dropout, attn_pdrop=model.dropout,
            activation_function="gelu_pytorch_tanh", **common,  # GPT-2's gelu_new in one kernel instead of five
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

    vocab = len(tokenizer)
    if model.source is ModelSource.config and vocab < model.vocab_size:  # the asked vocabulary; some ids unused
        log.info("data: the corpus filled %d of the tokenizer's model.vocab_size=%d tokens; the model keeps %d "
                 "(ids %d-%d are never seen)", vocab, model.vocab_size, model.vocab_size, vocab, model.vocab_size - 1)
        vocab = model.vocab_size
    hf_config = transformers_config(model, vocab, block_size, tokenizer.eos_token_id)
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


def on_meta(model: ModelConfig, block_size: int):
    """The model with no storage (meta device): for counting parameters and finding its layer classes."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_config = transformers_config(model, model.vocab_size, block_size, eos_token_id=0)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)
