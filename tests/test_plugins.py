"""Config → Accelerate plugins: complete, explicit, and identical to what `accelerate launch` builds from our files."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from conftest import compose_run, refusal
from xtrain.config.schema import ConfigError, Precision, Strategy
from xtrain.parallel import fsdp, plugins, strategies
from xtrain.parallel.zero import deepspeed_config

FACTS = plugins.ModelFacts(hidden_size=128, wrap_layer="GPT2Block")
PRECISIONS = ["fp32", "bf16", "fp16"]
ZERO = ["zero1", "zero2", "zero3"]


@pytest.fixture(autouse=True)
def no_accelerate_env(monkeypatch):
    """Plugins read unset fields from these; a test sees only what it sets itself (restored afterwards)."""
    import os

    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(key)


def walk(tree, path=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from walk(value, f"{path}.{key}" if path else key)
    else:
        yield path, tree


@pytest.mark.parametrize("strategy", ZERO)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_deepspeed_config_is_complete(strategy, precision):
    cfg = compose_run(f"strategy={strategy}", f"precision={precision}", "trainer.batch_size=4",
                      "trainer.grad_accum=3", "trainer.max_grad_norm=0.5", "cluster.num_processes=8",
                      "cluster.nodes=2")
    ds = deepspeed_config(cfg, FACTS)
    assert not [key for key, value in walk(ds) if value == "auto"]
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 4 * 3 * 16
    assert ds["gradient_clipping"] == 0.5
    assert ds["fp16"]["enabled"] is (precision == "fp16") and ds["bf16"]["enabled"] is (precision == "bf16")
    assert ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    zero = ds["zero_optimization"]
    assert zero["stage"] == int(strategy[-1])
    assert zero["overlap_comm"] and zero["contiguous_gradients"] and zero["reduce_bucket_size"] == 128 * 128
    if strategy == "zero3":
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 128 * 128)
        assert zero["stage3_param_persistence_threshold"] == 10 * 128
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
        assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == 10**9
    else:
        assert zero["allgather_bucket_size"] == 5 * 10**8 and zero["reduce_scatter"] is True
        assert not [k for k in zero if k.startswith("stage3")]


def test_offload_sections():
    cfg = compose_run("strategy=zero3", "strategy.offload_optimizer=cpu", "strategy.offload_param=nvme",
                      "strategy.nvme_path=/nvme")
    zero = deepspeed_config(cfg, FACTS)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"}


@pytest.mark.parametrize("strategy", ZERO)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_deepspeed_plugin_ignores_environment(monkeypatch, strategy, precision):
    """Every field is passed, so stray ACCELERATE_* variables change nothing."""
    cfg = compose_run(f"strategy={strategy}", f"precision={precision}")
    clean = plugins.accelerator_kwargs(cfg, FACTS)["deepspeed_plugin"]
    for key, value in {
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "7", "ACCELERATE_GRADIENT_CLIPPING": "9.0",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "0", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "false",
    }.items():
        monkeypatch.setenv(key, value)
    noisy = plugins.accelerator_kwargs(cfg, FACTS)["deepspeed_plugin"]
    assert noisy.deepspeed_config == clean.deepspeed_config
    assert (noisy.zero_stage, noisy.zero3_init_flag, noisy.gradient_accumulation_steps) == (
        int(strategy[-1]), strategy == "zero3", 1)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fsdp2_plugin_settings_and_environment(monkeypatch, precision):
    cfg = compose_run("strategy=fsdp", f"precision={precision}", "strategy.cpu_offload=true",
                      "strategy.activation_checkpointing=true", "strategy.reshard_after_forward=false")
    clean = plugins.accelerator_kwargs(cfg, FACTS)["fsdp_plugin"]
    assert clean.fsdp_version == 2 and clean.transformer_cls_names_to_wrap == ["GPT2Block"]
    assert clean.reshard_after_forward is False and clean.activation_checkpointing is True
    assert clean.cpu_ram_efficient_loading is True
    assert "SHARDED_STATE_DICT" in str(clean.state_dict_type)
    for key, value in {"FSDP_VERSION": "1", "FSDP_OFFLOAD_PARAMS": "false", "FSDP_AUTO_WRAP_POLICY": "NO_WRAP",
                       "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_ACTIVATION_CHECKPOINTING": "false",
                       "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "FSDP_IGNORED_MODULES": "lm_head",
                       "FSDP_RESHARD_AFTER_FORWARD": "true"}.items():
        monkeypatch.setenv(key, value)
    noisy = plugins.accelerator_kwargs(cfg, FACTS)["fsdp_plugin"]
    assert comparable(noisy) == comparable(clean)


def comparable(plugin) -> dict:
    """Plugin fields as plain values (callables by name, enums by str)."""
    out = {}
    for f in dataclasses.fields(plugin):
        value = getattr(plugin, f.name)
        if callable(value) and not isinstance(value, type):
            value = getattr(value, "func", value).__name__
        out[f.name] = value if isinstance(value, (bool, int, float, str, type(None), list, tuple)) else str(value)
    out["ignored_modules"] = out["ignored_modules"] or None  # xtrain passes [] (None would read FSDP_IGNORED_MODULES)
    return out


def launch_env(config_file: str) -> dict:
    """What `accelerate launch --config_file F` puts in the workers' environment (its own code paths)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from xtrain.decorator.run_with_accelerate import _accelerate_env

    args = launch_command_parser().parse_args(["--config_file", config_file, "train.py"])
    return _accelerate_env(*_validate_launch_command(args), port=29500)


def export(cfg, tmp_path):
    files = {}
    for name, text in strategies.of(cfg).launch_files(cfg, FACTS).items():
        (tmp_path / name).write_text(text)
        files[name] = str(tmp_path / name)
    config_file = tmp_path / "accelerate_config.yaml"
    config_file.write_text(yaml.safe_dump(plugins.accelerate_config(cfg, FACTS, files)))
    return str(config_file)


ROUND_TRIP = [(s, p, []) for s in ZERO for p in PRECISIONS] + [
    ("zero3", "bf16", ["strategy.offload_optimizer=cpu", "strategy.offload_param=cpu"]),
    ("zero2", "bf16", ["strategy.offload_optimizer=nvme", "strategy.nvme_path=/nvme"]),
] + [("fsdp", p, []) for p in PRECISIONS] + [
    ("fsdp", "bf16", ["strategy.cpu_offload=true", "strategy.state_dict_type=full",
                      "strategy.activation_checkpointing=true", "strategy.reshard_after_forward=false"]),
    # FSDP1 with cpu_ram_efficient_loading needs a GPU to build its plugin (sync_module_states)
    ("fsdp", "bf16", ["strategy.fsdp_version=1", "strategy.sharding=hybrid_shard", "strategy.cpu_ram_efficient_loading=false"]),
    ("fsdp", "fp32", ["strategy.fsdp_version=1", "strategy.sharding=shard_grad_op", "strategy.cpu_ram_efficient_loading=false"]),
]


@pytest.mark.parametrize("strategy,precision,extra", ROUND_TRIP)
def test_exported_files_reproduce_the_plugin_through_accelerate_launch(monkeypatch, tmp_path, strategy, precision,
                                                                       extra):
    """accelerate_config.yaml (+ deepspeed.json) → Accelerate's config loading and launch translation → the
    worker environment → the plugin Accelerate builds from it == the plugin xtrain builds."""
    cfg = compose_run(f"strategy={strategy}", f"precision={precision}", "cluster.num_processes=4", *extra)
    ours = plugins.accelerator_kwargs(cfg, FACTS)
    env = launch_env(export(cfg, tmp_path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    if cfg.strategy.name.value in ZERO:
        # precision lives in deepspeed.json (Accelerate refuses it in both files): the launcher passes "no" and
        # the worker's AcceleratorState applies it to the plugin, as ours applies cfg's precision
        assert env["ACCELERATE_MIXED_PRECISION"] == "no"
        theirs, mine = DeepSpeedPlugin(), ours["deepspeed_plugin"]
        theirs.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
        mine.set_mixed_precision(ours["mixed_precision"])
        assert theirs.deepspeed_config == mine.deepspeed_config
        assert theirs.deepspeed_config["bf16"]["enabled"] is (precision == "bf16")
        assert theirs.deepspeed_config["fp16"]["enabled"] is (precision == "fp16")
        for name in ("zero_stage", "offload_optimizer_device", "offload_param_device", "zero3_init_flag",
                     "zero3_save_16bit_model", "gradient_accumulation_steps", "gradient_clipping"):
            assert getattr(theirs, name) == getattr(mine, name), name
    else:
        assert env["ACCELERATE_MIXED_PRECISION"] == ours["mixed_precision"]
        assert comparable(FullyShardedDataParallelPlugin()) == comparable(ours["fsdp_plugin"])


def test_ddp_export_has_no_plugin(tmp_path):
    cfg = compose_run("precision=bf16", "cluster.num_processes=2")
    exported = yaml.safe_load(open(export(cfg, tmp_path)))
    assert exported["distributed_type"] == "MULTI_GPU" and exported["mixed_precision"] == "bf16"
    assert exported["use_cpu"] is False
    assert exported["num_processes"] == 2 and "fsdp_config" not in exported and "deepspeed_config" not in exported
    assert set(plugins.accelerator_kwargs(cfg, FACTS)) == {"mixed_precision"}


@pytest.mark.parametrize("processes,distributed_type", [(1, "NO"), (2, "MULTI_CPU")])
def test_ddp_export_without_cuda_is_a_cpu_run(processes, distributed_type):
    """MULTI_GPU without CUDA would start ranks that each train alone (DistributedType.NO)."""
    cfg = compose_run(f"cluster.num_processes={processes}")
    exported = plugins.accelerate_config(cfg, FACTS, None, cuda=False)
    assert exported["distributed_type"] == distributed_type and exported["use_cpu"] is True
    # the test seams' FSDP and ZeRO runs stay what they are (use_cpu would make Accelerate drop them)
    fsdp = plugins.accelerate_config(compose_run("strategy=fsdp", "cluster.num_processes=2"), FACTS, None, cuda=False)
    assert fsdp["distributed_type"] == "FSDP" and fsdp["use_cpu"] is False


def test_user_deepspeed_json_is_merged_and_conflicts_are_errors(tmp_path):
    cfg = compose_run("strategy=zero2", "precision=bf16", "trainer.batch_size=8", "strategy.deepspeed_config=x.json")
    user = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 123, "overlap_comm": False},
        "activation_checkpointing": {"partition_activations": True},
    }
    merged = deepspeed_config(cfg, FACTS, user)
    assert merged["train_micro_batch_size_per_gpu"] == 8 and merged["bf16"]["enabled"] is True
    assert merged["zero_optimization"]["reduce_bucket_size"] == 123  # the user's tuning wins
    assert merged["zero_optimization"]["overlap_comm"] is False
    assert merged["activation_checkpointing"] == {"partition_activations": True}
    assert not [key for key, value in walk(merged) if value == "auto"]
    for conflict, message in [
        ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu=4 but trainer.batch_size gives 8"),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage=3 but strategy gives 2"),
        ({"fp16": {"enabled": True}}, "fp16.enabled=true but precision gives false"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
         'zero_optimization.offload_optimizer.device="cpu" but strategy.offload_optimizer gives "none"'),
    ]:
        with pytest.raises(ConfigError, match=f"strategy.deepspeed_config=x.json: sets {message}".replace(".", r"\.")):
            deepspeed_config(cfg, FACTS, conflict)


@pytest.mark.parametrize("backend,recipe", [("te", "TERecipeKwargs"), ("torchao", "AORecipeKwargs"),
                                            ("msamp", "MSAMPRecipeKwargs")])
def test_fp8_recipe_sets_every_field_of_accelerates_recipe(backend, recipe, monkeypatch):
    import accelerate.utils

    from xtrain.parallel import fp8

    monkeypatch.setattr(fp8, "config", lambda precision, fsdp: "torchao's config")  # (torchao: test_fp8_on_cpu.py)
    cfg = compose_run("precision=fp8", f"precision.fp8_backend={backend}")
    if not hasattr(accelerate.utils, recipe):  # (MS-AMP's, which Accelerate dropped in 1.16): refused before launch
        from xtrain.launch import hardware

        monkeypatch.setattr(hardware.seams, "first", lambda *args: True)  # (past "needs a GPU")
        assert hardware.refusal(cfg) == (f"precision.fp8_backend={backend}: this Accelerate "
                                         f"({accelerate.__version__}) has no such backend (MS-AMP's ended with 1.15); "
                                         "use precision.fp8_backend=te or torchao")
        return
    fields = {f.name for f in dataclasses.fields(getattr(accelerate.utils, recipe))}
    assert set(plugins.fp8_recipe(cfg)) == fields
    exported = plugins.accelerate_config(cfg, FACTS, None)
    assert exported["fp8_config"] == {"backend": backend.upper()} and exported["mixed_precision"] == "fp8"


def test_fsdp_wrap_layer_is_detected_and_checked():
    from xtrain.tasks.causal_lm import model as models

    gpt2 = models.on_meta(compose_run().model, 128)
    llama = models.on_meta(compose_run("model=tiny_llama").model, 128)
    assert fsdp.wrap_layer(None, gpt2) == "GPT2Block"
    assert fsdp.wrap_layer(None, llama) == "LlamaDecoderLayer"
    assert fsdp.wrap_layer("GPT2MLP", gpt2) == "GPT2MLP"
    with pytest.raises(ConfigError, match="strategy.wrap_layer=LlamaDecoderLayer: no such layer in GPT2LMHeadModel; "
                                          "choose one of GPT2Block"):
        fsdp.wrap_layer("LlamaDecoderLayer", gpt2)


ZERO_ONLY = "no such setting with this strategy: it is a setting of strategy=zero1|zero2|zero3; use one of those"
FSDP_ONLY = "no such setting with this strategy: it is a setting of strategy=fsdp; add strategy=fsdp"


@pytest.mark.parametrize("overrides,message", [
    (["strategy=zero2", "strategy.offload_param=cpu"], "strategy.offload_param=cpu: needs strategy=zero3"),
    (["strategy=ddp", "strategy.offload_optimizer=cpu"], f"strategy.offload_optimizer=cpu: {ZERO_ONLY}"),
    (["strategy=fsdp", "strategy.offload_optimizer=cpu"], f"strategy.offload_optimizer=cpu: {ZERO_ONLY}"),
    (["strategy=zero3", "strategy.offload_param=nvme"], "strategy.nvme_path is empty"),
    (["strategy=fsdp", "strategy.sharding=hybrid_shard"], "other sharding strategies need strategy.fsdp_version=1"),
    (["strategy=zero2", "strategy.cpu_offload=true"], f"strategy.cpu_offload=true: {FSDP_ONLY}"),
    (["strategy=ddp", "strategy.deepspeed_config=a.json"], f"strategy.deepspeed_config=a.json: {ZERO_ONLY}"),
    # every setting of FSDP's alone, given with another strategy (it would do nothing there): no such setting
    (["strategy=ddp", "strategy.wrap_layer=GPT2Block"], f"strategy.wrap_layer=GPT2Block: {FSDP_ONLY}"),
    (["strategy=zero3", "strategy.state_dict_type=full"], f"strategy.state_dict_type=full: {FSDP_ONLY}"),
    (["strategy=ddp", "strategy.fsdp_version=1"], f"strategy.fsdp_version=1: {FSDP_ONLY}"),
    (["strategy=ddp", "strategy.sharding=no_shard"], f"strategy.sharding=no_shard: {FSDP_ONLY}"),
    (["strategy=zero2", "strategy.reshard_after_forward=false"], f"strategy.reshard_after_forward=false: {FSDP_ONLY}"),
    (["strategy=ddp", "strategy.cpu_ram_efficient_loading=false"], f"strategy.cpu_ram_efficient_loading=false: {FSDP_ONLY}"),
    (["strategy=zero2", "strategy.offload_optimizer=cpu", "strategy.nvme_path=/nvme"],
     "strategy.nvme_path=/nvme: only for nvme offload"),
    (["strategy=zero2", "strategy.name=ddp"], "strategy.name=ddp: set by the strategy option; use strategy=ddp"),
])
def test_inconsistent_strategy_settings(overrides, message):
    assert message in refusal(*overrides)


def test_strategy_and_precision_options_match_the_enums():
    from test_config import options

    assert options("strategy") == sorted(s.value for s in Strategy)
    assert options("precision") == sorted(p.value for p in Precision)


@pytest.mark.parametrize(("overrides", "distributed_type", "processes"), [
    (["strategy=fsdp"], "NO", 1),  # single process without a launcher: Accelerate drops FSDP
    (["strategy=fsdp", "cluster.num_processes=2"], "MULTI_GPU", 2),
    (["strategy=zero3"], "NO", 1),
    (["strategy=ddp", "cluster.num_processes=2"], "NO", 1),  # N lone processes
    (["strategy=ddp", "cluster.num_processes=2"], "MULTI_CPU", 1),
])
def test_a_setup_other_than_the_requested_one_stops_the_run(overrides, distributed_type, processes):
    from accelerate.utils import DistributedType
    from xtrain.engine.accelerator import check_setup

    with pytest.raises(RuntimeError, match="stopping rather than training something else"):
        check_setup(compose_run(*overrides), DistributedType[distributed_type], processes)


@pytest.mark.parametrize(("overrides", "distributed_type", "processes"), [
    ([], "NO", 1),
    (["cluster.num_processes=2"], "MULTI_CPU", 2),
    (["cluster.num_processes=2"], "MULTI_GPU", 2),
    (["strategy=zero1"], "DEEPSPEED", 1),
    (["strategy=fsdp", "cluster.num_processes=2"], "FSDP", 2),
])
def test_the_requested_setup_passes(overrides, distributed_type, processes):
    from accelerate.utils import DistributedType
    from xtrain.engine.accelerator import check_setup

    check_setup(compose_run(*overrides), DistributedType[distributed_type], processes)


def test_fsdp1_ram_efficient_loading_materializes_on_the_ranks_own_gpu(monkeypatch):
    """The plugin captures torch.cuda.current_device() as it is made: xtrain sets rank 3's device first. (CUDA is
    stood in for: its calls are recorded, the plugin is the real one.)"""
    from xtrain.engine import accelerator

    device = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: device.__setitem__(0, index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr("accelerate.utils.dataclasses.get_torch_accelerator_backend",  # (how Accelerate 1.16 asks)
                        lambda *args, **kwargs: ("cuda", torch.cuda), raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    cfg = compose_run("strategy=fsdp", "strategy.fsdp_version=1", "strategy.cpu_ram_efficient_loading=true")
    plugin = accelerator.plugin_kwargs(cfg, FACTS)["fsdp_plugin"]
    placed = []

    class Module:
        def to_empty(self, device, recurse):
            placed.append(device)

    plugin.param_init_fn(Module())
    (where,) = placed  # (an index as the plugin is made, or Accelerate 1.16's "cuda": the current device as it is used)
    assert where == 3 or where == torch.device("cuda") and torch.cuda.current_device() == 3
