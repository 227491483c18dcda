"""What the strategy code needs of a task's model, read on the meta device: its parameter count, FSDP's block,
ZeRO's bucket size and the LoRA-trainable count."""

from __future__ import annotations

from xtrain.config.schema import RunConfig, Strategy
from xtrain.distributed import fp8, mesh, plugins

_FACTS: dict[str, tuple[int, plugins.ModelFacts]] = {}


def model_facts(cfg: RunConfig) -> tuple[int, plugins.ModelFacts]:
    """Parameter count and plugin facts from the model on the meta device (no memory, seconds for 70B).
    Kept per model for the process: a sweep's points mostly share theirs."""
    key = repr((cfg.model, cfg.data, cfg.strategy.name, cfg.strategy.wrap_layer, cfg.precision))
    if key not in _FACTS:
        _FACTS[key] = _model_facts(cfg)
    return _FACTS[key]


def _model_facts(cfg: RunConfig) -> tuple[int, plugins.ModelFacts]:
    from xtrain.tasks.registry import task_for

    meta = task_for(cfg).on_meta()
    n_params = sum(p.numel() for p in meta.parameters())
    wrap = plugins.fsdp_wrap_layer(cfg.strategy.wrap_layer, meta) if cfg.strategy.name is Strategy.fsdp else ""
    trainable, quantized = None, 0
    if cfg.model.lora.enabled:
        from xtrain.tasks import lora

        trainable = lora.trainable_parameters(meta, cfg.model.lora)
        quantized = lora.quantized_parameters(meta, cfg.model.lora)
    hidden = getattr(getattr(meta, "config", None), "hidden_size", None)
    if hidden is None:  # a module without a transformers config: ZeRO's buckets sized by its largest weight
        hidden = max((int(p.numel() ** 0.5) for p in meta.parameters()), default=1)
    config = getattr(meta, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    planned = mesh.tensor_parallel_plan(meta)
    return n_params, plugins.ModelFacts(
        hidden_size=hidden, wrap_layer=wrap, trainable=trainable, quantized=quantized, model_class=type(meta).__name__,
        tp_plan=bool(planned), heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        layers=layers, intermediate=intermediate or (4 * hidden if layers else None),
        vocab=getattr(config, "vocab_size", None),
        tp_split=sum(p.numel() for name, p in meta.named_parameters() if name in planned),
        fp8_layers=fp8.layers(meta, cfg.precision)[0] if plugins.torchao_fp8(cfg) else (),
    )


def stored_numel(p) -> int:
    """The parameter's element count as the model has it: a ZeRO-3 partition's whole (`ds_numel`; its own numel()
    is 0), a 4-bit weight's unpacked shape (bitsandbytes packs two into a byte)."""
    if hasattr(p, "ds_numel"):
        return p.ds_numel
    quant_state = getattr(p, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        return quant_state.shape.numel()
    return p.numel()
