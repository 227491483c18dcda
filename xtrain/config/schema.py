"""The typed run config: one dataclass per config group (each in its own module, as xtrain/conf/<group>/ holds
the group's options), validated on construction; `RunConfig` composes them and checks what spans groups.

This module imports neither torch nor transformers, so composing a config stays fast.
Every user-facing rule raises `ConfigError` with a sentence that names the setting,
the bad value and what would work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from xtrain.config import cluster, data, habits, strategy
from xtrain.config.fields import setting
from xtrain.config.cluster import ClusterConfig, ClusterKind, LocalConfig, RayConfig, SlurmConfig  # noqa: F401 (re-exported)
from xtrain.config.data import (DataConfig, DataSource, ExampleFormat, HfData, ImagesData, PydocData,  # noqa: F401
                                 SftData, TextData, TrainOn, data_config)
from xtrain.config.lora import BaseQuantization, LoraConfig  # noqa: F401 (re-exported)
from xtrain.config.model import ModelArch, ModelConfig, ModelSource  # noqa: F401 (re-exported)
from xtrain.config.precision import Fp8Backend, Precision, PrecisionConfig  # noqa: F401 (re-exported)
from xtrain.config.strategy import (DdpConfig, FsdpConfig, FsdpSharding, Offload, StateDictType,  # noqa: F401
                                     Strategy, StrategyConfig, ZeroConfig, strategy_config)
from xtrain.config.task import (Direction, Export, TargetData, TargetModel, TaskConfig, TaskKind,  # noqa: F401
                                 given, monitor_direction, target_data, target_model)
from xtrain.config.tracker import TrackerConfig, TrackerKind  # noqa: F401 (re-exported)
from xtrain.config.trainer import TrainerConfig  # noqa: F401 (re-exported)
from xtrain.core.errors import ConfigError, explain, override_of, unknown_setting


@dataclass
class RunConfig:
    model: Any = field(default_factory=ModelConfig)  # a ModelConfig, or a TargetModel (task=custom)
    data: Any = field(default_factory=PydocData)  # the data option's own schema, or a TargetData (task=custom)
    task: TaskConfig = field(default_factory=TaskConfig)
    strategy: StrategyConfig = field(default_factory=DdpConfig)  # the strategy option's own schema
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    cluster: ClusterConfig = field(default_factory=LocalConfig)  # the cluster option's own schema
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    run_dir: str = setting("runs/default", free=True)
    """Where this run's files go; also Hydra's output dir."""
    resume: str = setting("none", free=True)
    """`none`, `auto` (newest checkpoint in run_dir, fresh start if none) or a checkpoint path."""
    resume_changes: str = setting("refuse", free=True)
    """A resume with settings that change what trains: `refuse` (one line lists them) or `apply` (the learning
    rate, its schedule, max_steps, weight decay and clipping take effect from the resumed step, recorded in
    result.json). Log, eval and save intervals, trackers, timeouts and the SLURM request may always change."""
    dry_run: bool = setting(False, free=True)
    """Print the plan (topology, batches, plugin settings, memory per device) and exit."""

    def __post_init__(self) -> None:
        if getattr(self.data, "test", None) and self.task.name is TaskKind.causal_lm:
            raise ConfigError("data.test: a test split is for task=custom, seq_cls and image_cls; a language model's "
                              "held-out data is its val split (data.val_fraction)")
        if self.resume_changes not in ("refuse", "apply"):
            raise ConfigError(f"resume_changes={self.resume_changes}: must be refuse or apply")
        if (self.task.name is TaskKind.causal_lm and self.data.source is DataSource.sft
                and self.model.source is ModelSource.config):
            raise ConfigError(
                "data=sft: the built-in model's tokenizer has no chat template and no pretrained knowledge to "
                "fine-tune; use model=hf model.name_or_path=<a pretrained (chat) model>"
            )
        offload = self.strategy.offload_optimizer if isinstance(self.strategy, ZeroConfig) else Offload.none
        users = self.trainer.optimizer.get("_target_")
        if users and offload is not Offload.none:
            raise ConfigError(f"trainer.optimizer._target_={users}: with strategy.offload_optimizer={offload.value} "
                              "DeepSpeed steps on the host with its own DeepSpeedCPUAdam; use "
                              "strategy.offload_optimizer=none, or leave trainer.optimizer unset")
        if users and self.trainer.fused_optimizer is True:
            raise ConfigError(f"trainer.fused_optimizer=true: fuses xtrain's AdamW; trainer.optimizer._target_={users} "
                              "is yours: give it its own fused setting (+trainer.optimizer.fused=true) instead")
        if self.trainer.fused_optimizer is True and offload is not Offload.none:
            raise ConfigError(
                f"trainer.fused_optimizer=true: with strategy.offload_optimizer={offload.value} DeepSpeed steps on the "
                "host with its own DeepSpeedCPUAdam; use trainer.fused_optimizer=false"
            )
        s = self.strategy
        if (self.precision.name is Precision.fp8 and self.precision.fp8_backend is Fp8Backend.torchao
                and isinstance(s, FsdpConfig) and s.cpu_ram_efficient_loading
                and getattr(self.model, "source", None) is not ModelSource.config):
            raise ConfigError(
                "strategy.cpu_ram_efficient_loading=true: Accelerate does not load weights on rank 0 only with fp8 "
                "from torchao under FSDP; set strategy.cpu_ram_efficient_loading=false (each rank reads the weights)"
            )
        if self.trainer.compile_tuning and not self.trainer.compile:
            raise ConfigError("trainer.compile_tuning=true: it tunes the kernels torch.compile generates; add "
                              "trainer.compile=true, or drop trainer.compile_tuning")
        if self.trainer.compile and isinstance(s, FsdpConfig) and s.fsdp_version == 1:
            raise ConfigError(
                "trainer.compile=true: with strategy.fsdp_version=1 Accelerate compiles around FSDP1's wrappers "
                "and renames every parameter; use strategy.fsdp_version=2 or trainer.compile=false"
            )


# The groups whose options carry schemas of their own: the setting that names the option, each option's schema
OPTION_SCHEMAS = {"data": ("source", DataSource, data.OPTIONS), "strategy": ("name", Strategy, strategy.OPTIONS),
                  "cluster": ("kind", ClusterKind, cluster.OPTIONS)}


def option_schema(group: str, node: Any):
    """The schema of the option a group's settings (`node`, a mapping) name; the field's default's where none."""
    key, kind, options = OPTION_SCHEMAS[group]
    schema = _named_schema(group, node)
    given = set(node) if isinstance(node, dict) else set()
    if given - _fields(schema) and any(other is not schema and given >= _fields(other) for other in options.values()):
        # (every setting of another option's schema: that option composed, and its name overridden)
        chosen = node[key].value if isinstance(node[key], Enum) else node[key]
        raise ConfigError(f"{group}.{key}={chosen}: set by the {group} option; use {group}={chosen}")
    return schema


def _named_schema(group: str, node: Any):
    key, kind, options = OPTION_SCHEMAS[group]
    chosen = (node or {}).get(key) if isinstance(node, dict) else None
    if chosen is None:
        return type(RunConfig.__dataclass_fields__[group].default_factory())
    try:
        return options[kind(chosen.value if isinstance(chosen, Enum) else chosen)]
    except ValueError:
        raise ConfigError(f"{group}.{key}={chosen}: must be one of {', '.join(k.value for k in kind)}") from None


def _fields(schema) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


def setting_index(schema=RunConfig, prefix: str = "") -> dict[str, str]:
    """Every dotted key a user can set, e.g. `trainer.batch_size`, → the options it is a setting of, as
    `strategy=zero1|zero2|zero3` (empty where it is every option's)."""
    names: dict[str, str] = {}
    for f in dataclasses.fields(schema):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if schema is RunConfig and f.name in OPTION_SCHEMAS:
            names.update(_option_settings(f.name))
        elif schema is RunConfig and f.name == "model":
            names.update((key, _SCHEMA_MODELS) for key in setting_index(ModelConfig, "model."))
        elif dataclasses.is_dataclass(sub):
            names.update(setting_index(type(sub), f"{prefix}{f.name}."))
        else:
            names[f"{prefix}{f.name}"] = ""
    return names


# the model options ModelConfig's settings belong to (the others build a model by `_target_`, their keys its arguments)
_SCHEMA_MODELS = "model=hf|tiny_gpt2|tiny_llama"


def _option_settings(group: str) -> dict[str, str]:
    """A group's settings → the options that have them; empty where every option of the group has it (`data=custom`,
    datasets by `_target_`, has none of the data sources' settings)."""
    options = OPTION_SCHEMAS[group][2]
    every = len(options) + (group == "data")
    owners: dict[str, list[str]] = {}
    for option, option_schema_ in options.items():
        for f in dataclasses.fields(option_schema_):
            owners.setdefault(f.name, []).append(option.value)
    return {f"{group}.{name}": "" if len(who) == every else f"{group}={'|'.join(who)}"
            for name, who in owners.items()}


def explained(err: Exception) -> str:
    """One line for a Hydra / OmegaConf composition error (core/errors.py's `explain`), with xtrain's settings and
    other tools' names for them."""
    return explain(err, setting_index(), habits.refusal)


def setting_names(schema=RunConfig) -> list[str]:
    """Every dotted key a user can set, e.g. `trainer.batch_size` (a group's options' together)."""
    return list(setting_index(schema))


def to_container(cfg: RunConfig) -> dict:
    """Plain nested dict, enums as their names; a model or datasets by `_target_` as the config spells them."""
    from omegaconf import OmegaConf

    custom_model, custom_data = isinstance(cfg.model, TargetModel), isinstance(cfg.data, TargetData)
    if not (custom_model or custom_data):
        return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    plain = dataclasses.replace(cfg, model=ModelConfig() if custom_model else cfg.model,
                                data=PydocData() if custom_data else cfg.data)
    out = OmegaConf.to_container(OmegaConf.structured(plain), enum_to_str=True)
    if custom_model:
        out["model"] = cfg.model.node()
    if custom_data:
        out["data"] = {split: dict(getattr(cfg.data, split)) for split in ("train", "val", "test", "collate_fn")}
    return out


def to_yaml(cfg: RunConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(to_container(cfg)))


def from_container(container: Any) -> RunConfig:
    """Validate a plain/omegaconf mapping against the schema and build the typed RunConfig. A key the schema does
    not have (added with `+`, or in a file) is refused: OmegaConf would keep or drop it, and nothing would read it."""
    from omegaconf import DictConfig, OmegaConf

    plain = OmegaConf.to_container(container) if isinstance(container, DictConfig) else container
    model, data = target_model(plain.get("model")), target_data(plain.get("data"))
    if model or data:  # (their keys are the user's callables' arguments)
        plain = {k: v for k, v in plain.items() if not (k == "model" and model or k == "data" and data)}
        container = plain
    for name in unknown_keys(plain, RunConfig):
        setting, value = override_of(name)
        raise ConfigError(unknown_setting(setting, value, setting_index(), habits.refusal))
    root = OmegaConf.structured(RunConfig)
    for group in OPTION_SCHEMAS:
        root[group] = OmegaConf.structured(option_schema(group, plain.get(group)))
    merged = OmegaConf.merge(root, container)
    cfg = OmegaConf.to_object(merged)
    if model or data:
        cfg = dataclasses.replace(cfg, model=model or cfg.model, data=data or cfg.data)
    check_task(cfg)
    if isinstance(cfg.model, ModelConfig):
        cfg.model.check_source()
    if cfg.task.code_dir is None and names_users_code(cfg):
        import os

        cfg.task.code_dir = os.getcwd()  # (recorded in run.yaml: every rank and node imports from there)
    return cfg


def names_users_code(cfg: RunConfig) -> bool:
    """Whether the run imports code by `_target_` (a model, datasets, a loss, metrics, callbacks, an optimizer or
    a schedule): its modules may be the user's, imported from `task.code_dir`."""
    t = cfg.task
    return (t.name in (TaskKind.custom, TaskKind.image_cls) or given(t.loss) is not None
            or any(isinstance(m, dict) for m in t.metrics) or bool(cfg.trainer.callbacks)
            or given(cfg.trainer.optimizer) is not None or given(cfg.trainer.scheduler) is not None)


def check_task(cfg: RunConfig) -> None:
    """A model and datasets by `_target_` go with task=custom, and task=custom needs them; image_cls builds its
    model by `_target_` and reads images; seq_cls fine-tunes a pretrained model on records."""
    custom = cfg.task.name is TaskKind.custom
    if cfg.task.name is TaskKind.image_cls:
        if not isinstance(cfg.model, TargetModel):
            raise ConfigError("task=image_cls: the model is built by _target_: use model=resnet, model=vit, or "
                              "model._target_=<a callable returning an nn.Module>")
        if isinstance(cfg.data, TargetData) or cfg.data.source is not DataSource.images:
            raise ConfigError("task=image_cls: reads labelled images: use data=images 'data.files=[<image folder>]'")
        return
    if custom and not isinstance(cfg.model, TargetModel):
        raise ConfigError("task=custom: model._target_ is missing: give the dotted path of a callable that returns "
                          "an nn.Module, e.g. model._target_=mymodels.build")
    if custom and not isinstance(cfg.data, TargetData):
        raise ConfigError("task=custom: data.train._target_ is missing: give the dotted path of a map-style "
                          "dataset (or a function returning one), e.g. data.train._target_=mydata.build")
    if not custom and isinstance(cfg.model, TargetModel):
        raise ConfigError(f"model._target_={cfg.model.target}: a model by _target_ is trained by task=custom; "
                          "add task=custom")
    if not custom and isinstance(cfg.data, TargetData):
        raise ConfigError("data.train._target_: datasets by _target_ are trained by task=custom; add task=custom")
    if cfg.task.name is TaskKind.seq_cls:
        if cfg.model.source is not ModelSource.pretrained:
            raise ConfigError(f"model.source={cfg.model.source.value}: task=seq_cls fine-tunes a pretrained encoder or "
                              "decoder; use model=hf model.name_or_path=<a model directory or hub id>")
        if cfg.data.source not in (DataSource.text, DataSource.hf):
            raise ConfigError(f"data.source={cfg.data.source.value}: task=seq_cls reads labelled records; use "
                              "data=text 'data.files=[train.jsonl]' (JSONL, CSV, Parquet) or data=hf data.name=...")


def unknown_keys(node: Any, schema, prefix: str = "") -> list[str]:
    """The dotted keys of a mapping that `schema` (a dataclass, its fields' dataclasses within) does not have."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    found = []
    for key, value in (node or {}).items():
        if key not in fields:
            found.append(f"{prefix}{key}")
            continue
        factory = fields[key].default_factory
        sub = type(factory()) if factory is not dataclasses.MISSING else None
        if schema is RunConfig and key in OPTION_SCHEMAS:
            sub = option_schema(key, value)
        if dataclasses.is_dataclass(sub) and isinstance(value, dict):
            found += unknown_keys(value, sub, f"{prefix}{key}.")
    return found


def upgraded(record: dict) -> dict:
    """A run.yaml (or a checkpoint's config) written when each group's settings were one flat list: without the
    settings of the options it did not choose (it held them at their defaults: any other value was refused). A
    checkpoint's config by `trainer.max_epochs`: without the steps they came to (each run works them out again)."""
    out = dict(record)
    if isinstance(record.get("trainer"), dict) and record["trainer"].get("max_epochs") is not None:
        out["trainer"] = {**record["trainer"], "max_steps": None}
    for group in OPTION_SCHEMAS:
        if isinstance(record.get(group), dict) and OPTION_SCHEMAS[group][0] in record[group]:  # (not datasets by _target_)
            own = _fields(_named_schema(group, record[group]))
            out[group] = {k: v for k, v in record[group].items() if k in own}
    return out


def load(path: str) -> RunConfig:
    """A run dir's run.yaml; a ConfigError naming it where it is damaged."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from xtrain.core.errors import ConfigError
    from xtrain.core.rundir import unreadable

    try:
        loaded = OmegaConf.to_container(OmegaConf.load(path))
        if not isinstance(loaded, dict):
            raise ValueError("not a run config")
        return from_container(upgraded(loaded))
    except ConfigError:
        raise
    except (yaml.YAMLError, UnicodeDecodeError, OmegaConfBaseException, ValueError, KeyError, TypeError) as err:
        raise unreadable(path, err) from None
