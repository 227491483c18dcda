"""FSDP: FSDP2 (`fully_shard`, the default) over a device mesh of dp_replicate x dp_shard x tp (HSDP: replicas of
the sharded model; TP: the model's tensor-parallel plan within a node), or FSDP1 with its sharding strategies."""

from __future__ import annotations

import collections

from xtrain.config.schema import FsdpSharding, RunConfig, StateDictType
from xtrain.core import seams
from xtrain.core.errors import ConfigError
from xtrain.parallel import dims
from xtrain.parallel.base import FSDP_FULL_FORM, FSDP_SHARDED_FORM, Parallelism, built_from_config

# FSDP's plugin fields by their names in an accelerate config file
LAUNCH_NAMES = {
    "fsdp_version": "fsdp_version", "auto_wrap_policy": "fsdp_auto_wrap_policy",
    "transformer_cls_names_to_wrap": "fsdp_transformer_layer_cls_to_wrap", "cpu_offload": "fsdp_offload_params",
    "state_dict_type": "fsdp_state_dict_type", "activation_checkpointing": "fsdp_activation_checkpointing",
    "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
    "reshard_after_forward": "fsdp_reshard_after_forward", "sharding_strategy": "fsdp_sharding_strategy",
    "backward_prefetch": "fsdp_backward_prefetch", "forward_prefetch": "fsdp_forward_prefetch",
    "use_orig_params": "fsdp_use_orig_params", "sync_module_states": "fsdp_sync_module_states",
}


class Fsdp(Parallelism):
    name = "FSDP"
    accelerate_type = "FSDP"
    compiles_in_prepare = True
    shards_fp8_weights = True
    settings_title = "fsdp plugin"

    def recomputes_activations(self, cfg: RunConfig) -> bool:
        return cfg.strategy.activation_checkpointing

    def refusal(self, cfg: RunConfig, cuda: bool) -> str | None:
        if cuda or seams.first("runs_on_cpu", "fsdp", cfg):
            return None
        return ("strategy=fsdp: FSDP needs CUDA GPUs and this machine has none (Accelerate would silently train "
                "plain DDP); use strategy=ddp here, or run on GPU machines (dry_run=true shows the plan anywhere)")

    def check(self, cfg: RunConfig, facts) -> None:
        check_mesh(cfg, facts)

    def wrap_layer(self, cfg: RunConfig, meta_model) -> str:
        return wrap_layer(cfg.strategy.wrap_layer, meta_model)

    def settings(self, cfg: RunConfig, facts) -> dict:
        """Every FullyShardedDataParallelPlugin field xtrain decides, by its Accelerate name."""
        s = cfg.strategy
        settings = {
            "fsdp_version": s.fsdp_version,
            "auto_wrap_policy": "transformer_based_wrap",
            "transformer_cls_names_to_wrap": [facts.wrap_layer],
            "cpu_offload": s.cpu_offload,
            "state_dict_type": "SHARDED_STATE_DICT" if s.state_dict_type is StateDictType.sharded else "FULL_STATE_DICT",
            "activation_checkpointing": s.activation_checkpointing,
            # (under TP every rank loads the weights and splits them: rank 0's broadcast would be of whole tensors)
            "cpu_ram_efficient_loading": s.cpu_ram_efficient_loading and s.tp == 1,
            "reshard_after_forward": s.reshard_after_forward,
        }
        if s.fsdp_version == 1:
            settings.update(
                sharding_strategy=s.sharding.value.upper(),
                backward_prefetch="BACKWARD_PRE",
                forward_prefetch=False,
                use_orig_params=True,
                sync_module_states=s.cpu_ram_efficient_loading,
                limit_all_gathers=True,
            )
            del settings["reshard_after_forward"]  # FSDP1 expresses it through sharding_strategy
        return settings

    def plugin(self, cfg: RunConfig, facts) -> dict:
        from accelerate.utils import FullyShardedDataParallelPlugin

        from xtrain.parallel import fp8

        kwargs = {}
        if parallelism_config(cfg) is not None:
            kwargs["parallelism_config"] = parallelism_config(cfg)
        settings = self.settings(cfg, facts)
        if self.builds_on_meta(cfg) and fp8.with_torchao(cfg):  # Accelerate refuses the two together; a model
            settings["cpu_ram_efficient_loading"] = False  # built on meta has no weights on rank 0 to broadcast anyway
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            **settings,
            ignored_modules=[],  # None would be read from FSDP_IGNORED_MODULES
            min_num_params=None,  # read (from FSDP_MIN_NUM_PARAMS) only for size-based wrapping
            activation_checkpointing_offload=False,
        )
        return kwargs

    def launch_config(self, cfg: RunConfig, facts, files: dict, cuda: bool) -> dict:
        settings = self.settings(cfg, facts)
        settings.pop("limit_all_gathers", None)  # not a launch option; Accelerate's default (True) matches
        fsdp = {LAUNCH_NAMES[k]: v for k, v in settings.items()}
        fsdp["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = facts.wrap_layer
        return {"distributed_type": self.accelerate_type, "use_cpu": False, "fsdp_config": fsdp}

    def async_save_refusal(self, cfg: RunConfig) -> str | None:
        if cfg.strategy.fsdp_version == 1:
            return "FSDP1's state dicts are not staged off the GPU by xtrain (use strategy.fsdp_version=2)"
        return None

    def staged_per_node(self, cfg: RunConfig, weights: float, optimizer: float) -> float:
        """Sharded: each process stages its own shards; full: the main process the whole gathered state."""
        if cfg.strategy.state_dict_type is StateDictType.full:
            return (weights + optimizer) * dims.of(cfg).dp_shard
        return (weights + optimizer) * cfg.cluster.processes_per_node

    def steps_fused(self, cfg: RunConfig) -> bool:
        return not cfg.strategy.cpu_offload

    def builds_on_meta(self, cfg: RunConfig) -> bool:
        """FSDP2: each rank's shards filled, never the whole model (not under TP, which splits the built model)."""
        s = cfg.strategy
        return built_from_config(cfg) and s.fsdp_version == 2 and s.tp == 1

    def state_bytes(self, cfg: RunConfig, state: float) -> tuple[float, float, float]:
        """fp32 weights and gradients (mixed precision casts them per layer), sharded over the sharding group: FSDP2's
        dp_shard axis, FSDP1's world (a node's ranks under hybrid_shard); on the host under cpu_offload."""
        s, c = cfg.strategy, cfg.cluster
        if s.cpu_offload:
            return 0, 0, 0
        sharding = s.sharding if s.fsdp_version == 1 else FsdpSharding.full_shard
        group = min(c.world_size, c.processes_per_node) if sharding is FsdpSharding.hybrid_shard else c.world_size
        if s.fsdp_version == 2:
            group = dims.of(cfg).dp_shard
        if sharding is FsdpSharding.no_shard:
            group = 1
        params = 4 if sharding is FsdpSharding.shard_grad_op else 4 / group
        return params, 4 / group, state / group

    def local_parameters(self, cfg: RunConfig, count: int | None, tp_split: int) -> float | None:
        """Those the plan splits a tp-th each; the rest whole."""
        tp = dims.of(cfg).tp if cfg.strategy.fsdp_version == 2 else 1
        return None if count is None else count - tp_split + tp_split / tp

    def checkpoint_form(self, cfg: RunConfig) -> str:
        return FSDP_SHARDED_FORM if cfg.strategy.state_dict_type is StateDictType.sharded else FSDP_FULL_FORM

    def prepare_model(self, cfg: RunConfig, accelerator, model):
        """fp8 layers converted (their weights sharded in fp8), a model built on meta sharded now (before the
        optimizer exists, its shards then filled), then split over the tp axis; FSDP2 shards over the others and
        compiles in `prepare`."""
        from xtrain.parallel import fp8, meta_init, tensor_parallel

        if fp8.with_torchao(cfg):
            fp8.convert(model, cfg.precision, fsdp=True)
        if meta_init.is_lazy(model):
            model = meta_init.shard(accelerator, model)
        if cfg.strategy.tp > 1:
            model = tensor_parallel.apply_tensor_parallel(accelerator, model)
        return model

    def preparing(self, accelerator):
        from xtrain.parallel import tensor_parallel

        return tensor_parallel.split_already(accelerator)


def check_mesh(cfg: RunConfig, facts) -> None:
    """What the mesh cannot be, in one line each, before anything starts: sizes that do not divide the world, an
    axis FSDP2 cannot shard over, heads that do not split over tp, a model without a tensor-parallel plan, and what
    xtrain does not compose with tensor parallelism."""
    s, c = cfg.strategy, cfg.cluster
    if s.dp_replicate == 1 and s.tp == 1:
        return
    world, replicas = c.world_size, int(s.dp_replicate)
    processes = f"{world} processes ({c.nodes} node(s) x cluster.num_processes={c.processes_per_node})"
    if world % (replicas * s.tp):
        raise ConfigError(
            f"strategy.dp_replicate={replicas} x strategy.tp={s.tp}: does not divide the {processes}; choose sizes "
            f"whose product divides {world}"
        )
    mesh = dims.of(cfg)
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
    mesh = dims.of(cfg)
    if not mesh.composed or mesh.pp > 1:  # (a pipeline's stages are sharded by parallel/pipeline.py)
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=mesh.dp_replicate, dp_shard_size=mesh.dp_shard, tp_size=mesh.tp)


def repeated_block(model) -> str | None:
    """The most frequent class among the children of the model's largest nn.ModuleList (by parameters)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return None
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    counts = collections.Counter(type(child).__name__ for child in largest)
    return sorted(counts, key=lambda name: (-counts[name], name))[0]


def wrap_layer(requested: str | None, meta_model) -> str:
    """The block class FSDP wraps: `strategy.wrap_layer`; else the most frequent class the model declares in
    `_no_split_modules`; else the class of the blocks in its largest nn.ModuleList."""
    counts = collections.Counter(type(m).__name__ for m in meta_model.modules())
    present = sorted(counts)
    # the most frequent declared class (transformers 5 declares a set: its order depends on the hash seed)
    declared = sorted((name for name in (getattr(meta_model, "_no_split_modules", None) or []) if name in counts),
                      key=lambda name: (-counts[name], name))
    layer = requested or (declared[0] if declared else None) or repeated_block(meta_model)
    if layer is None:
        raise ConfigError(
            f"strategy.wrap_layer is empty: {type(meta_model).__name__} declares no layer class to wrap "
            "(_no_split_modules) and holds no nn.ModuleList of blocks; set it to the class of its repeated block"
        )
    if layer not in present:
        blocks = [n for n in present if n.endswith(("Block", "Layer"))] or present
        raise ConfigError(
            f"strategy.wrap_layer={layer}: no such layer in {type(meta_model).__name__}; choose one of {', '.join(blocks)}"
        )
    return layer
