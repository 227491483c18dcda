"""The typed run config: one dataclass per config group, validated on construction.

This module imports neither torch nor transformers, so composing a config stays fast.
Every user-facing rule raises `ConfigError` with a sentence that names the setting,
the bad value and what would work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional


class ConfigError(ValueError):
    """A user error in the run config: printed as one line, exit code 2."""


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name}={value}: must be > 0")


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{name}={value}: must be >= 0")


class ModelSource(Enum):
    config = "config"  # built from a transformers config, random init
    pretrained = "pretrained"  # from_pretrained(model.name_or_path)


class ModelArch(Enum):
    gpt2 = "gpt2"
    llama = "llama"


class DataSource(Enum):
    pydoc = "pydoc"  # CPython's bundled documentation topics: no download
    text = "text"  # local text files or globs
    hf = "hf"  # a datasets hub name or a save_to_disk directory


class Strategy(Enum):
    ddp = "ddp"
    zero1 = "zero1"
    zero2 = "zero2"
    zero3 = "zero3"
    fsdp = "fsdp"


class Precision(Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    fp8 = "fp8"


class ClusterKind(Enum):
    local = "local"
    slurm = "slurm"


class TrackerKind(Enum):
    none = "none"
    tensorboard = "tensorboard"
    wandb = "wandb"


@dataclass
class ModelConfig:
    source: ModelSource = ModelSource.config
    """`config`: build `arch` with the sizes below, random init; `pretrained`: load `name_or_path`."""
    arch: ModelArch = ModelArch.gpt2
    """Architecture for `source=config`."""
    name_or_path: Optional[str] = None
    """For `source=pretrained`: a hub id or a local directory holding the model and its tokenizer."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    vocab_size: int = 2048
    """Size of the byte-level BPE tokenizer trained on the corpus (built-in models only)."""
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.source is ModelSource.pretrained and not self.name_or_path:
            raise ConfigError("model.name_or_path is empty: model=hf needs a hub id or a local model directory")
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            _positive(f"model.{name}", getattr(self, name))
        if self.vocab_size < 260:
            raise ConfigError(f"model.vocab_size={self.vocab_size}: must be >= 260 (256 bytes + special tokens)")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size}: must be divisible by model.num_heads={self.num_heads}"
            )
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.dropout={self.dropout}: must be in [0, 1)")


@dataclass
class DataConfig:
    source: DataSource = DataSource.pydoc
    files: List[str] = field(default_factory=list)
    """For `source=text`: text files, directories or glob patterns."""
    name: Optional[str] = None
    """For `source=hf`: a datasets hub name or a directory written by `save_to_disk`."""
    config_name: Optional[str] = None
    """For `source=hf`: the hub dataset's configuration, if it has several."""
    split: str = "train"
    text_column: str = "text"
    block_size: int = 128
    """Tokens per training sequence; documents are packed into blocks of this length."""
    val_fraction: float = 0.05
    cache_dir: str = "~/.cache/xtrain"
    """Tokenizers and tokenized datasets are cached here (env XTRAIN_CACHE_DIR overrides)."""

    def __post_init__(self) -> None:
        if self.source is DataSource.text and not self.files:
            raise ConfigError("data.files is empty: data=text needs files or globs, e.g. data.files=[notes/*.txt]")
        if self.source is DataSource.hf and not self.name:
            raise ConfigError("data.name is empty: data=hf needs a datasets hub name or a save_to_disk directory")
        _positive("data.block_size", self.block_size)
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction={self.val_fraction}: must be between 0 and 1 (exclusive)")


@dataclass
class StrategyConfig:
    name: Strategy = Strategy.ddp


@dataclass
class PrecisionConfig:
    name: Precision = Precision.fp32


@dataclass
class ClusterConfig:
    kind: ClusterKind = ClusterKind.local
    num_processes: int = 1
    """Processes on this node."""

    def __post_init__(self) -> None:
        _positive("cluster.num_processes", self.num_processes)


@dataclass
class TrainerConfig:
    batch_size: int = 16
    """Per-device micro batch, in sequences."""
    grad_accum: int = 1
    max_steps: int = 300
    """Optimizer steps."""
    lr: float = 2e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    """0 disables clipping."""
    eval_every: int = 100
    save_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "max_steps", "lr", "eval_every", "save_every", "log_every"):
            _positive(f"trainer.{name}", getattr(self, name))
        for name in ("warmup_steps", "weight_decay", "max_grad_norm"):
            _non_negative(f"trainer.{name}", getattr(self, name))
        if self.keep_checkpoints < 1:
            raise ConfigError(f"trainer.keep_checkpoints={self.keep_checkpoints}: must be >= 1 (resume needs one)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"trainer.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")


@dataclass
class TrackerConfig:
    kind: TrackerKind = TrackerKind.none
    project: str = "xtrain"
    """Project name for TensorBoard / W&B."""
    wandb_mode: str = "auto"
    """`auto`: online when a W&B API key is configured, else offline (files in the run dir)."""

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("auto", "online", "offline"):
            raise ConfigError(f"tracker.wandb_mode={self.wandb_mode}: must be one of auto, online, offline")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    run_dir: str = "runs/default"
    """Where this run's files go; also Hydra's output dir."""
    resume: str = "none"
    """`none`, `auto` (newest checkpoint in run_dir, fresh start if none) or a checkpoint path."""

    def __post_init__(self) -> None:
        if self.strategy.name is not Strategy.ddp:
            raise ConfigError(f"strategy={self.strategy.name.value}: not available yet; use strategy=ddp")
        if self.precision.name is Precision.fp8:
            raise ConfigError("precision=fp8: not available yet; use precision=fp32, bf16 or fp16")
        if self.cluster.kind is not ClusterKind.local:
            raise ConfigError(f"cluster={self.cluster.kind.value}: not available yet; use cluster=local")
        if self.cluster.num_processes != 1:
            raise ConfigError(
                f"cluster.num_processes={self.cluster.num_processes}: multi-process launch is not available yet; use 1"
            )


def cache_dir(data: DataConfig) -> str:
    return os.path.expanduser(os.environ.get("XTRAIN_CACHE_DIR") or data.cache_dir)


def to_container(cfg: RunConfig) -> dict:
    """Plain nested dict, enums as their names."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def to_yaml(cfg: RunConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_container(container: Any) -> RunConfig:
    """Validate a plain/omegaconf mapping against the schema and build the typed RunConfig."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), container)
    return OmegaConf.to_object(merged)


def load(path: str) -> RunConfig:
    from omegaconf import OmegaConf

    return from_container(OmegaConf.load(path))
