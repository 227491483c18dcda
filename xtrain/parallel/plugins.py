"""RunConfig → Accelerate settings: one pure function family, no hidden inputs.

`accelerator_kwargs` gives the Accelerator its precision, its compile plugin and the run's strategy's plugin
(strategies.of(cfg).plugin), every field passed explicitly (Accelerate fills fields left `None` from
`ACCELERATE_*` / `FSDP_*` environment variables). `accelerate_config` is the same run as an `accelerate launch`
config file.
"""

from __future__ import annotations

from xtrain.config.precision import FP8_RECIPES
from xtrain.config.schema import Fp8Backend, Precision, RunConfig
from xtrain.parallel import fp8, strategies
from xtrain.parallel.base import ModelFacts

__all__ = ["ModelFacts", "MIXED_PRECISION", "accelerator_kwargs", "accelerate_config", "fp8_recipe", "dynamo_plugin"]

MIXED_PRECISION = {Precision.fp32: "no", Precision.fp16: "fp16", Precision.bf16: "bf16", Precision.fp8: "fp8"}


def dynamo_plugin(cfg: RunConfig):
    """The Accelerator's TorchDynamoPlugin where Accelerate compiles (FSDP2, ZeRO: in `prepare`), else None."""
    from accelerate.utils import TorchDynamoPlugin

    if not cfg.trainer.compile or not strategies.of(cfg).compiles_in_prepare:
        return None
    return TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)


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
        return dict(config=fp8.config(cfg.precision, fsdp=strategies.of(cfg).shards_fp8_weights),
                    module_filter_func=fp8.converted_already, pad_inner_dim=None,
                    enable_fsdp_float8_all_gather=None)
    return dict(opt_level="O2")


def accelerator_kwargs(cfg: RunConfig, facts: ModelFacts) -> dict:
    """Keyword arguments for `Accelerator(...)` that carry the strategy and precision."""
    kwargs: dict = {"mixed_precision": MIXED_PRECISION[cfg.precision.name]}
    if dynamo_plugin(cfg):
        kwargs["dynamo_plugin"] = dynamo_plugin(cfg)
    if cfg.precision.name is Precision.fp8:
        import accelerate.utils

        recipe = getattr(accelerate.utils, FP8_RECIPES[cfg.precision.fp8_backend])
        kwargs["kwargs_handlers"] = [recipe(**fp8_recipe(cfg))]
    return {**kwargs, **strategies.of(cfg).plugin(cfg, facts)}


def accelerate_config(cfg: RunConfig, facts: ModelFacts, files: dict | None = None, cuda: bool = True) -> dict:
    """The same run as a config file for `accelerate launch --config_file` (`files`: the strategy's launch files by
    name, as written; `cuda`: the machine has CUDA GPUs).

    Without CUDA a DDP run is MULTI_CPU (gloo): `accelerate launch` starts several CPU processes only through
    mpirun (`--mpirun_hostfile`), else one."""
    c = cfg.cluster
    parallelism = strategies.of(cfg)
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
        **parallelism.launch_config(cfg, facts, files or {}, cuda),
    }
    if not parallelism.owns_precision:
        out["mixed_precision"] = MIXED_PRECISION[cfg.precision.name]
    if cfg.precision.name is Precision.fp8:
        out["fp8_config"] = {"backend": cfg.precision.fp8_backend.value.upper()}
    return out
