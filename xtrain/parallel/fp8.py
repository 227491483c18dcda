"""fp8 with torchao: its recipe, and which linear layers train in fp8.

A layer trains in fp8 where torch's fp8 matmul can take it (both dimensions multiples of 16), unless it is the
model's first or last linear layer outside its repeated blocks (its input layer and output head: kept in bf16
for stability, as torchtitan keeps the head) or a part of its name is in `precision.fp8_skip`. A first or last
linear layer inside a block (a Llama's first is `model.layers.0.self_attn.q_proj`) converts like the same layer
of every other block: a block kept apart would be one more block to compile, and no more stable.

xtrain converts them (`convert`) as soon as the model is built: before FSDP2 shards it (torchao's fp8 all-gather
wraps the weights it shards), before it is compiled and before its optimizer exists. Accelerate's own pass at
`prepare` then has nothing left to convert (`converted_already`); it adds FSDP2's scale hook.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from xtrain.config.precision import Fp8Backend, Fp8Recipe, Precision, PrecisionConfig
from xtrain.core.errors import ConfigError

WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")  # (names wrappers add)



def with_torchao(cfg) -> bool:
    """The run trains in fp8 through torchao (its layers converted by xtrain, before `prepare`)."""
    return cfg.precision.name is Precision.fp8 and cfg.precision.fp8_backend is Fp8Backend.torchao

def plain(name: str) -> str:
    """A module's name without what activation checkpointing, compile or FSDP add to it."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def layers(model: torch.nn.Module, precision: PrecisionConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the linear layers that train in fp8, those kept in bf16), by name."""
    linears = [(plain(name), m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ends = {name for name, _ in linears[:1] + linears[-1:] if not in_a_block(name)}
    chosen = [name for name, m in linears if name not in ends and not any(part in name for part in precision.fp8_skip)
              and m.in_features % 16 == 0 and m.out_features % 16 == 0]
    return tuple(chosen), tuple(name for name, _ in linears if name not in chosen)


def in_a_block(name: str) -> bool:
    """Whether a module is inside one of the model's repeated blocks (a numbered part of its name: `layers.0.`)."""
    return any(part.isdigit() for part in name.split("."))


def check(precision: PrecisionConfig, chosen: tuple, model_class: str) -> None:
    """A run in fp8 with nothing to train in fp8 is refused (GPT-2's layers, for one, are Conv1D, not linear)."""
    if not chosen:
        skip = f", nor in precision.fp8_skip=[{','.join(precision.fp8_skip)}]" if precision.fp8_skip else ""
        raise ConfigError(
            f"precision=fp8: no linear layer of {model_class} can train in fp8 with torchao (it takes nn.Linear layers "
            f"with sides that are multiples of 16, other than its input layer and output head{skip}); use a model with "
            "such layers (e.g. model=tiny_llama) or precision=bf16"
        )


def convert(model: torch.nn.Module, precision: PrecisionConfig, fsdp: bool) -> None:
    """The layers `layers` chooses, made torchao's `Float8Linear` (in place)."""
    from torchao.float8 import convert_to_float8_training

    chosen = frozenset(layers(model, precision)[0])
    convert_to_float8_training(model, config=config(precision, fsdp),
                               module_filter_fn=lambda _, name: plain(name) in chosen)


def converted_already(module: torch.nn.Module, name: str) -> bool:
    """Accelerate's module filter: `convert` has converted every layer that trains in fp8."""
    return False


def config(precision: PrecisionConfig, fsdp: bool):
    """torchao's `Float8LinearConfig` for the recipe. Inner dimensions are padded to multiples of 16 (a batch of
    any size); under FSDP2 tensorwise weights are all-gathered in fp8 (rowwise has no fp8 all-gather)."""
    from torchao.float8 import Float8LinearConfig

    recipe = Float8LinearConfig.from_recipe_name(precision.fp8_recipe.value)
    return dataclasses.replace(recipe, pad_inner_dim=True,
                               enable_fsdp_float8_all_gather=fsdp and precision.fp8_recipe is Fp8Recipe.tensorwise)


@dataclass(frozen=True)
class Trained:
    """What a prepared model trains in fp8: the converted linear layers, the others, the recipe's scaling."""

    converted: tuple
    kept: tuple
    scaling: str

    def words(self) -> str:
        """The log's line: `fp8 (torchao, tensorwise): 23 of 29 linear layers; in bf16: lm_head, ...`."""
        shown = ", ".join(self.kept[:3]) + (f" and {len(self.kept) - 3} more" if len(self.kept) > 3 else "")
        return (f"fp8 (torchao, {self.scaling}): {len(self.converted)} of {len(self.converted) + len(self.kept)} "
                f"linear layers" + (f"; in bf16: {shown}" if self.kept else ""))


def trained(model: torch.nn.Module) -> Trained:
    """Read from the prepared model's layers (what trains, not what was asked)."""
    from torchao.float8.float8_linear import Float8Linear

    linears = [(plain(name), m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    converted = [m for _, m in linears if isinstance(m, Float8Linear)]
    axiswise = bool(converted) and converted[0].config.cast_config_input.scaling_granularity.value == "axiswise"
    return Trained(converted=tuple(name for name, m in linears if isinstance(m, Float8Linear)),
                   kept=tuple(name for name, m in linears if not isinstance(m, Float8Linear)),
                   scaling="rowwise" if axiswise else "tensorwise")


def unwrapped(state_dict: dict) -> dict:
    """`state_dict` with torchao's weights wrapped for FSDP2's fp8 all-gather as the plain tensors they wrap. A full
    state dict keeps the wrapper where one rank holds every shard, and safetensors cannot save it."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def plain_tensor(tensor):
        if not is_traceable_wrapper_subclass(tensor) or type(tensor).__name__ == "DTensor":
            return tensor
        inner, _ = tensor.__tensor_flatten__()
        return getattr(tensor, inner[0]) if len(inner) == 1 else tensor

    return {name: plain_tensor(tensor) for name, tensor in state_dict.items()}
