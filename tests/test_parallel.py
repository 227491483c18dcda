"""The strategy's home (xtrain/parallel/): each strategy answers for itself, nothing outside branches on its name,
the dims hold the one effective-batch formula, and the seams are installed only through their one hook."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from conftest import REPO, SEAMS, compose_run, seams
from xtrain.config.schema import ConfigError, Strategy
from xtrain.core import seams as hook
from xtrain.parallel import dims, strategies
from xtrain.parallel.base import ModelFacts

FACTS = ModelFacts(hidden_size=64, wrap_layer="GPT2Block")
# what a test or a reader would call a branch on the strategy's name
BRANCH = re.compile(r"Strategy\.(ddp|fsdp|zero[123]?)\b|is_zero\(|fsdp_version ==|\.tp > 1")


def test_outside_parallel_at_most_ten_places_branch_on_the_strategy():
    """The config's own rules (what a strategy's settings may be) are the only ones left outside parallel/."""
    found = []
    for path in (REPO / "xtrain").rglob("*.py"):
        if "parallel" in path.relative_to(REPO / "xtrain").parts[:1]:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if BRANCH.search(code) and ("if " in code or " is " in code or " in (" in code):
                found.append(f"{path.relative_to(REPO)}:{number}")
    assert len(found) <= 10, found
    assert all(place.startswith("xtrain/config/") for place in found), found


@pytest.mark.parametrize("strategy,types,form,owns_precision", [
    ("ddp", {"MULTI_CPU", "MULTI_GPU"}, "ddp", False),
    ("zero1", {"DEEPSPEED"}, "deepspeed", True),
    ("zero3", {"DEEPSPEED"}, "deepspeed", True),
    ("fsdp", {"FSDP"}, "fsdp sharded", False),
])
def test_each_strategy_answers_for_itself(strategy, types, form, owns_precision):
    cfg = compose_run(f"strategy={strategy}", "cluster.num_processes=2")
    parallelism = strategies.of(cfg)
    assert parallelism.accelerate_types(2) == types
    assert parallelism.checkpoint_form(cfg) == form
    assert parallelism.owns_precision is owns_precision
    assert parallelism.trains_in_process(1) is (strategy == "ddp")
    files = parallelism.launch_files(cfg, FACTS)
    assert set(files) == ({"deepspeed.json"} if strategy.startswith("zero") else set())


def test_every_strategy_name_has_its_parallelism():
    assert set(strategies.BY_NAME) == set(Strategy)


@pytest.mark.parametrize("overrides,shape,data_parallel", [
    (["strategy=ddp", "cluster.num_processes=4"], (4, 1, 1), 4),
    (["strategy=zero2", "cluster.num_processes=4"], (1, 4, 1), 4),
    (["strategy=fsdp", "cluster.num_processes=8", "strategy.dp_replicate=2", "strategy.tp=2"], (2, 2, 2), 4),
])
def test_the_effective_batch_counts_the_data_parallel_ranks_only(overrides, shape, data_parallel):
    """A tensor-parallel group's ranks share one batch."""
    cfg = compose_run(*overrides, "trainer.batch_size=3", "trainer.grad_accum=5")
    found = dims.of(cfg)
    assert (found.dp_replicate, found.dp_shard, found.tp) == shape and found.world == cfg.cluster.world_size
    assert found.data_parallel == data_parallel and dims.effective_batch(cfg) == 3 * 5 * data_parallel


def test_the_rank_groups_of_each_axis():
    mesh = dims.ParallelDims(dp_replicate=2, dp_shard=2, tp=2)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_without_the_hook_no_seam_is_loaded_and_every_hook_answers_none(monkeypatch):
    monkeypatch.delenv(hook.ENV, raising=False)
    assert hook.installed() == [] and hook.first("runs_on_cpu", "fsdp", None) is None


def test_a_seam_answers_only_the_hooks_it_defines(monkeypatch):
    cfg = compose_run("strategy=fsdp")
    monkeypatch.setenv(hook.ENV, seams("fsdp_on_cpu", "timings")[hook.ENV])
    monkeypatch.setenv("XTRAIN_TEST_LINGER_S", "3")
    assert hook.first("runs_on_cpu", "fsdp", cfg) is True and hook.first("runs_on_cpu", "zero", cfg) is None
    assert hook.first("linger_s") == 3.0 and hook.first("spawn_ranks") is None


def test_nothing_under_the_package_reads_a_tests_variable_or_imports_a_seam():
    for path in (REPO / "xtrain").rglob("*.py"):
        text = path.read_text()
        assert "XTRAIN_TEST_" not in text and "seams/" not in text.replace("tests/seams/", ""), path
    assert sorted(p.stem for p in SEAMS.glob("*.py")) == ["fp16_on_cpu", "fp8_on_cpu", "fsdp_on_cpu", "timings",
                                                        "zero_on_cpu"]


def test_what_a_resume_may_change_is_said_on_each_field():
    from xtrain.engine.resume import Change

    for key in ("trainer.log_every", "cluster.check_memory", "cluster.nodes", "strategy.tp", "tracker.project",
                "data.num_proc", "run_dir"):
        assert not Change(key, 1, 2).trains, key
    for key in ("trainer.batch_size", "trainer.lr", "model.num_layers", "data.block_size", "precision.name"):
        assert Change(key, 1, 2).trains, key


def test_each_option_has_a_schema_of_its_own():
    """Another option's setting is no such setting; the settings every option reads are in the group's base."""
    from xtrain.config import schema
    from xtrain.config.cluster import ClusterKind, LocalConfig, SlurmConfig
    from xtrain.config.strategy import DdpConfig, FsdpConfig, StrategyConfig, ZeroConfig, strategy_config

    assert [type(strategy_config(s)) for s in Strategy] == [DdpConfig, ZeroConfig, ZeroConfig, ZeroConfig, FsdpConfig]
    assert {"fsdp_version", "offload_optimizer"} & {f.name for f in dataclasses.fields(DdpConfig)} == set()
    assert {f.name for f in dataclasses.fields(StrategyConfig)} == {"name", "dp_replicate", "tp", "cp", "pp", "pp_schedule",
                                                                  "pp_stage_layers", "pp_microbatches", "pp_virtual_stages"}
    assert "partition" in {f.name for f in dataclasses.fields(SlurmConfig)} - {f.name for f in dataclasses.fields(LocalConfig)}
    index = schema.setting_index()
    assert (index["strategy.sharding"], index["strategy.nvme_path"], index["strategy.tp"]) == \
        ("strategy=fsdp", "strategy=zero1|zero2|zero3", "")
    assert index["cluster.partition"] == "cluster=slurm" and index["cluster.nodes"] == ""
    assert schema.option_schema("cluster", {"kind": ClusterKind.slurm}) is SlurmConfig
    with pytest.raises(ConfigError, match="strategy.name=zero3: set by the strategy option; use strategy=zero3"):
        DdpConfig(name=Strategy.zero3)
    from xtrain.config.data import DataSource, HfData, PydocData, SftData, TextData, data_config

    assert type(data_config(DataSource.text, files=["a.txt"])) is TextData and type(schema.RunConfig().data) is PydocData
    assert (index["data.files"], index["data.packing"], index["data.split"], index["data.block_size"]) == \
        ("data=text|sft|images", "data=sft", "data=hf|sft", "data=pydoc|text|hf|sft|images")  # (not data=custom)
    conf = Path(schema.__file__).parents[1] / "conf" / "model"
    by_schema = sorted(p.stem for p in conf.glob("*.yaml") if "_target_" not in p.read_text())
    assert index["model.num_layers"] == f"model={'|'.join(by_schema)}"  # (not model=custom, resnet or vit)
    assert schema.option_schema("data", {"source": "hf", "name": "x"}) is HfData
    with pytest.raises(ConfigError, match="data.source=hf: set by the data option; use data=hf"):
        schema.option_schema("data", {**{f.name: None for f in dataclasses.fields(TextData)}, "source": "hf"})
    with pytest.raises(ConfigError, match="data.split=validation: a setting of a dataset by name, and this run reads "
                                          "data.files; use data.name="):
        SftData(files=["chat.jsonl"], split="validation")
    assert SftData(name="org/chats", split="validation").split == "validation"


def test_a_run_yaml_of_flat_groups_still_loads(tmp_path):
    """A run.yaml (or a checkpoint's config) written when a group's settings were one list for all its options holds
    the other options' at their defaults: read as the chosen option's settings."""
    from omegaconf import OmegaConf

    from xtrain.config import schema

    flat = schema.to_container(schema.RunConfig())
    flat["strategy"].update(offload_optimizer="none", fsdp_version=2, sharding="full_shard", wrap_layer=None)
    flat["cluster"].update(partition=None, time_limit="01:00:00", min_nodes=None, sbatch_args={})
    flat["data"].update(files=[], name=None, config_name=None, split="train", format="auto", packing=True)
    (tmp_path / "run.yaml").write_text(OmegaConf.to_yaml(flat))
    cfg = schema.load(str(tmp_path / "run.yaml"))
    assert type(cfg.strategy).__name__ == "DdpConfig" and type(cfg.cluster).__name__ == "LocalConfig"
    assert schema.to_container(cfg) == schema.to_container(schema.RunConfig())


def test_the_tiers_are_found_from_what_each_test_starts():
    import tiers

    assert tiers._reach("test_the_rank_groups_of_each_axis")[0] & (tiers.RUNS | tiers.E2E) == set()
    assert "xtrain_in_process" in tiers._reach("test_bad_input_is_one_line_exit_2_and_creates_nothing")[0]
    assert "start_xtrain" in tiers._reach(
        "test_one_trainer_per_run_dir_a_second_is_refused_naming_the_live_one_until_it_is_gone")[0]
