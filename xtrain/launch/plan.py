"""The preflight plan: facts derived from a RunConfig before anything starts: topology, batch sizes, the
plugin settings, and the per-device estimate of model-state memory (estimate.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from xtrain.config.schema import DataConfig, ModelConfig, RunConfig, TargetModel, TaskKind
from xtrain.config.task import block_tokens, given
from xtrain.core import machine
from xtrain.core.memory import size
from xtrain.core.errors import ConfigError
from xtrain.parallel import dims, fp8, plugins, strategies
from xtrain.parallel.estimate import GB, Memory, device_memory, smallest_fit
from xtrain.engine import optim
from xtrain.launch import hardware
from xtrain.tasks.facts import model_facts

log = logging.getLogger("xtrain")


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
    on_cpu: bool = False  # device_memory_gb is RAM, which the processes of a machine share
    job_nodes: bool = False  # ... a SLURM job's nodes' (cluster.mem_gb), not this machine's
    optimizer_state: float | None = None  # bytes a parameter the run's own optimizer keeps (measured); None: AdamW's
    staging: float = 0.0  # host bytes a node holds for an asynchronous save (trainer.async_save)

    @property
    def sharing(self) -> int:
        """The processes that share `device_memory_gb`."""
        return self.cfg.cluster.processes_per_node if self.on_cpu else 1

    @property
    def fits(self) -> bool | None:
        if self.device_memory_gb is None:
            return None
        return self.memory.total * self.sharing + (self.staging if self.on_cpu else 0) <= self.device_memory_gb * GB


def make(cfg: RunConfig, refusal: str | None, local_gpu_gb: float | None, ram_gb: float | None = None,
         job_nodes: bool = False) -> Plan:
    """`local_gpu_gb`: this machine's GPU memory (or `cluster.gpu_memory_gb`); `ram_gb`: its RAM, where the run trains
    on its CPU (its processes share it, and only the run's own strategy runs there); `job_nodes`: the run is a SLURM
    job on CPU nodes, and `ram_gb` is theirs (`cluster.mem_gb`, None where not given)."""
    n_params, facts = model_facts(cfg)
    settings = strategies.of(cfg).settings(cfg, facts)
    state = optim.state_bytes(cfg)
    memory = device_memory(n_params, cfg, facts, state)
    on_cpu = job_nodes or ram_gb is not None and not cfg.cluster.gpu_memory_gb
    device_gb = ram_gb if on_cpu else cfg.cluster.gpu_memory_gb or local_gpu_gb
    staging = (strategies.of(cfg).staged_per_node(cfg, memory.params, memory.optimizer)
               if cfg.trainer.async_save is True else 0.0)
    plan = Plan(cfg, n_params, facts, memory, device_gb, None, refusal, settings, on_cpu, job_nodes, state, staging)
    if plan.fits is False:
        room = device_gb * GB - (staging if on_cpu else 0.0)  # (the staged copy is the same at any micro-batch)
        plan.fit = smallest_fit(n_params, cfg, facts, room / plan.sharing, own_strategy_only=on_cpu,
                                optimizer_state=state)
    return plan


def check_fits(cfg: RunConfig) -> None:
    """A run planned against `cluster.gpu_memory_gb` that the per-device estimate exceeds is refused, with the
    smallest change that fits."""
    if cfg.cluster.gpu_memory_gb is None:
        return
    plan = make(cfg, None, None)
    if not plan.fits:
        raise ConfigError(f"cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g}: {not_fitting(plan)}")


def for_this_machine(cfg: RunConfig, refusal: str | None = None) -> Plan:
    """The plan against this machine's memory: its GPU's, or without one (where the run trains here, on its CPU)
    its RAM."""
    gpu_gb = machine.local_gpu_gb()
    on_cpu = gpu_gb is None and refusal is None
    return make(cfg, refusal, gpu_gb, machine.ram_bytes() / GB if on_cpu else None)


def for_job(cfg: RunConfig, refusal: str | None = None) -> Plan:
    """The plan of a SLURM job (resolved): against `cluster.gpu_memory_gb`, or where the job asks for no GPU (it
    trains on its nodes' CPUs) against `cluster.mem_gb`, which the processes of a node share."""
    c = cfg.cluster
    if c.gpus or c.gpu_memory_gb is not None:
        return make(cfg, refusal, c.gpu_memory_gb)
    return make(cfg, refusal, None, c.mem_gb, job_nodes=True)


def check_memory(cfg: RunConfig) -> None:
    """A run whose estimate exceeds the memory it trains in (this machine's; a SLURM job's CPU nodes',
    `cluster.mem_gb`) is refused before anything starts or is queued, with the smallest change that fits (the
    estimate leaves out what backward holds at once: the run would not fit either); `cluster.check_memory=false`:
    told so in one line, and started as asked. One planned against `cluster.gpu_memory_gb` is `check_fits`'s."""
    if cfg.cluster.gpu_memory_gb is not None:
        return
    job = hardware.submitting_to_slurm(cfg.cluster)
    found = for_job(cfg) if job else for_this_machine(cfg)
    host = cfg.cluster.mem_gb if job else machine.ram_bytes() / GB
    if not found.on_cpu and host is not None and found.staging > host * GB:
        raise ConfigError(f"trainer.async_save=true: an asynchronous save stages a copy of the checkpointed state in "
                          f"host memory, {size(found.staging)} a node, and {'a node' if job else 'this machine'} has "
                          f"{host:.2f} GB; use trainer.async_save=false")
    if found.fits is False:
        where = "the job's nodes" if job else "this machine"
        what = f"the plan's estimate does not fit {where}: {fits_words(found).removeprefix('NO: ')}"
        if cfg.cluster.check_memory:
            raise ConfigError(f"memory: {what}; or set cluster.check_memory=false to start it anyway")
        log.warning("memory: %s (cluster.check_memory=false: starting it anyway)", what)


def not_fitting(plan: Plan) -> str:
    m = plan.memory
    needs = f"the plan needs {size(m.total)} per device ({size(m.states)} model states"
    needs += f" + {size(m.activations)} activations, estimated)" if m.activations is not None else ")"
    if plan.fit:
        return f"{needs}; {plan.fit[0]} would fit ({size(plan.fit[1].total)})"
    return f"{needs}; no strategy, tensor parallelism, activation checkpointing or micro-batch fits: use more devices"


def render(plan: Plan) -> str:
    cfg, t, c = plan.cfg, plan.cfg.trainer, plan.cfg.cluster
    layout = dims.of(cfg)
    effective = dims.effective_batch(cfg)
    m = plan.memory
    lines = [
        "xtrain plan (dry run: nothing was launched)",
        f"  topology     {c.nodes} node(s) x {c.processes_per_node} process(es) = world size {c.world_size} "
        f"(cluster={c.kind.value})",
        *mesh_lines(cfg, layout),
        f"  batch        micro {t.batch_size} x grad_accum {t.grad_accum} x "
        + (f"world {c.world_size}" if layout.data_parallel == c.world_size else f"data-parallel {layout.data_parallel}")
        + f" = {effective} " + batch_unit(cfg, effective),
        f"  model        {_model_name(cfg.model)}: {plan.n_params:,} parameters (counted on the meta device)"
        + (f"; LoRA rank {cfg.model.lora.rank} trains {plan.facts.trainable:,} "
           f"({plan.facts.trainable / plan.n_params:.2%})" if plan.facts.trainable is not None else ""),
        f"  strategy     {cfg.strategy.name.value}, precision {cfg.precision.name.value}{fp8_words(cfg, plan.facts)}, "
        f"optimizer {optimizer(cfg)}",
        f"  memory       per {'process' if plan.on_cpu else 'device'}: weights {size(m.params)} + gradients "
        f"{size(m.grads)} + optimizer {size(m.optimizer)} = {size(m.states)} model states",
        f"               ({optimizer_state_words(plan)})",
    ]
    if m.activations is None:
        lines.append("               activations: not estimated for this model (not included)")
    else:
        recompute = "recomputed per layer (activation checkpointing)" if strategies.of(cfg).recomputes_activations(cfg) else \
            "kept (no activation checkpointing)"
        lines.append(f"               + activations {size(m.activations)} (estimated: micro-batch {t.batch_size} x "
                     f"{cfg.data.block_size} tokens, {recompute}) = {size(m.total)}")
    if plan.facts.quantized:
        lines.append(f"               ({plan.facts.quantized:,} base weights in 4 bits: 0.5 bytes each, "
                     "no gradients or optimizer state)")
    if plan.staging:
        lines.append(f"  staging      {size(plan.staging)} of host memory a node: the copy an asynchronous save writes "
                     "from (trainer.async_save)")
    lines.append(f"  fits         {fits_words(plan)}")
    lines.append(f"  runs here    {'no: ' + plan.refusal if plan.refusal else 'yes'}")
    if plan.plugin_settings:
        title = strategies.of(cfg).settings_title
        body = json.dumps(plan.plugin_settings, indent=2).replace("\n", "\n  ")
        lines.append(f"  {title}:\n  {body}")
    return "\n".join(lines)


def fits_words(plan: Plan) -> str:
    """`yes: 1.20 GB of 80 GB`; on a machine's CPU `yes: 0.31 GB x 2 processes of 25.28 GB RAM (...)`; `NO: ...` with
    the smallest change that fits."""
    if plan.device_memory_gb is None:
        return ("unknown: set cluster.mem_gb (a node's memory) to check" if plan.job_nodes else
                "unknown: set cluster.gpu_memory_gb to check")
    each = f" x {plan.sharing} processes" if plan.sharing > 1 else ""
    need = size(plan.memory.total) + each + (f" + {size(plan.staging)} staging" if plan.on_cpu and plan.staging else "")
    has = f"{plan.device_memory_gb:.2f} GB RAM" if plan.on_cpu else f"{plan.device_memory_gb:g} GB"
    if plan.job_nodes:
        has = f"cluster.mem_gb={plan.device_memory_gb:g} GB"
    if plan.fits:
        where = "the job trains on its nodes' CPUs" if plan.job_nodes else "the run trains on this machine's CPU"
        return f"yes: {need} of {has}" + (f" (no GPU: {where})" if plan.on_cpu else "")
    if plan.fit:
        return f"NO: {need} > {has}; {plan.fit[0]} would ({size(plan.fit[1].total)}{each})"
    if plan.on_cpu:
        fewer = ", or fewer processes (cluster.num_processes)" if plan.sharing > 1 else ""
        fewer += ", or more memory (cluster.mem_gb)" if plan.job_nodes else ""
        return f"NO: {need} > {has}; no micro-batch fits: a smaller model or data.block_size{fewer}"
    return f"NO: {need} > {has}; nothing fits: use more devices (cluster.nodes / cluster.num_processes)"


def mesh_lines(cfg: RunConfig, layout: dims.ParallelDims) -> list[str]:
    """The mesh, where the run composes axes: each axis's first rank group, how many there are, and whether an
    axis's groups cross nodes (its collectives then go over the links between them). Axes of size 1 are left out."""
    if not layout.composed:
        return []
    per_node = cfg.cluster.processes_per_node
    lines = [f"  mesh         {layout.shape()}: {layout.words()}"]
    for axis in layout.axes():
        if getattr(layout, axis) == 1:
            continue
        groups = layout.groups(axis)
        crosses = any(len({rank // per_node for rank in group}) > 1 for group in groups)
        what = {"pp": "activations and their gradients sent between stages", "dp_replicate": "gradients all-reduced", "dp_shard": "weights gathered, gradients reduce-scattered",
                "tp": "activations all-reduced in every layer"}[axis]
        lines.append(f"               {axis:<12} {getattr(layout, axis)}: ranks {groups[0]}"
                     + (f" and {len(groups) - 1} more group(s) like it" if len(groups) > 1 else "")
                     + f"; {'crosses nodes' if crosses else 'within a node'} ({what})")
    return lines


def fp8_words(cfg: RunConfig, facts) -> str:
    """` (torchao, tensorwise: 15 linear layers in fp8)` for fp8 with torchao, else nothing."""
    if not fp8.with_torchao(cfg):
        return ""
    return f" (torchao, {cfg.precision.fp8_recipe.value}: {len(facts.fp8_layers)} linear layers in fp8)"


def optimizer_state_words(plan: Plan) -> str:
    """How the optimizer's bytes a parameter were counted: AdamW's, or the run's own optimizer's as measured."""
    if plan.optimizer_state is None:
        unmeasured = f"{optimizer(plan.cfg)}: not measured, so " if given(plan.cfg.trainer.optimizer) else ""
        return (f"{unmeasured}Adam; bytes/param weights+grads+optimizer: mixed precision 2+2+12 incl. fp32 master "
                "copy, fp32 4+4+8; FSDP and DDP keep fp32 weights and gradients: 4+4+8")
    state = f"{plan.optimizer_state:g}"
    return (f"{optimizer(plan.cfg)}: {state} bytes of state a parameter, measured; bytes/param weights+grads+optimizer: "
            f"mixed precision 2+2+(4+{state}) incl. fp32 master copy, fp32 4+4+{state}; FSDP and DDP keep fp32 weights "
            f"and gradients: 4+4+{state}")


def optimizer(cfg: RunConfig) -> str:
    """`AdamW (fused)`, `AdamW (foreach)`, `DeepSpeedCPUAdam`, or the user's `_target_`."""
    if given(cfg.trainer.optimizer):
        return cfg.trainer.optimizer["_target_"]
    if strategies.of(cfg).optimizer_on_host(cfg):
        return "DeepSpeedCPUAdam (on the host)"
    return f"AdamW ({'fused' if cfg.trainer.fused_optimizer is True else 'foreach'})"


def batch_unit(cfg: RunConfig, effective: int) -> str:
    """What an optimizer step's examples are: token blocks (counted in tokens), padded sequences, or examples."""
    data = cfg.data
    block = block_tokens(cfg.task.name.value, {"block_size": data.block_size, "source": data.source.value,
                                               "packing": getattr(data, "packing", True)}) if isinstance(data, DataConfig) else None
    if block is not None:
        return f"sequences = {effective * block} tokens per optimizer step"
    if cfg.task.name is TaskKind.causal_lm:
        return "sequences per optimizer step (each padded to the longest of its batch)"
    return "examples per optimizer step"


def _model_name(model: ModelConfig | TargetModel) -> str:
    if isinstance(model, TargetModel):
        return f"{model.target} (by _target_)"
    return model.name_or_path if model.name_or_path else f"{model.arch.value} (built from config)"
