"""LoRA (peft): adapters on a frozen pretrained model, what they train, and how they are saved.

`adapt` wraps the loaded model (`get_peft_model`); only the adapters (and `modules_to_save`) require grad, so
the optimizer, the gradients and the checkpoints (checkpoint.py) hold only them. `export` writes the
adapter in PEFT's own format (`adapter/`) and the merged model (`model/`): the base loaded again from
`model.name_or_path` (in full precision, a QLoRA run's too) with the adapter's tensors put in, merged and unloaded.
The model being trained is never touched (peft's merge works in place: merged there, the adapters would stop
training after an export at an eval). The adapter tensors come from the run's full state dict (gathered under
FSDP2 and ZeRO-3), so no rank's shard is saved as the whole.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from xtrain.config.schema import BaseQuantization, LoraConfig, ModelConfig
from xtrain.core.errors import ConfigError

ALL_LINEAR = "all-linear"  # peft: every linear layer but the output head


def peft_config(lora: LoraConfig, task_type: str = "CAUSAL_LM"):
    """peft's settings; `task_type` SEQ_CLS trains and saves the classification head besides the adapters."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type=task_type,
        target_modules=list(lora.target_modules) or ALL_LINEAR, modules_to_save=list(lora.modules_to_save) or None,
    )


def matches(name: str, target: str) -> bool:
    """peft's rule: a module is targeted by its full name or the name's ending after a dot."""
    return name == target or name.endswith("." + target)


def trainable_parameters(meta_model, lora: LoraConfig) -> int:
    """Refuse targets that name no module; the number of parameters LoRA trains (counted, not built)."""
    modules = dict(meta_model.named_modules())
    linear = {name: m for name, m in modules.items() if isinstance(m, torch.nn.Linear)}
    head = meta_model.get_output_embeddings()
    for setting, targets in (("target_modules", lora.target_modules), ("modules_to_save", lora.modules_to_save)):
        for target in targets:
            if not any(matches(name, target) for name in modules if name):
                some = sorted({name.rsplit(".", 1)[-1] for name in linear})[:8]
                raise ConfigError(f"model.lora.{setting}: {target!r} names no module of the model; its linear "
                                  f"layers include {', '.join(some)}")
    if lora.target_modules:
        adapted = [m for name, m in linear.items() if any(matches(name, t) for t in lora.target_modules)]
    else:
        adapted = [m for m in linear.values() if m is not head]
    trained = sum(lora.rank * (m.in_features + m.out_features) for m in adapted)
    saved = {id(p): p for name, m in modules.items() if any(matches(name, t) for t in lora.modules_to_save)
             for p in m.parameters()}
    return trained + sum(p.numel() for p in saved.values())


def quantized_parameters(meta_model, lora: LoraConfig) -> int:
    """The base's parameters QLoRA holds in 4 bits: every linear layer's weight but the output head's (which
    transformers keeps in full precision), counted, not built; 0 without `quantize_base`."""
    if lora.quantize_base is BaseQuantization.none:
        return 0
    head = meta_model.get_output_embeddings()
    return sum(m.weight.numel() for m in meta_model.modules() if isinstance(m, torch.nn.Linear) and m is not head)


def adapt(model, lora: LoraConfig, task_type: str = "CAUSAL_LM"):
    from peft import get_peft_model

    return get_peft_model(model, peft_config(lora, task_type))


def export(peft_model, state_dict: dict, model_cfg: ModelConfig, out: Path, tokenizer, load_base=None,
           task_type: str = "CAUSAL_LM") -> None:
    """`out/adapter`: the adapter in PEFT's format; `out/model`: the base with the adapter merged in, on a copy of
    the base `load_base` loads (default: a causal LM from `name_or_path`), never on the model being trained."""
    from peft import get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict

    full = _peft_keys(peft_model, state_dict)
    adapter_state = {key: value.detach().clone() for key, value in
                     get_peft_model_state_dict(peft_model, state_dict=full).items()}
    peft_model.save_pretrained(out / "adapter", state_dict=full, safe_serialization=True)  # (peft picks the adapter's)
    tokenizer.save_pretrained(out / "adapter")
    with without_zero3_init():  # the base again, on this process only, the adapter put in
        base = (load_base or (lambda: _causal_lm(model_cfg)))()
    fresh = get_peft_model(base, peft_config(model_cfg.lora, task_type))
    loaded = set_peft_model_state_dict(fresh, adapter_state)
    if loaded.unexpected_keys:
        raise RuntimeError(f"adapter keys the model does not have: {loaded.unexpected_keys[:4]}")
    merged = fresh.merge_and_unload()
    merged.save_pretrained(out / "model", safe_serialization=True)
    tokenizer.save_pretrained(out / "model")


def _causal_lm(model_cfg: ModelConfig):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.expanduser(model_cfg.name_or_path), dtype=torch.float32)


def _peft_keys(peft_model, state_dict: dict) -> dict:
    """The state dict under the peft model's own names (Accelerate's may lack the `base_model.model.` prefix)."""
    own = {name for name, _ in peft_model.named_parameters()}
    if own & set(state_dict):
        return state_dict
    return {f"base_model.model.{key}": value for key, value in state_dict.items()}


@contextlib.contextmanager
def without_zero3_init():
    """transformers builds every model under DeepSpeed's zero.Init (a collective) while a ZeRO-3 run's config is
    registered; the main process alone loads the base for the export, plainly."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    held = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if held is not None:
            hf_deepspeed.set_hf_deepspeed_config(held)
