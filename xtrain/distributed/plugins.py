"""RunConfig → Accelerate settings: one pure function family, no hidden inputs.

`accelerator_kwargs` builds the DeepSpeed / FSDP plugin with every field passed
explicitly (Accelerate fills fields left `None` from `ACCELERATE_*` / `FSDP_*`
environment variables). `deepspeed_config` is complete: no `"auto"` where xtrain
knows the value. `accelerate_config` is the same run as an `accelerate launch`
config file.
"""

from __future__ import annotations

import collections
import copy
import json
import os
from dataclasses import dataclass

from xtrain.config.schema import Fp8Backend, ModelSource, Offload, Precision, RunConfig, StateDictType, Strategy
from xtrain.config.strategy import StrategyConfig
from xtrain.core.errors import ConfigError
from xtrain.distributed import compiling, fp8, mesh

ZERO_STAGE = {Strategy.zero1: 1, Strategy.zero2: 2, Strategy.zero3: 3}
MIXED_PRECISION = {Precision.fp32: "no", Precision.fp16: "fp16", Precision.bf16: "bf16", Precision.fp8: "fp8"}


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


def builds_on_meta(cfg: RunConfig) -> bool:
    """A model built from config, built on meta (meta_init): under FSDP2 each rank's shards filled, never whole;
    under DDP on a GPU made there directly, not on the host and then moved. (cpu_ram_efficient_loading is for
    pretrained weights: rank 0 loads them and broadcasts them.)"""
    import torch

    s = cfg.strategy
    if getattr(cfg.model, "source", None) is not ModelSource.config:
        return False
    on_gpu = s.name is Strategy.ddp and torch.cuda.is_available() and not cfg.model.lora.enabled
    return on_gpu or s.name is Strategy.fsdp and s.fsdp_version == 2 and s.tp == 1  # (TP splits the built model)


def torchao_fp8(cfg: RunConfig) -> bool:
    return cfg.precision.name is Precision.fp8 and cfg.precision.fp8_backend is Fp8Backend.torchao


def is_zero(strategy: StrategyConfig) -> bool:
    return strategy.name in ZERO_STAGE


def _offload(device: Offload, nvme_path: str | None, **extra) -> dict:
    section = {"device": device.value, "pin_memory": True, **extra}
    if device is Offload.nvme:
        section["nvme_path"] = nvme_path
    return section


def _zero_optimization(strategy: StrategyConfig, facts: ModelFacts) -> dict:
    s = strategy
    stage = ZERO_STAGE[s.name]
    hidden = facts.hidden_size
    section: dict = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": hidden * hidden,
        "allgather_partitions": True,
        "allgather_bucket_size": int(5e8),
        "round_robin_gradients": False,
    }
    if s.offload_optimizer is not Offload.none:
        section["offload_optimizer"] = _offload(s.offload_optimizer, s.nvme_path)
    if stage == 3:
        section.update(
            sub_group_size=int(1e9),
            stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
            stage3_param_persistence_threshold=10 * hidden,
            stage3_max_live_parameters=int(1e9),
            stage3_max_reuse_distance=int(1e9),
            stage3_gather_16bit_weights_on_model_save=True,
        )
        del section["allgather_partitions"], section["allgather_bucket_size"], section["reduce_scatter"]
        if s.offload_param is not Offload.none:
            section["offload_param"] = _offload(s.offload_param, s.nvme_path)
    return section


def deepspeed_config(cfg: RunConfig, facts: ModelFacts, user: dict | None = None) -> dict:
    """The complete DeepSpeed config; `user` (your own JSON) is merged under the typed settings."""
    t = cfg.trainer
    precision = cfg.precision.name
    ours = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": mesh.effective_batch(cfg),  # (ZeRO: every rank a data-parallel rank)
        "gradient_clipping": t.max_grad_norm,
        "fp16": {
            "enabled": precision is Precision.fp16,
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        # fp8 runs its matmuls in fp8 inside bf16 autocast: Accelerate's DeepSpeed path relies on bf16 being on
        "bf16": {"enabled": precision in (Precision.bf16, Precision.fp8)},
        "zero_optimization": _zero_optimization(cfg.strategy, facts),
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if t.optimizer.get("_target_"):  # the user's own optimizer, which ZeRO partitions as it does torch's AdamW
        ours["zero_allow_untested_optimizer"] = True
    return merge_user_config(ours, user or {}, cfg.strategy.deepspeed_config)


# Keys whose value xtrain derives from the typed config: a user file may leave them out or
# "auto", but a different value is a conflict, not a silent override.
_TYPED_KEYS = (
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
    "fp16.enabled", "bf16.enabled", "zero_optimization.stage",
    "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
)
_TYPED_SOURCE = {
    "train_micro_batch_size_per_gpu": "trainer.batch_size",
    "gradient_accumulation_steps": "trainer.grad_accum",
    "train_batch_size": "trainer.batch_size x trainer.grad_accum x world size",
    "gradient_clipping": "trainer.max_grad_norm",
    "fp16.enabled": "precision", "bf16.enabled": "precision", "zero_optimization.stage": "strategy",
    "zero_optimization.offload_optimizer.device": "strategy.offload_optimizer",
    "zero_optimization.offload_param.device": "strategy.offload_param",
}


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def merge_user_config(ours: dict, user: dict, source: str | None) -> dict:
    for key in _TYPED_KEYS:
        theirs, mine = _get(user, key), _get(ours, key)
        if theirs in (None, "auto"):
            continue
        if mine is None:
            mine = "none" if key.endswith(".device") else None
        if theirs != mine:
            raise ConfigError(
                f"strategy.deepspeed_config={source}: sets {key}={json.dumps(theirs)} but {_TYPED_SOURCE[key]} "
                f"gives {json.dumps(mine)}; remove it from the file (or set it to \"auto\") or change {_TYPED_SOURCE[key]}"
            )
    merged = _deep_merge(user, ours)  # typed settings win (equal by now where both are set)
    # the user's tuning of everything else (bucket sizes, thresholds, extra sections) wins over our template
    for key, value in user.get("zero_optimization", {}).items():
        if f"zero_optimization.{key}" not in _TYPED_KEYS and value != "auto" and not isinstance(value, dict):
            merged["zero_optimization"][key] = value
    for key, value in user.items():
        if key not in ours:
            merged[key] = value
    return merged


def load_user_deepspeed_config(strategy: StrategyConfig) -> dict:
    path = strategy.deepspeed_config
    if not path:
        return {}
    try:
        with open(os.path.expanduser(path)) as f:
            user = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"strategy.deepspeed_config={path}: no such file") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"strategy.deepspeed_config={path}: not valid JSON ({err})") from None
    if not isinstance(user, dict):
        raise ConfigError(f"strategy.deepspeed_config={path}: must hold a JSON object")
    return user


def fsdp_settings(strategy: StrategyConfig, facts: ModelFacts) -> dict:
    """Every FullyShardedDataParallelPlugin field xtrain decides, by its Accelerate name."""
    s = strategy
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


def fp8_recipe(cfg: RunConfig) -> dict:
    """Every field of the FP8 recipe for the chosen backend (Accelerate reads unset ones from ACCELERATE_FP8_*)."""
    backend = cfg.precision.fp8_backend
    if backend is Fp8Backend.te:
        return dict(
            fp8_format="HYBRID", margin=0, interval=1, amax_history_len=1024, amax_compute_algo="max",
            override_linear_precision=(False, False, False), use_autocast_during_eval=False,
            use_mxfp8_block_scaling=False,
        )
    if backend is Fp8Backend.torchao:  # (pad_inner_dim and the all-gather: set in the config, Accelerate's own)
        return dict(config=fp8.config(cfg.precision, fsdp=cfg.strategy.name is Strategy.fsdp),
                    module_filter_func=fp8.converted_already, pad_inner_dim=None,
                    enable_fsdp_float8_all_gather=None)
    return dict(opt_level="O2")


def accelerator_kwargs(cfg: RunConfig, facts: ModelFacts, user_ds: dict | None = None) -> dict:
    """Keyword arguments for `Accelerator(...)` that carry the strategy and precision."""
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    kwargs: dict = {"mixed_precision": MIXED_PRECISION[cfg.precision.name]}
    if compiling.dynamo_plugin(cfg):
        kwargs["dynamo_plugin"] = compiling.dynamo_plugin(cfg)
    if cfg.precision.name is Precision.fp8:
        from accelerate.utils import AORecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs

        recipe = {Fp8Backend.te: TERecipeKwargs, Fp8Backend.torchao: AORecipeKwargs,
                  Fp8Backend.msamp: MSAMPRecipeKwargs}[cfg.precision.fp8_backend]
        kwargs["kwargs_handlers"] = [recipe(**fp8_recipe(cfg))]
    if is_zero(cfg.strategy):
        ds = deepspeed_config(cfg, facts, user_ds)
        s = cfg.strategy
        zero = ds["zero_optimization"]
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            hf_ds_config=ds,
            gradient_accumulation_steps=ds["gradient_accumulation_steps"],
            gradient_clipping=ds["gradient_clipping"],
            zero_stage=zero["stage"],
            offload_optimizer_device=zero.get("offload_optimizer", {}).get("device", "none"),
            offload_param_device=zero.get("offload_param", {}).get("device", "none"),
            offload_optimizer_nvme_path=s.nvme_path or "none",
            offload_param_nvme_path=s.nvme_path or "none",
            zero3_init_flag=zero["stage"] == 3,
            zero3_save_16bit_model=zero["stage"] == 3,
            is_train_batch_min=True,
            transformer_moe_cls_names=None,
            enable_msamp=cfg.precision.name is Precision.fp8 and cfg.precision.fp8_backend.value == "msamp",
            msamp_opt_level="O1",
        )
    elif cfg.strategy.name is Strategy.fsdp:
        from xtrain.distributed import mesh

        if mesh.parallelism_config(cfg) is not None:
            kwargs["parallelism_config"] = mesh.parallelism_config(cfg)
        settings = fsdp_settings(cfg.strategy, facts)
        if builds_on_meta(cfg) and torchao_fp8(cfg):  # Accelerate refuses the two together; a model built on
            settings["cpu_ram_efficient_loading"] = False  # meta has no weights on rank 0 to broadcast anyway
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            **settings,
            ignored_modules=[],  # None would be read from FSDP_IGNORED_MODULES
            min_num_params=None,  # read (from FSDP_MIN_NUM_PARAMS) only for size-based wrapping
            activation_checkpointing_offload=False,
        )
    return kwargs


def accelerate_config(cfg: RunConfig, facts: ModelFacts, deepspeed_json: str | None, cuda: bool = True) -> dict:
    """The same run as a config file for `accelerate launch --config_file` (`cuda`: the machine has CUDA GPUs).

    Without CUDA a DDP run is MULTI_CPU (gloo): `accelerate launch` starts several CPU processes only through
    mpirun (`--mpirun_hostfile`), else one. Never MULTI_GPU there: its workers would each train alone."""
    c = cfg.cluster
    cpu = not cuda and cfg.strategy.name is Strategy.ddp
    out: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": c.nodes,
        "num_processes": c.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": cpu,
    }
    if is_zero(cfg.strategy):
        out["distributed_type"] = "DEEPSPEED"
        out["deepspeed_config"] = {
            "deepspeed_config_file": deepspeed_json,
            "zero3_init_flag": ZERO_STAGE[cfg.strategy.name] == 3,
        }
        # mixed precision is in the DeepSpeed file: accelerate launch refuses it twice
    elif cfg.strategy.name is Strategy.fsdp:
        out["distributed_type"] = "FSDP"
        out["mixed_precision"] = MIXED_PRECISION[cfg.precision.name]
        names = {
            "fsdp_version": "fsdp_version", "auto_wrap_policy": "fsdp_auto_wrap_policy",
            "transformer_cls_names_to_wrap": "fsdp_transformer_layer_cls_to_wrap", "cpu_offload": "fsdp_offload_params",
            "state_dict_type": "fsdp_state_dict_type", "activation_checkpointing": "fsdp_activation_checkpointing",
            "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
            "reshard_after_forward": "fsdp_reshard_after_forward", "sharding_strategy": "fsdp_sharding_strategy",
            "backward_prefetch": "fsdp_backward_prefetch", "forward_prefetch": "fsdp_forward_prefetch",
            "use_orig_params": "fsdp_use_orig_params", "sync_module_states": "fsdp_sync_module_states",
        }
        settings = fsdp_settings(cfg.strategy, facts)
        settings.pop("limit_all_gathers", None)  # not a launch option; Accelerate's default (True) matches
        fsdp = {names[k]: v for k, v in settings.items()}
        fsdp["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = facts.wrap_layer
        out["fsdp_config"] = fsdp
    else:
        out["distributed_type"] = ("MULTI_CPU" if cpu else "MULTI_GPU") if c.world_size > 1 else "NO"
        out["mixed_precision"] = MIXED_PRECISION[cfg.precision.name]
    if cfg.precision.name is Precision.fp8:
        out["fp8_config"] = {"backend": cfg.precision.fp8_backend.value.upper()}
    return out


def repeated_block(model) -> str | None:
    """The most frequent class among the children of the model's largest nn.ModuleList (by parameters)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return None
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    counts = collections.Counter(type(child).__name__ for child in largest)
    return sorted(counts, key=lambda name: (-counts[name], name))[0]


def fsdp_wrap_layer(requested: str | None, meta_model) -> str:
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
