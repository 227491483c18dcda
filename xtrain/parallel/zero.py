"""DeepSpeed ZeRO stages 1-3: optimizer states (1), and gradients (2), and weights (3) partitioned over the ranks,
optionally offloaded to the host or NVMe. `deepspeed_config` is complete: no `"auto"` where xtrain knows the value,
and a user's own JSON is merged under the typed settings (a conflict is an error, not a silent override)."""

from __future__ import annotations

import copy
import json
import os

from xtrain.config.schema import Offload, Precision, RunConfig, Strategy
from xtrain.config.strategy import StrategyConfig
from xtrain.core import machine, seams
from xtrain.core.errors import ConfigError
from xtrain.parallel import dims
from xtrain.parallel.base import DEEPSPEED_FORM, Parallelism, bytes_per_param

STAGE = {Strategy.zero1: 1, Strategy.zero2: 2, Strategy.zero3: 3}
CONFIG_FILE = "deepspeed.json"


class Zero(Parallelism):
    name = "DeepSpeed ZeRO"
    accelerate_type = "DEEPSPEED"
    owns_precision = True
    compiles_in_prepare = True
    settings_title = CONFIG_FILE

    def __init__(self, stage: int):
        self.stage = stage

    def refusal(self, cfg: RunConfig, cuda: bool) -> str | None:
        if cuda or seams.first("runs_on_cpu", "zero", cfg):
            return None
        return (f"strategy={cfg.strategy.name.value}: DeepSpeed ZeRO needs CUDA GPUs and this machine has none "
                "(Accelerate would fail inside DeepSpeed); use strategy=ddp here, or run on GPU machines "
                "(dry_run=true shows the plan anywhere)")

    def check_machine(self, cfg: RunConfig) -> None:
        s = cfg.strategy
        nvme_offloads = [f"strategy.{name}=nvme" for name in ("offload_optimizer", "offload_param")
                         if getattr(s, name) is Offload.nvme]
        if nvme_offloads and not os.path.isdir(s.nvme_path):
            raise ConfigError(f"strategy.nvme_path={s.nvme_path}: no such directory")
        if nvme_offloads and not machine.async_io_available():
            raise ConfigError(
                f"{nvme_offloads[0]}: DeepSpeed's async_io op cannot be built here (libaio headers missing); "
                "install them (apt-get install libaio-dev) or offload to cpu instead"
            )

    def async_save_refusal(self, cfg: RunConfig) -> str | None:
        return ("DeepSpeed's engine writes ZeRO checkpoints itself, in step (its background writer, the decoupled "
                "checkpoint engine, needs its async_io op and GPUs, and xtrain cannot verify what it leaves)")

    def optimizer_on_host(self, cfg: RunConfig) -> bool:
        return cfg.strategy.offload_optimizer is not Offload.none

    def settings(self, cfg: RunConfig, facts) -> dict:
        return deepspeed_config(cfg, facts, load_user_config(cfg.strategy))

    def plugin(self, cfg: RunConfig, facts) -> dict:
        from accelerate.utils import DeepSpeedPlugin

        ds = self.settings(cfg, facts)
        s = cfg.strategy
        zero = ds["zero_optimization"]
        return {"deepspeed_plugin": DeepSpeedPlugin(
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
            # (MS-AMP's fields only where asked for: Accelerate 1.16 has none)
            **({"enable_msamp": True, "msamp_opt_level": "O1"} if _msamp(cfg) else {}),
        )}

    def launch_files(self, cfg: RunConfig, facts) -> dict[str, str]:
        return {CONFIG_FILE: json.dumps(self.settings(cfg, facts), indent=2) + "\n"}

    def launch_config(self, cfg: RunConfig, facts, files: dict, cuda: bool) -> dict:
        # mixed precision is in the DeepSpeed file: accelerate launch refuses it twice
        return {"distributed_type": self.accelerate_type, "use_cpu": False, "deepspeed_config": {
            "deepspeed_config_file": files.get(CONFIG_FILE), "zero3_init_flag": self.stage == 3}}

    def state_bytes(self, cfg: RunConfig, state: float) -> tuple[float, float, float]:
        """16-bit weights and gradients, the fp32 master copy with the optimizer's states; stage by stage
        partitioned over the ranks, and nothing on the device of what is offloaded."""
        n, s = cfg.cluster.world_size, cfg.strategy
        w, g, k = bytes_per_param(cfg.precision.name, state)
        params, grads, opt = (w / n if self.stage == 3 else w), (g / n if self.stage >= 2 else g), k / n
        return (0 if s.offload_param is not Offload.none else params, grads,
                0 if s.offload_optimizer is not Offload.none else opt)

    def checkpoint_form(self, cfg: RunConfig) -> str:
        return DEEPSPEED_FORM


def _msamp(cfg: RunConfig) -> bool:
    return cfg.precision.name is Precision.fp8 and cfg.precision.fp8_backend.value == "msamp"


def _offload(device: Offload, nvme_path: str | None, **extra) -> dict:
    section = {"device": device.value, "pin_memory": True, **extra}
    if device is Offload.nvme:
        section["nvme_path"] = nvme_path
    return section


def _zero_optimization(strategy: StrategyConfig, facts) -> dict:
    s = strategy
    stage = STAGE[s.name]
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


def deepspeed_config(cfg: RunConfig, facts, user: dict | None = None) -> dict:
    """The complete DeepSpeed config; `user` (your own JSON) is merged under the typed settings."""
    t = cfg.trainer
    precision = cfg.precision.name
    ours = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": dims.effective_batch(cfg),  # (ZeRO: every rank a data-parallel rank)
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


def load_user_config(strategy: StrategyConfig) -> dict:
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
