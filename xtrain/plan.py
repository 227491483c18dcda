"""The preflight plan: facts derived from a RunConfig before anything starts.

Topology, batch sizes, the plugin settings, and a per-device estimate of model-state
memory. The estimate follows the ZeRO paper (Rajbhandari et al., 2020, section 3):
with mixed-precision Adam each parameter costs 2 bytes of 16-bit weights, 2 bytes of
16-bit gradients and K = 12 bytes of optimizer state (fp32 master weights, momentum,
variance); with fp32 training it is 4 + 4 + 8 (no master copy). DDP keeps fp32 weights and
gradients under autocast too (4 + 4 + 8 at any precision: the same 16 bytes, held differently), its
gradient buckets being views of the gradients (`gradient_as_bucket_view`), and replicates all of it; ZeRO-1 partitions the optimizer state over the N data-parallel ranks, ZeRO-2 also
the gradients, ZeRO-3 also the weights. FSDP keeps fp32 weights sharded (mixed precision
casts them per layer), so full_shard costs 16 / N bytes per parameter. Activations,
temporary buffers, fragmentation and the CUDA context are not included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from xtrain import plugins
from xtrain.config import FsdpSharding, Offload, Precision, RunConfig, Strategy, TargetModel

GB = 1e9  # decimal gigabytes, as in the ZeRO paper's figures


@dataclass(frozen=True)
class Memory:
    """Bytes per device for model states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def bytes_per_param(precision: Precision) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) for Adam."""
    if precision is Precision.fp32:
        return 4, 4, 8
    return 2, 2, 12


def model_state_memory(n_params: int, cfg: RunConfig, trainable: int | None = None) -> Memory:
    """Model-state bytes per device; with `trainable` (LoRA) only those parameters have gradients and
    optimizer states, the rest weights alone."""
    s = cfg.strategy
    n = cfg.cluster.world_size
    w, g, k = bytes_per_param(cfg.precision.name)
    if s.name is Strategy.ddp:  # autocast: fp32 weights and gradients, whatever the precision
        params, grads, opt = 4, 4, 8
    elif s.name is Strategy.zero1:
        params, grads, opt = w, g, k / n
    elif s.name is Strategy.zero2:
        params, grads, opt = w, g / n, k / n
    elif s.name is Strategy.zero3:
        params, grads, opt = w / n, g / n, k / n
    else:  # FSDP keeps fp32 weights and gradients, sharded over its sharding group
        sharding = s.sharding if s.fsdp_version == 1 else FsdpSharding.full_shard
        group = min(n, cfg.cluster.processes_per_node) if sharding is FsdpSharding.hybrid_shard else n
        if sharding is FsdpSharding.no_shard:
            group = 1
        params = 4 if sharding is FsdpSharding.shard_grad_op else 4 / group
        grads, opt = 4 / group, 8 / group
        if s.cpu_offload:
            params = grads = opt = 0
    if s.offload_optimizer is not Offload.none:
        opt = 0
    if s.offload_param is not Offload.none:
        params = 0
    trained = n_params if trainable is None else trainable
    return Memory(params * n_params, grads * trained, opt * trained)


# From least to most memory-saving: what to suggest when a plan does not fit.
_ALTERNATIVES = [
    ("strategy=ddp", dict(name=Strategy.ddp)),
    ("strategy=zero1", dict(name=Strategy.zero1)),
    ("strategy=zero2", dict(name=Strategy.zero2)),
    ("strategy=zero3", dict(name=Strategy.zero3)),
    ("strategy=zero3 strategy.offload_optimizer=cpu", dict(name=Strategy.zero3, offload_optimizer=Offload.cpu)),
    (
        "strategy=zero3 strategy.offload_optimizer=cpu strategy.offload_param=cpu",
        dict(name=Strategy.zero3, offload_optimizer=Offload.cpu, offload_param=Offload.cpu),
    ),
]


def first_fit(n_params: int, cfg: RunConfig, device_bytes: float) -> tuple[str, Memory] | None:
    for overrides, fields in _ALTERNATIVES:
        strategy = replace(cfg.strategy, **{"offload_optimizer": Offload.none, "offload_param": Offload.none, **fields})
        memory = model_state_memory(n_params, replace(cfg, strategy=strategy))
        if memory.total <= device_bytes:
            return overrides, memory
    return None


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


_FACTS: dict[str, tuple[int, plugins.ModelFacts]] = {}


def model_facts(cfg: RunConfig) -> tuple[int, plugins.ModelFacts]:
    """Parameter count and plugin facts from the model on the meta device (no memory, seconds for 70B).
    Kept per model for the process: a sweep's points mostly share theirs."""
    key = repr((cfg.model, cfg.data, cfg.strategy.name, cfg.strategy.wrap_layer))
    if key not in _FACTS:
        _FACTS[key] = _model_facts(cfg)
    return _FACTS[key]


def _model_facts(cfg: RunConfig) -> tuple[int, plugins.ModelFacts]:
    from xtrain import model as models, tasks

    meta = tasks.for_config(cfg).on_meta()
    n_params = sum(p.numel() for p in meta.parameters())
    wrap = models.fsdp_wrap_layer(cfg.strategy.wrap_layer, meta) if cfg.strategy.name is Strategy.fsdp else ""
    trainable = None
    if cfg.model.lora.enabled:
        from xtrain import lora

        trainable = lora.check(meta, cfg.model.lora)
    hidden = getattr(getattr(meta, "config", None), "hidden_size", None)
    if hidden is None:  # a module without a transformers config: ZeRO's buckets sized by its largest weight
        hidden = max((int(p.numel() ** 0.5) for p in meta.parameters()), default=1)
    return n_params, plugins.ModelFacts(hidden_size=hidden, wrap_layer=wrap, trainable=trainable)


def make(cfg: RunConfig, refusal: str | None, local_gpu_gb: float | None) -> Plan:
    n_params, facts = model_facts(cfg)
    if plugins.is_zero(cfg):
        settings = plugins.deepspeed_config(cfg, facts, plugins.load_user_deepspeed_config(cfg))
    elif cfg.strategy.name is Strategy.fsdp:
        settings = plugins.fsdp_settings(cfg, facts)
    else:
        settings = {}
    memory = model_state_memory(n_params, cfg, facts.trainable)
    device_gb = cfg.cluster.gpu_memory_gb or local_gpu_gb
    fit = None
    if device_gb is not None and memory.total > device_gb * GB:
        fit = first_fit(n_params, cfg, device_gb * GB)
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
        + (f"sequences = {effective * cfg.data.block_size} tokens per optimizer step" if hasattr(cfg.data, "block_size")
           else "examples per optimizer step"),
        f"  model        {_model_name(cfg)}: {plan.n_params:,} parameters (counted on the meta device)"
        + (f"; LoRA rank {cfg.model.lora.rank} trains {plan.facts.trainable:,} "
           f"({plan.facts.trainable / plan.n_params:.2%})" if plan.facts.trainable is not None else ""),
        f"  strategy     {cfg.strategy.name.value}, precision {cfg.precision.name.value}",
        f"  memory       per device, model states only: weights {size(m.params)} + gradients "
        f"{size(m.grads)} + optimizer {size(m.optimizer)} = {size(m.total)}",
        "               (Adam; bytes/param weights+grads+optimizer: mixed precision 2+2+12 incl. fp32 master copy, "
        "fp32 4+4+8; activations not included)",
    ]
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
        title = "deepspeed.json" if plugins.is_zero(cfg) else "fsdp plugin"
        body = json.dumps(plan.plugin_settings, indent=2).replace("\n", "\n  ")
        lines.append(f"  {title}:\n  {body}")
    return "\n".join(lines)


def size(n_bytes: float) -> str:
    return f"{n_bytes / GB:.2f} GB" if n_bytes >= 0.1 * GB else f"{n_bytes / 1e6:.1f} MB"


def _model_name(cfg: RunConfig) -> str:
    if isinstance(cfg.model, TargetModel):
        return f"{cfg.model.target} (by _target_)"
    return cfg.model.name_or_path if cfg.model.name_or_path else f"{cfg.model.arch.value} (built from config)"
