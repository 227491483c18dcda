"""The device mesh of a run: dp_replicate x dp_shard x tp ranks, from `strategy.dp_replicate` and `strategy.tp`.

Ranks fill the mesh in that order (tp fastest, as torch's `init_device_mesh` and Accelerate's `ParallelismConfig`
lay it out): with 2 x 2 x 2 on 8 ranks, ranks 0-1 are one tensor-parallel group, 0,2 one shard group, 0,4 one
replica group. Data-parallel ranks are replicas x shards: the ranks of a tensor-parallel group train on the same
batch. Under DDP and ZeRO every rank is a data-parallel rank of one axis.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, replace

from xtrain.config.schema import RunConfig, Strategy
from xtrain.core.errors import ConfigError

AXES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Mesh:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks that each train on their own part of a step's batch."""
        return self.dp_replicate * self.dp_shard

    def effective_batch(self, batch_size: int, grad_accum: int) -> int:
        """What one optimizer step trains on (sequences, examples): the micro-batch x grad_accum x the data-parallel
        ranks (a tensor-parallel group's ranks share one batch)."""
        return batch_size * grad_accum * self.data_parallel

    @property
    def composed(self) -> bool:
        """More than one axis (replicas of shards, or TP): the run needs Accelerate's ParallelismConfig."""
        return self.tp > 1 or self.dp_replicate > 1 and self.dp_shard > 1

    def shape(self) -> str:
        return " x ".join(str(getattr(self, axis)) for axis in AXES) + " (" + " x ".join(AXES) + ")"

    def groups(self, axis: str) -> list[list[int]]:
        """The rank groups along `axis`: each a list of global ranks that differ only in that axis's index."""
        sizes = [getattr(self, a) for a in AXES]
        strides = [sizes[1] * sizes[2], sizes[2], 1]
        k = AXES.index(axis)
        groups = []
        for rank in range(self.world):
            if (rank // strides[k]) % sizes[k] == 0:
                groups.append([rank + i * strides[k] for i in range(sizes[k])])
        return groups

    def words(self) -> str:
        """`HSDP: 2 replicas x 2 shards`, `FSDP x TP: 2 shards x 2-way TP`."""
        name = ("HSDP" if self.dp_replicate > 1 else "FSDP") + (" x TP" if self.tp > 1 else "")
        parts = [f"{self.dp_replicate} replicas"] if self.dp_replicate > 1 else []
        parts.append(f"{self.dp_shard} shards")
        if self.tp > 1:
            parts.append(f"{self.tp}-way TP")
        return f"{name}: {' x '.join(parts)}"

    def as_dict(self) -> dict:
        return {axis: getattr(self, axis) for axis in AXES}


def layout(strategy: str, world: int, dp_replicate=1, tp: int = 1) -> Mesh:
    """The mesh of `strategy` (its name) on `world` ranks: DDP's are replicas, ZeRO's shards, FSDP2's replicas of
    shards of tensor-parallel groups."""
    if strategy == Strategy.ddp.value:
        return Mesh(dp_replicate=world)
    if strategy != Strategy.fsdp.value:
        return Mesh(dp_shard=world)
    replicas = int(dp_replicate)
    return Mesh(dp_replicate=replicas, dp_shard=world // (replicas * tp), tp=tp)


def of(cfg: RunConfig) -> Mesh:
    """The run's mesh (its world resolved: `cluster.num_processes` and `strategy.dp_replicate` made concrete)."""
    s = cfg.strategy
    return layout(s.name.value, cfg.cluster.world_size, s.dp_replicate, s.tp)


def effective_batch(cfg: RunConfig) -> int:
    return of(cfg).effective_batch(cfg.trainer.batch_size, cfg.trainer.grad_accum)


def recorded_effective_batch(config: dict) -> int:
    """`effective_batch` of a run.yaml read as plain data (a sweep's summary reads many: typed loading is slow)."""
    s, c, t = config["strategy"], config["cluster"], config["trainer"]
    world = c["nodes"] * int(c["num_processes"])
    return layout(s["name"], world, s.get("dp_replicate", 1), s.get("tp", 1)).effective_batch(t["batch_size"],
                                                                                              t["grad_accum"])


def resolve(cfg: RunConfig) -> RunConfig:
    """`strategy.dp_replicate=auto` -> the number of nodes (one replica per node, shards within it)."""
    s = cfg.strategy
    if s.dp_replicate != "auto":
        return cfg
    if cfg.cluster.nodes == 1:
        raise ConfigError("strategy.dp_replicate=auto: one replica per node, and this run has cluster.nodes=1; "
                          "set a number (strategy.dp_replicate=2) or run on several nodes")
    return replace(cfg, strategy=replace(s, dp_replicate=cfg.cluster.nodes))


def check(cfg: RunConfig, facts) -> None:
    """What the mesh cannot be, in one line each, before anything starts: sizes that do not divide the world, an
    axis FSDP2 cannot shard over, heads that do not split over tp, a model without a tensor-parallel plan, and what
    xtrain does not compose with tensor parallelism."""
    s, c = cfg.strategy, cfg.cluster
    if s.name is not Strategy.fsdp or (s.dp_replicate == 1 and s.tp == 1):
        return
    world, replicas = c.world_size, int(s.dp_replicate)
    processes = f"{world} processes ({c.nodes} node(s) x cluster.num_processes={c.processes_per_node})"
    if world % (replicas * s.tp):
        raise ConfigError(
            f"strategy.dp_replicate={replicas} x strategy.tp={s.tp}: does not divide the {processes}; choose sizes "
            f"whose product divides {world}"
        )
    mesh = of(cfg)
    if mesh.dp_shard < 2:
        raise ConfigError(
            f"strategy.dp_replicate={replicas} x strategy.tp={s.tp} on {processes} leaves dp_shard=1: FSDP2 needs at "
            f"least 2 ranks to shard over; use more processes (cluster.num_processes={2 * replicas * s.tp // c.nodes or 1}"
            f"{' per node' if c.nodes > 1 else ''}) or smaller sizes"
        )
    if s.tp == 1:
        return
    if world // c.nodes % s.tp:
        raise ConfigError(f"strategy.tp={s.tp}: a tensor-parallel group must lie within a node, and a node has "
                          f"cluster.num_processes={c.processes_per_node}; use strategy.tp dividing it")
    import transformers

    if not hasattr(transformers.PreTrainedModel, "_expand_parallel_plan"):
        raise ConfigError(f"strategy.tp={s.tp}: tensor parallelism here needs transformers >= 5.24 (installed: "
                          f"{transformers.__version__}); upgrade it or use strategy.tp=1")
    if not facts.tp_plan:
        raise ConfigError(f"strategy.tp={s.tp}: {facts.model_class} has no tensor-parallel plan (transformers' "
                          "base_model_tp_plan); use strategy.tp=1, with strategy.dp_replicate to add replicas")
    for name, value in (("attention heads", facts.heads), ("key/value heads", facts.kv_heads)):
        if value and value % s.tp:
            raise ConfigError(f"strategy.tp={s.tp}: {facts.model_class} has {value} {name}, which do not split into "
                              f"{s.tp} equal parts; use a strategy.tp that divides {value}")
    unsupported = [
        ("model.lora.enabled=true", getattr(cfg.model, "lora", None) is not None and cfg.model.lora.enabled),
        ("trainer.compile=true", cfg.trainer.compile),
        (f"precision={cfg.precision.name.value}", cfg.precision.name.value == "fp8"),
        ("strategy.cpu_offload=true", s.cpu_offload),
    ]
    for setting, on in unsupported:
        if on:
            raise ConfigError(f"strategy.tp={s.tp}: with {setting} tensor parallelism is not supported here; "
                              f"use strategy.tp=1 (FSDP2 alone shards the model) or leave {setting.split('=')[0]} unset")


def parallelism_config(cfg: RunConfig):
    """Accelerate's ParallelismConfig for a composed mesh; None where FSDP2 shards over the whole world."""
    if cfg.strategy.name is not Strategy.fsdp:
        return None
    mesh = of(cfg)
    if not mesh.composed:
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=mesh.dp_replicate, dp_shard_size=mesh.dp_shard, tp_size=mesh.tp)


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
