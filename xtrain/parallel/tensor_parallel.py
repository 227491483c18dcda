"""Tensor parallelism over the mesh's tp axis: the model's plan (transformers' `tp_plan`), applied before FSDP2 shards
over the data-parallel axes, and what the loop and evals need of a mesh whose tp ranks share one batch."""

from __future__ import annotations

import contextlib
import re


def tensor_parallel_plan(model) -> dict[str, str]:
    """The model's tensor-parallel plan, one entry per module or parameter (transformers' `tp_plan` expanded). A
    tied weight is split once, under its first name (the head's hooks stay: `tie_weights` ties it again after)."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        return {}
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_modules()}
    if not hasattr(model, "_expand_parallel_plan"):  # transformers < 5.24 (no TP here): the split weights, for the plan
        rules = [(re.compile(re.escape(key).replace(r"\*", r"\d+")), style) for key, style in plan.items()]
        return {name: style for name in names for rule, style in rules
                if rule.fullmatch(name.removesuffix(".weight").removesuffix(".bias"))}
    return {name: style for name, style in model._expand_parallel_plan(plan).items() if name in names}


def apply_tensor_parallel(accelerator, model):
    """The model's weights split over the mesh's tp axis as its plan says (columns or rows of each projection,
    the vocabulary of the embedding and head), with the forward hooks that gather and reduce what they must."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    model = apply_tensor_parallelism(model, accelerator.torch_device_mesh["tp"], tensor_parallel_plan(model))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


@contextlib.contextmanager
def split_already(accelerator):
    """Around `accelerator.prepare` of a model `apply_tensor_parallel` split: Accelerate's own TP preparation (each
    other parameter made a replicated DTensor through a transformers class transformers 5 no longer has) is left
    out; FSDP2 then shards over the data-parallel axes, the split weights as 2-D DTensors, the rest over those axes
    alone, as transformers' own FSDP2 x TP does."""
    pc = accelerator.parallelism_config
    if pc is None or not pc.tp_enabled:
        yield
        return
    tp, pc.tp_size = pc.tp_size, 1  # (`tp_enabled` reads it; the mesh is built)
    try:
        yield
    finally:
        pc.tp_size = tp


def data_parallel_size(accelerator) -> int:
    """The ranks that train on different data: the world, less the tensor-parallel copies of each batch."""
    pc = accelerator.parallelism_config
    return pc.data_parallel_size if pc is not None and pc.total_size > 1 else accelerator.num_processes


def gather_data_parallel(accelerator, data):
    """`gather_for_metrics` over the data-parallel ranks: a tensor-parallel group's ranks hold the same batch, and
    only its first rank's copy is kept (in rank order, as Accelerate's samplers deal the batches), the padding
    Accelerate adds to the last batch then dropped as `gather_for_metrics` drops it."""
    tp = accelerator.num_processes // data_parallel_size(accelerator)
    if tp == 1:
        return accelerator.gather_for_metrics(data)
    import torch
    from accelerate.utils import recursively_apply

    state = accelerator.gradient_state
    remainder = state.remainder if state.end_of_dataloader else 0

    def first_of_each_group(tensor):
        every = accelerator.gather(tensor.contiguous())
        kept = every.reshape(accelerator.num_processes, -1, *tensor.shape[1:])[::tp].flatten(0, 1)
        return kept[:remainder] if remainder > 0 else kept

    return recursively_apply(first_of_each_group, data, test_type=torch.is_tensor)
