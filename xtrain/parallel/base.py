"""What a strategy is to the rest of xtrain: one `Parallelism` per strategy (ddp.py, zero.py, fsdp.py), each
answering every question the layers above ask of a strategy. Nothing outside this folder branches on the strategy's
name; it asks the run's Parallelism (`strategies.of(cfg)`).

The questions, in the order a run asks them: its dims (the one effective-batch formula: dims.py), what this config
and machine cannot run (`refusal`, `check`), the block FSDP wraps, the plugin settings the plan shows and the
Accelerator gets, the launch files, the model's preparation (one visible order: fp8 conversion, meta weights made
real or sharded, compile, tensor parallelism, then `accelerator.prepare`), the memory of its model states, its
checkpoint form and the Accelerate setup it must get.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from xtrain.config.schema import ModelSource, Precision, RunConfig
from xtrain.parallel import dims

# the forms a checkpoint's model and optimizer are written in (engine/reshard.py moves between them)
DDP_FORM, FSDP_SHARDED_FORM, FSDP_FULL_FORM, DEEPSPEED_FORM = "ddp", "fsdp sharded", "fsdp full", "deepspeed"
PIPELINE_FORM = "pipeline"  # each pipeline stage's weights and optimizer state, by the whole model's names


@dataclass(frozen=True)
class ModelFacts:
    """What the plugins need to know about the model (from the meta-device model)."""

    hidden_size: int
    wrap_layer: str = ""
    trainable: int | None = None  # parameters that train, where not all do (LoRA)
    quantized: int = 0  # frozen parameters held in 4 bits (QLoRA's base)
    model_class: str = ""
    tp_plan: bool = False  # the model has a tensor-parallel plan
    heads: int | None = None  # attention heads, key/value heads (what tensor parallelism splits)
    kv_heads: int | None = None
    layers: int | None = None  # the shapes activations are estimated from (a transformers config's)
    intermediate: int | None = None
    vocab: int | None = None
    tp_split: int = 0  # parameters the tensor-parallel plan splits
    fp8_layers: tuple = ()  # the linear layers torchao trains in fp8 (fp8.layers)


ADAM_STATE = 8.0  # bytes a parameter: Adam's two fp32 moments


def bytes_per_param(precision: Precision, state: float = ADAM_STATE) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) for an optimizer keeping `state` bytes a parameter (Adam's 8); under
    mixed precision the optimizer also holds the fp32 master copy."""
    if precision is Precision.fp32:
        return 4, 4, state
    return 2, 2, 4 + state


def built_from_config(cfg: RunConfig) -> bool:
    return getattr(cfg.model, "source", None) is ModelSource.config


class Parallelism:
    """One strategy. The answers here are those of a strategy with nothing of its own; each module overrides what
    its strategy changes."""

    name = ""  # the strategy's words in messages: "DDP", "FSDP", "DeepSpeed ZeRO"
    accelerate_type = "MULTI_GPU"  # Accelerate's DistributedType for it (its launch config's distributed_type)
    owns_precision = False  # it casts the model itself (DeepSpeed's bf16/fp16 sections), not Accelerate's autocast
    compiles_in_prepare = False  # Accelerate compiles the model in `prepare` (its dynamo plugin)
    shards_fp8_weights = False  # torchao's fp8 weights are sharded, and all-gathered in fp8
    settings_title = ""  # what the plan calls its `settings`

    def dims(self, cfg: RunConfig) -> dims.ParallelDims:
        return dims.of(cfg)

    def refusal(self, cfg: RunConfig, cuda: bool) -> str | None:
        """Why this machine cannot run the strategy (`cuda`: the nodes that train have CUDA GPUs), or None."""
        return None

    def check_machine(self, cfg: RunConfig) -> None:
        """A ConfigError where this machine lacks what the strategy's settings need (beyond its GPUs)."""

    def check(self, cfg: RunConfig, facts: ModelFacts) -> None:
        """What this config cannot be for this model, one ConfigError, before anything starts."""

    def wrap_layer(self, cfg: RunConfig, meta_model) -> str:
        """The block class the strategy wraps ("": none)."""
        return ""

    def settings(self, cfg: RunConfig, facts: ModelFacts) -> dict:
        """The plugin settings the plan shows (a DeepSpeed config, FSDP's plugin fields; {}: none)."""
        return {}

    def plugin(self, cfg: RunConfig, facts: ModelFacts) -> dict:
        """The Accelerator's keyword arguments that carry the strategy (its plugin, its mesh)."""
        return {}

    def launch_config(self, cfg: RunConfig, facts: ModelFacts, files: dict, cuda: bool) -> dict:
        """The strategy's part of an `accelerate launch` config file (`files`: what `launch_files` wrote)."""
        return {"distributed_type": self.accelerate_type}

    def launch_files(self, cfg: RunConfig, facts: ModelFacts) -> dict[str, str]:
        """Files beside the accelerate config file that it names: {file name: text}."""
        return {}

    def accelerate_types(self, world: int) -> set[str]:
        """Accelerate's DistributedType values a run of `world` processes must get (else it fell back silently)."""
        return {self.accelerate_type}

    def trains_in_process(self, world: int) -> bool:
        """One process that trains in the driver's own (no launcher's environment needed)."""
        return False

    def steps_fused(self, cfg: RunConfig) -> bool:
        """xtrain's AdamW steps on the GPU (so `trainer.fused_optimizer=auto` fuses it)."""
        return False

    def async_save_refusal(self, cfg: RunConfig) -> str | None:
        """Why its checkpoints cannot be written behind training (`trainer.async_save`), or None where they can,
        exactly: Accelerate's files of this strategy, staged (engine/staging.py)."""
        return None

    def staged_per_node(self, cfg: RunConfig, weights: float, optimizer: float) -> float:
        """Host bytes a node holds for one asynchronous save, from one device's `weights` and `optimizer` state bytes:
        here the main process (on the first node) writes the model and its optimizer, every device's copy whole."""
        return weights + optimizer

    def optimizer_on_host(self, cfg: RunConfig) -> bool:
        """The optimizer steps on the host (its states offloaded there), not where the model trains."""
        return False

    def recomputes_activations(self, cfg: RunConfig) -> bool:
        """Each block's activations are recomputed in backward (activation checkpointing)."""
        return False

    def builds_on_meta(self, cfg: RunConfig) -> bool:
        """A model built from config is built on the meta device, its weights made where they train."""
        return False

    def state_bytes(self, cfg: RunConfig, state: float) -> tuple[float, float, float]:
        """Bytes of weights, gradients and optimizer states a parameter costs one device (`state`: what the
        optimizer keeps a parameter; AdamW's 8)."""
        raise NotImplementedError

    def local_parameters(self, cfg: RunConfig, count: int | None, tp_split: int) -> float | None:
        """Of `count` parameters, those one device holds the states of (tensor parallelism splits `tp_split`)."""
        return count

    def checkpoint_form(self, cfg: RunConfig) -> str:
        """The form its Accelerate writes and loads a checkpoint's model and optimizer in."""
        return DDP_FORM

    def prepare_model(self, cfg: RunConfig, accelerator, model):
        """The model made ready for `accelerator.prepare`, step by step in the order they must come."""
        from xtrain.parallel import compiling, fp8, meta_init

        if fp8.with_torchao(cfg):
            fp8.convert(model, cfg.precision, fsdp=self.shards_fp8_weights)
        if meta_init.is_lazy(model):
            model = meta_init.materialize(model, accelerator.device)
        if cfg.trainer.compile and not self.compiles_in_prepare:
            compiling.compile_blocks(model)
        return model

    def preparing(self, accelerator):
        """A context around `accelerator.prepare`."""
        return contextlib.nullcontext()

    def prepare(self, accelerator, model, optimizer, train_loader, val_loader, scheduler):
        """The model, optimizer, loaders and schedule made ready to train (Accelerate's `prepare`)."""
        with self.preparing(accelerator):
            return accelerator.prepare(model, optimizer, train_loader, val_loader, scheduler)

    def prepare_loader(self, accelerator, model, loader):
        """Another loader (a test split's), dealt over the ranks as the val loader is."""
        return accelerator.prepare(loader)

    def train_step(self, accelerator, c, micro: list, per, max_grad_norm: float):
        """One optimizer step's forward and backward passes over its micro-batches, the gradients clipped, the
        optimizer and schedule stepped (engine/update.py weights the loss: `per`); returns the micro-batches' summed
        loss and this rank's share of the units they trained on."""
        import torch

        loss_sum, count = torch.zeros((), device=accelerator.device), 0
        for batch in micro:
            count += c.task.count(batch)
            with accelerator.accumulate(c.model):
                loss = c.task.loss(c.model, batch, per)
                accelerator.backward(loss)
                if accelerator.sync_gradients and max_grad_norm > 0:
                    accelerator.clip_grad_norm_(c.model.parameters(), max_grad_norm)
                c.optimizer.step()
                c.optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        if not accelerator.optimizer_step_was_skipped:
            c.scheduler.step()
        return loss_sum, count

    def eval_losses(self, accelerator, task, model, batch):
        """The batch's per-sequence eval losses and counts (the task's), gathered over the data-parallel ranks."""
        from xtrain.parallel import tensor_parallel

        return tensor_parallel.gather_data_parallel(accelerator, task.eval_losses(model, batch))

    def whole_state_dict(self, accelerator, model):
        """The whole model's weights on the main process (a collective where the model is sharded)."""
        return accelerator.get_state_dict(model)

    def whole_parameters(self, model, counted: int) -> int:
        """The whole model's parameters, from the `counted` ones of this rank's model."""
        return counted

    def whole_model(self, accelerator, model):
        """The model whose class and config an export writes the weights as."""
        return accelerator.unwrap_model(model)

    def held_activations(self, cfg: RunConfig, per_layer: float, layers: int, final: float) -> float:
        """Activations a device holds for backward per sequence of trainer.batch_size, from one layer's
        (`per_layer`) and the final norm's and head's (`final`)."""
        return per_layer * layers + final
