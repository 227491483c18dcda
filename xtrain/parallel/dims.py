"""The ranks of a run as a mesh: pp x dp_replicate x dp_shard x tp (cp held at 1 until a strategy uses it).

Ranks fill the mesh in that order (tp fastest, as torch's `init_device_mesh` and Accelerate's `ParallelismConfig`
lay it out; pipeline stages outermost, as torchtitan's): with 2 x 2 x 2 on 8 ranks, ranks 0-1 are one
tensor-parallel group, 0,2 one shard group, 0,4 one replica group; with pp=2, ranks 0-3 hold the first stage. Data-parallel ranks are replicas x shards: the ranks of a tensor-parallel group train on the same
batch, and so do a pipeline's stages. Under DDP every rank is a replica, under ZeRO a shard. This is the one place the effective batch and the
data-parallel size are computed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xtrain.config.schema import RunConfig, Strategy
from xtrain.core.errors import ConfigError

AXES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def data_parallel(self) -> int:
        """Ranks that each train on their own part of a step's batch."""
        return self.dp_replicate * self.dp_shard

    def effective_batch(self, batch_size: int, grad_accum: int) -> int:
        """What one optimizer step trains on (sequences, examples): the micro-batch x grad_accum x the data-parallel
        ranks (a tensor-parallel group's ranks share one batch, and a pipeline's stages)."""
        return batch_size * grad_accum * self.data_parallel

    @property
    def composed(self) -> bool:
        """More than one axis (replicas of shards, TP, pipeline stages)."""
        return self.tp > 1 or self.pp > 1 or self.dp_replicate > 1 and self.dp_shard > 1

    def axes(self) -> tuple[str, ...]:
        return ("pp", *AXES) if self.pp > 1 else AXES

    def shape(self) -> str:
        return " x ".join(str(getattr(self, axis)) for axis in self.axes()) + " (" + " x ".join(self.axes()) + ")"

    def groups(self, axis: str) -> list[list[int]]:
        """The rank groups along `axis`: each a list of global ranks that differ only in that axis's index."""
        names = ("pp", *AXES)
        sizes = [getattr(self, a) for a in names]
        strides = [sizes[1] * sizes[2] * sizes[3], sizes[2] * sizes[3], sizes[3], 1]
        k = names.index(axis)
        groups = []
        for rank in range(self.world):
            if (rank // strides[k]) % sizes[k] == 0:
                groups.append([rank + i * strides[k] for i in range(sizes[k])])
        return groups

    def words(self) -> str:
        """`HSDP: 2 replicas x 2 shards`, `FSDP x TP: 2 shards x 2-way TP`, `PP x FSDP: 2 stages x 2 shards`."""
        name = ("HSDP" if self.dp_replicate > 1 else "FSDP") + (" x TP" if self.tp > 1 else "")
        parts = [f"{self.dp_replicate} replicas"] if self.dp_replicate > 1 else []
        parts.append(f"{self.dp_shard} shards")
        if self.pp > 1 and self.dp_shard == 1:  # (DDP's replicas of each stage)
            name, parts = "DDP", [f"{self.dp_replicate} replica{'s' if self.dp_replicate > 1 else ''}"]
        if self.pp > 1:
            name, parts = f"PP x {name}", [f"{self.pp} stages", *parts]
        if self.tp > 1:
            parts.append(f"{self.tp}-way TP")
        return f"{name}: {' x '.join(parts)}"

    def as_dict(self) -> dict:
        return {axis: getattr(self, axis) for axis in self.axes()}


def layout(strategy: str, world: int, dp_replicate=1, tp: int = 1, pp: int = 1) -> ParallelDims:
    """The dims of `strategy` (its name) on `world` ranks: DDP's are replicas, ZeRO's shards, FSDP2's replicas of
    shards of tensor-parallel groups; pipeline stages (DDP, FSDP2) divide the world first."""
    if strategy == Strategy.ddp.value:
        return ParallelDims(dp_replicate=max(1, world // pp), pp=pp)
    if strategy != Strategy.fsdp.value:
        return ParallelDims(dp_shard=world)
    replicas = int(dp_replicate)
    return ParallelDims(dp_replicate=replicas, dp_shard=max(1, world // (replicas * tp * pp)), tp=tp, pp=pp)


def of(cfg: RunConfig) -> ParallelDims:
    """The run's dims (its world resolved: `cluster.num_processes` and `strategy.dp_replicate` made concrete)."""
    s = cfg.strategy
    return layout(s.name.value, cfg.cluster.world_size, s.dp_replicate, s.tp, s.pp)


def effective_batch(cfg: RunConfig) -> int:
    return of(cfg).effective_batch(cfg.trainer.batch_size, cfg.trainer.grad_accum)


def recorded_effective_batch(config: dict) -> int:
    """`effective_batch` of a run.yaml read as plain data (a sweep's summary reads many: typed loading is slow)."""
    s, c, t = config["strategy"], config["cluster"], config["trainer"]
    world = c["nodes"] * int(c["num_processes"])
    return layout(s["name"], world, s.get("dp_replicate", 1), s.get("tp", 1), s.get("pp", 1)).effective_batch(
        t["batch_size"], t["grad_accum"])


def resolve(cfg: RunConfig) -> RunConfig:
    """`strategy.dp_replicate=auto` -> the number of nodes (one replica per node, shards within it)."""
    s = cfg.strategy
    if s.dp_replicate != "auto":
        return cfg
    if cfg.cluster.nodes == 1:
        raise ConfigError("strategy.dp_replicate=auto: one replica per node, and this run has cluster.nodes=1; "
                          "set a number (strategy.dp_replicate=2) or run on several nodes")
    return replace(cfg, strategy=replace(s, dp_replicate=cfg.cluster.nodes))
