"""The preflight plan: facts derived from a RunConfig before anything starts: topology, batch sizes, the
plugin settings, and the per-device estimate of model-state memory (estimate.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from xtrain.config.schema import DataConfig, ModelConfig, Offload, RunConfig, Strategy, TargetModel, TaskKind
from xtrain.config.task import block_tokens, given
from xtrain.distributed import plugins
from xtrain.distributed.estimate import GB, Memory, first_fit, model_state_memory
from xtrain.tasks.facts import model_facts

@dataclass
class Plan:
    cfg: RunConfig
    n_params: int
    facts: plugins.ModelFacts
    memory: Memory
    device_memory_gb: float | None
    fit: tuple[str, Memory] | None
    refusal: str | None
    plugin_settings: dict

    @property
    def fits(self) -> bool | None:
        if self.device_memory_gb is None:
            return None
        return self.memory.total <= self.device_memory_gb * GB


def make(cfg: RunConfig, refusal: str | None, local_gpu_gb: float | None) -> Plan:
    n_params, facts = model_facts(cfg)
    if plugins.is_zero(cfg.strategy):
        settings = plugins.deepspeed_config(cfg, facts, plugins.load_user_deepspeed_config(cfg.strategy))
    elif cfg.strategy.name is Strategy.fsdp:
        settings = plugins.fsdp_settings(cfg.strategy, facts)
    else:
        settings = {}
    memory = model_state_memory(n_params, cfg, facts.trainable, facts.quantized)
    device_gb = cfg.cluster.gpu_memory_gb or local_gpu_gb
    fit = None
    if device_gb is not None and memory.total > device_gb * GB:
        fit = first_fit(n_params, cfg, device_gb * GB, facts.trainable, facts.quantized)
    return Plan(cfg, n_params, facts, memory, device_gb, fit, refusal, settings)


def render(plan: Plan) -> str:
    cfg, t, c = plan.cfg, plan.cfg.trainer, plan.cfg.cluster
    effective = t.batch_size * t.grad_accum * c.world_size
    m = plan.memory
    lines = [
        "xtrain plan (dry run: nothing was launched)",
        f"  topology     {c.nodes} node(s) x {c.processes_per_node} process(es) = world size {c.world_size} "
        f"(cluster={c.kind.value})",
        f"  batch        micro {t.batch_size} x grad_accum {t.grad_accum} x world {c.world_size} = {effective} "
        + batch_unit(cfg, effective),
        f"  model        {_model_name(cfg.model)}: {plan.n_params:,} parameters (counted on the meta device)"
        + (f"; LoRA rank {cfg.model.lora.rank} trains {plan.facts.trainable:,} "
           f"({plan.facts.trainable / plan.n_params:.2%})" if plan.facts.trainable is not None else ""),
        f"  strategy     {cfg.strategy.name.value}, precision {cfg.precision.name.value}, optimizer {optimizer(cfg)}",
        f"  memory       per device, model states only: weights {size(m.params)} + gradients "
        f"{size(m.grads)} + optimizer {size(m.optimizer)} = {size(m.total)}",
        "               (Adam; bytes/param weights+grads+optimizer: mixed precision 2+2+12 incl. fp32 master copy, "
        "fp32 4+4+8; activations not included)",
    ]
    if plan.facts.quantized:
        lines.append(f"               ({plan.facts.quantized:,} base weights in 4 bits: 0.5 bytes each, "
                     "no gradients or optimizer state)")
    if plan.device_memory_gb is None:
        lines.append("  fits         unknown: set cluster.gpu_memory_gb to check")
    elif plan.fits:
        lines.append(f"  fits         yes: {size(m.total)} of {plan.device_memory_gb:g} GB")
    else:
        advice = (
            f"{plan.fit[0]} would ({size(plan.fit[1].total)})" if plan.fit
            else "no ZeRO stage or offload fits: use more devices (cluster.nodes / cluster.num_processes)"
        )
        lines.append(f"  fits         NO: {size(m.total)} > {plan.device_memory_gb:g} GB; {advice}")
    lines.append(f"  runs here    {'no: ' + plan.refusal if plan.refusal else 'yes'}")
    if plan.plugin_settings:
        title = "deepspeed.json" if plugins.is_zero(cfg.strategy) else "fsdp plugin"
        body = json.dumps(plan.plugin_settings, indent=2).replace("\n", "\n  ")
        lines.append(f"  {title}:\n  {body}")
    return "\n".join(lines)


def optimizer(cfg: RunConfig) -> str:
    """`AdamW (fused)`, `AdamW (foreach)`, `DeepSpeedCPUAdam`, or the user's `_target_`."""
    if given(cfg.trainer.optimizer):
        return cfg.trainer.optimizer["_target_"]
    if cfg.strategy.offload_optimizer is not Offload.none:
        return "DeepSpeedCPUAdam (on the host)"
    return f"AdamW ({'fused' if cfg.trainer.fused_optimizer is True else 'foreach'})"


def batch_unit(cfg: RunConfig, effective: int) -> str:
    """What an optimizer step's examples are: token blocks (counted in tokens), padded sequences, or examples."""
    data = cfg.data
    block = block_tokens(cfg.task.name.value, {"block_size": data.block_size, "source": data.source.value,
                                               "packing": data.packing}) if isinstance(data, DataConfig) else None
    if block is not None:
        return f"sequences = {effective * block} tokens per optimizer step"
    if cfg.task.name is TaskKind.causal_lm:
        return "sequences per optimizer step (each padded to the longest of its batch)"
    return "examples per optimizer step"


def size(n_bytes: float) -> str:
    return f"{n_bytes / GB:.2f} GB" if n_bytes >= 0.1 * GB else f"{n_bytes / 1e6:.1f} MB"


def _model_name(model: ModelConfig | TargetModel) -> str:
    if isinstance(model, TargetModel):
        return f"{model.target} (by _target_)"
    return model.name_or_path if model.name_or_path else f"{model.arch.value} (built from config)"
