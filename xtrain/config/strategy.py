"""The `strategy` settings: how the model is distributed (DDP, DeepSpeed ZeRO, FSDP)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from xtrain.config.fields import all_free
from xtrain.core.errors import ConfigError


class Strategy(Enum):
    ddp = "ddp"
    zero1 = "zero1"
    zero2 = "zero2"
    zero3 = "zero3"
    fsdp = "fsdp"


class Offload(Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class FsdpSharding(Enum):
    full_shard = "full_shard"  # params, grads, optimizer states sharded (~ ZeRO-3)
    shard_grad_op = "shard_grad_op"  # grads and optimizer states sharded (~ ZeRO-2)
    hybrid_shard = "hybrid_shard"  # full_shard within a node, replicated across nodes
    no_shard = "no_shard"  # replicated (~ DDP)


# a pipeline schedule's name -> torch.distributed.pipelining's class (the one list of them)
PP_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


class StateDictType(Enum):
    full = "full"
    sharded = "sharded"


@all_free  # (where it runs: reshard.py moves the checkpoint; the effective batch is kept)
@dataclass
class StrategyConfig:
    """What every strategy reads: its name and the device mesh. Each option of the `strategy` group extends it with
    its own settings (`DdpConfig`, `ZeroConfig`, `FsdpConfig`): another option's setting is no such setting."""
    name: Strategy = Strategy.ddp
    """The distributed strategy; each option of the `strategy` group sets it."""
    # The device mesh (FSDP2): dp_replicate x dp_shard x tp, dp_shard being what the world leaves -----------------
    dp_replicate: Any = 1
    """FSDP2: replicas of the sharded model (HSDP: shard within a replica, all-reduce across them); `auto`: one per
    node."""
    tp: int = 1
    """FSDP2: tensor-parallel degree (the model's tensor-parallel plan), within a node."""
    cp: int = 1
    """Context parallelism: not supported (1)."""
    # Pipeline parallelism (DDP or FSDP2): pp stages of the model's layers, the outermost axis of the mesh --------
    pp: int = 1
    """Pipeline stages: the model's layers split into `pp` consecutive stages, each on its own ranks (embeddings on
    the first, the final norm and head on the last)."""
    pp_schedule: str = "1f1b"
    """How micro-batches flow through the stages: `gpipe`, `1f1b` or `interleaved_1f1b` (each rank holds
    `pp_virtual_stages` stages, looped)."""
    pp_stage_layers: Optional[list] = None
    """Layers per stage, first to last (interleaved: per virtual stage); default: an even split."""
    pp_microbatches: Optional[int] = None
    """Micro-batches per optimizer step that flow through the pipeline (default: trainer.grad_accum); each data-
    parallel rank's step (trainer.batch_size x trainer.grad_accum sequences) is split into this many."""
    pp_virtual_stages: int = 2
    """interleaved_1f1b: stages per rank."""

    NAMES = ()  # the strategies this schema is the settings of

    def __post_init__(self) -> None:
        if self.name not in self.NAMES:
            raise ConfigError(f"strategy.name={self.name.value}: set by the strategy option; use "
                              f"strategy={self.name.value}")
        self._check_mesh()

    def _check_mesh(self) -> None:
        if self.cp != 1:
            raise ConfigError(f"strategy.cp={self.cp}: context parallelism is not supported; use strategy.cp=1 "
                              "(shard long sequences' activations with strategy.tp or activation checkpointing)")
        if self.dp_replicate != "auto" and (isinstance(self.dp_replicate, bool) or not isinstance(self.dp_replicate, int)
                                            or self.dp_replicate < 1):
            raise ConfigError(f"strategy.dp_replicate={self.dp_replicate}: must be a whole number >= 1 or auto "
                              "(one replica per node)")
        if self.tp < 1:
            raise ConfigError(f"strategy.tp={self.tp}: must be a whole number >= 1")
        self._check_pipeline()
        for key in ("dp_replicate", "tp"):
            value = getattr(self, key)
            if value != 1 and not isinstance(self, FsdpConfig):
                what = "tensor parallelism" if key == "tp" else "replicas of a sharded model (HSDP)"
                raise ConfigError(
                    f"strategy.{key}={value}: {what} needs strategy=fsdp (FSDP2); {self.name.value} cannot compose "
                    f"with it here; use strategy=fsdp strategy.{key}={value}"
                )


    def _check_pipeline(self) -> None:
        """The pipeline's settings on their own (what they need of the world and the model: parallel/pipeline.py)."""
        for key in ("pp", "pp_virtual_stages", "pp_microbatches"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"strategy.{key}={value}: must be a whole number >= 1")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"strategy.pp_schedule={self.pp_schedule}: no such schedule; use one of "
                              f"{', '.join(PP_SCHEDULES)}")
        if self.pp == 1:
            for key, default in (("pp_stage_layers", None), ("pp_microbatches", None)):
                if getattr(self, key) != default:
                    raise ConfigError(f"strategy.{key}={getattr(self, key)}: a pipeline setting, and strategy.pp=1; "
                                      f"set strategy.pp to the number of stages, or leave strategy.{key} unset")
            return
        if self.name.value.startswith("zero"):
            raise ConfigError(f"strategy.pp={self.pp}: pipeline stages compose with strategy=ddp or strategy=fsdp "
                              f"(FSDP2), not with DeepSpeed ZeRO, which partitions the whole model itself; use "
                              f"strategy=fsdp strategy.pp={self.pp}")
        stages = self.pp * (self.pp_virtual_stages if self.pp_schedule == "interleaved_1f1b" else 1)
        layers = self.pp_stage_layers
        if layers is not None and (len(layers) != stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                                for n in layers)):
            what = (f"strategy.pp={self.pp} x strategy.pp_virtual_stages={self.pp_virtual_stages} stages"
                    if stages != self.pp else f"strategy.pp={self.pp} stages")
            raise ConfigError(f"strategy.pp_stage_layers={list(layers)}: give {stages} whole numbers >= 1 (one per "
                              f"stage: {what}), or leave it unset for an even split")


@dataclass
class DdpConfig(StrategyConfig):
    """strategy=ddp: every process holds the whole model."""
    NAMES = (Strategy.ddp,)


@dataclass
class ZeroConfig(StrategyConfig):
    """strategy=zero1|zero2|zero3: DeepSpeed ZeRO's partitions and offload."""
    name: Strategy = Strategy.zero3
    offload_optimizer: Offload = Offload.none
    """Where optimizer states live (`cpu`, `nvme`)."""
    offload_param: Offload = Offload.none
    """zero3 only: where parameters live between uses."""
    nvme_path: Optional[str] = None
    """Directory for `nvme` offload."""
    deepspeed_config: Optional[str] = None
    """Your own DeepSpeed JSON, merged under the typed settings (a conflict is an error)."""

    NAMES = (Strategy.zero1, Strategy.zero2, Strategy.zero3)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.offload_param is not Offload.none and self.name is not Strategy.zero3:
            raise ConfigError(f"strategy.offload_param={self.offload_param.value}: needs strategy=zero3")
        if Offload.nvme in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise ConfigError("strategy.nvme_path is empty: nvme offload needs a directory, e.g. strategy.nvme_path=/local_nvme")
        if self.nvme_path and Offload.nvme not in (self.offload_optimizer, self.offload_param):
            raise ConfigError(f"strategy.nvme_path={self.nvme_path}: only for nvme offload (strategy.offload_optimizer="
                              "nvme or strategy.offload_param=nvme)")


@dataclass
class FsdpConfig(StrategyConfig):
    """strategy=fsdp: PyTorch FSDP (FSDP2's `fully_shard` by default) and its device mesh."""
    name: Strategy = Strategy.fsdp
    fsdp_version: int = 2
    """FSDP's implementation: 2 (`fully_shard`, the default) or 1 (FSDP1)."""
    sharding: FsdpSharding = FsdpSharding.full_shard
    """FSDP1's sharding strategy (FSDP2 shards fully; see `reshard_after_forward`)."""
    cpu_offload: bool = False
    """Parameters (and their gradients, optimizer states) on the CPU between uses."""
    wrap_layer: Optional[str] = None
    """Transformer block class to wrap, e.g. LlamaDecoderLayer (default: from the model's _no_split_modules)."""
    activation_checkpointing: bool = False
    """Recompute each wrapped block's activations in backward instead of keeping them."""
    state_dict_type: StateDictType = StateDictType.sharded
    """How checkpoints are written: `sharded` (one file per rank, fast) or `full` (gathered on rank 0)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (False: keep them for backward, like shard_grad_op)."""
    cpu_ram_efficient_loading: bool = True
    """Pretrained weights are loaded on rank 0 only and broadcast."""

    NAMES = (Strategy.fsdp,)

    def __post_init__(self) -> None:
        if self.fsdp_version not in (1, 2):
            raise ConfigError(f"strategy.fsdp_version={self.fsdp_version}: must be 1 or 2")
        super().__post_init__()
        for key in ("dp_replicate", "tp"):
            if getattr(self, key) != 1 and self.fsdp_version != 2:
                raise ConfigError(f"strategy.{key}={getattr(self, key)}: needs FSDP2; use strategy.fsdp_version=2")
        if self.fsdp_version == 2 and self.sharding is not FsdpSharding.full_shard:
            raise ConfigError(
                f"strategy.sharding={self.sharding.value}: FSDP2 shards fully (use strategy.reshard_after_forward=false "
                "for shard_grad_op behaviour); other sharding strategies need strategy.fsdp_version=1"
            )


OPTIONS: dict[Strategy, type[StrategyConfig]] = {name: schema for schema in (DdpConfig, ZeroConfig, FsdpConfig)
                                                 for name in schema.NAMES}


def strategy_config(name: Strategy, **settings) -> StrategyConfig:
    """The settings of strategy `name` (its option's schema)."""
    return OPTIONS[name](name=name, **settings)
