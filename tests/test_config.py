"""The composed config: every option converts to the typed RunConfig; the key set is frozen."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import compose_run, refusal

from xtrain.commands import cli
from xtrain.config import schema
from xtrain.config.schema import ConfigError, ModelArch, Precision, RunConfig, TargetData, TrackerKind

CONF = Path(__file__).resolve().parents[1] / "xtrain" / "conf"

# The public contract: renaming or removing one of these is a deliberate act (update this list).
GOLDEN_KEYS = """
model.source model.arch model.name_or_path model.hidden_size model.num_layers model.num_heads model.num_kv_heads
model.intermediate_size model.vocab_size model.dropout
model.lora.enabled model.lora.rank model.lora.alpha model.lora.dropout model.lora.target_modules
model.lora.modules_to_save model.lora.quantize_base
data.source data.text_column data.block_size data.val_fraction data.max_val_tokens data.num_proc data.cache_dir
data.test data.files data.name data.config_name data.split data.format data.train_on data.packing data.chat_template
task.name task.metrics task.loss task.code_dir task.num_labels task.problem task.label_column task.text_pair_column
task.num_channels task.image_size task.augment
strategy.name strategy.dp_replicate strategy.tp strategy.cp strategy.pp strategy.pp_schedule strategy.pp_stage_layers
strategy.pp_microbatches strategy.pp_virtual_stages
strategy.offload_optimizer strategy.offload_param strategy.nvme_path strategy.deepspeed_config
strategy.fsdp_version strategy.sharding strategy.cpu_offload strategy.wrap_layer strategy.activation_checkpointing
strategy.state_dict_type strategy.reshard_after_forward strategy.cpu_ram_efficient_loading
precision.name precision.fp8_backend precision.fp8_recipe precision.fp8_skip
cluster.kind cluster.nodes cluster.node_rank cluster.num_processes cluster.main_process_ip cluster.main_process_port
cluster.timeout_s cluster.gpu_memory_gb cluster.check_memory cluster.mtbf_hours cluster.min_nodes cluster.gpus_per_node cluster.cpus_per_task cluster.mem_gb cluster.time_limit
cluster.partition cluster.account cluster.qos cluster.constraint cluster.exclude cluster.job_name cluster.sbatch_args
cluster.setup cluster.srun_args cluster.container_image cluster.container_mounts cluster.container_python cluster.wait cluster.signal_lead_s
cluster.max_requeues cluster.address cluster.cpus_per_node cluster.resources cluster.kuberay cluster.max_restarts
trainer.batch_size trainer.grad_accum trainer.max_steps trainer.max_epochs trainer.limit_train_batches trainer.limit_val_batches trainer.overfit_batches trainer.lr trainer.warmup_steps trainer.min_lr_ratio
trainer.weight_decay trainer.max_grad_norm trainer.eval_every trainer.save_every trainer.async_save trainer.keep_checkpoints
trainer.log_every trainer.seed trainer.fused_optimizer trainer.sample_prompts trainer.sample_max_tokens
trainer.compile trainer.compile_tuning trainer.monitor trainer.monitor_direction trainer.export trainer.early_stop_patience
trainer.early_stop_min_delta trainer.optimizer trainer.scheduler trainer.callbacks
tracker.kind tracker.project tracker.wandb_mode
run_dir resume resume_changes dry_run
""".split()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_setting_names_are_the_golden_set():
    assert schema.setting_names() == GOLDEN_KEYS


def test_default_composes_to_typed_config():
    cfg = compose_run()
    assert isinstance(cfg, RunConfig)
    assert cfg.model.arch is ModelArch.gpt2 and cfg.precision.name is Precision.fp32
    assert cfg.trainer.batch_size == 16 and cfg.tracker.kind is TrackerKind.none


CUSTOM = ["model._target_=m.build", "data.train._target_=d.build", "data.val._target_=d.build"]
IMAGES = ["task=image_cls", "data.files=[photos]", "task.num_labels=10"]


@pytest.mark.parametrize(
    "group,option,extra",
    [("model", o, {"hf": ["model.name_or_path=gpt2"], "custom": ["task=custom", *CUSTOM],
                   "resnet": IMAGES, "vit": IMAGES}.get(o, []))
     for o in options("model")]
    + [("data", o, {"text": ["data.files=[a.txt]"], "hf": ["data.name=x"], "custom": ["task=custom", *CUSTOM],
                   "sft": ["data.files=[a.jsonl]", "model=hf", "model.name_or_path=gpt2"],
                   "images": IMAGES}.get(o, [])) for o in options("data")]
    + [("task", o, {"custom": CUSTOM, "image_cls": IMAGES[1:],
                    "seq_cls": ["model.name_or_path=gpt2", "data.files=[a.jsonl]", "task.num_labels=2"]}.get(o, []))
       for o in options("task")]
    + [(g, o, []) for g in ("strategy", "precision", "trainer", "tracker") for o in options(g)]
    # (cluster=slurm with a request that needs no partition's numbers: no SLURM here)
    + [("cluster", o, ["cluster.gpus_per_node=0", "cluster.cpus_per_task=1"] if o == "slurm" else []) for o in options("cluster")],
)
def test_every_option_composes(group, option, extra):
    cfg = compose_run(f"{group}={option}", *extra)
    section = getattr(cfg, group)
    field = {"model": None, "data": "source", "cluster": "kind", "tracker": "kind"}.get(group, "name")
    if option in ("resnet", "vit"):
        assert section.target == f"xtrain.tasks.image_cls.{option}"
        field = None
    if option == "custom" and group != "task":  # the user's own, by _target_
        assert getattr(section, "target", None) == "m.build" or section == TargetData({"_target_": "d.build"},
                                                                                      {"_target_": "d.build"})
        field = None
    if field:  # the option file selects the matching enum member
        assert option in ("default",) or getattr(section, field).value == option


def test_cross_field_rules_raise_config_error():
    with pytest.raises(ConfigError, match="model.hidden_size=100: must be divisible by model.num_heads=3"):
        compose_run("model.hidden_size=100", "model.num_heads=3")
    with pytest.raises(ConfigError, match="data.val_fraction=1.0"):
        compose_run("data.val_fraction=1.0")


def test_run_yaml_round_trips(tmp_path):
    cfg = compose_run("trainer.lr=0.01", "model=tiny_llama")
    path = tmp_path / "run.yaml"
    path.write_text(schema.to_yaml(cfg))
    assert schema.load(str(path)) == cfg


def test_cfg_job_does_not_import_torch():
    """Nor does what the suite's conftest imports before it sets torch's threads (a process's first import of torch
    reads OMP_NUM_THREADS: with 2 threads, in-process runs would not be bitwise those of the runs it starts)."""
    code = (
        "import sys; sys.argv = ['xtrain', '--cfg', 'job']; from xtrain.commands import cli\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "import xtrain.backends.registry, xtrain.config.schema\n"
        "heavy = [m for m in ('torch', 'transformers', 'accelerate', 'datasets') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "trainer:\n  batch_size: 16" in out
    assert "HEAVY []" in out


def test_help_lists_every_option_with_what_it_is_and_the_companion_commands():
    from xtrain.commands import help

    out = subprocess.run([sys.executable, "-m", "xtrain", "--help"], capture_output=True, text=True, check=True).stdout
    for group in cli.CONFIG_GROUPS:
        assert f"{group}:" in out
        for option, about in help.options(group).items():
            assert about and re.search(rf"^ +{option} +{re.escape(about)}$", out, re.M), (group, option)
    assert "tiny_gpt2, tiny_llama" in out and "base_" not in out and "schema" not in out
    for name in ("run_dir", "resume", "dry_run", "xtrain.prepare", "xtrain.status", "xtrain.env"):
        assert name in out
    assert "`none`, `auto` (newest checkpoint in run_dir" in out  # the schema's docstring, the one source


@pytest.mark.parametrize("command, expected", [
    (["xtrain", "--version"], "xtrain 0.1.0"),
    (["xtrain.prepare", "--help"], "usage: python -m xtrain.prepare"),
    (["xtrain.status", "--help"], "usage: python -m xtrain.status RUN_DIR_OR_SWEEP_DIR"),
    (["xtrain.env", "--help"], "usage: python -m xtrain.env"),
])
def test_companion_commands_answer_help_and_version(command, expected):
    proc = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith(expected) and proc.stderr == "", proc.stderr


NO_PARTITION = ["cluster=slurm", "cluster.gpus_per_node=0", "cluster.cpus_per_task=1"]  # (no SLURM needed)


@pytest.mark.parametrize("override, expected", [
    ("cluster.job_name='a\nb'", "cluster.job_name='a\\nb': holds a control character"),
    ("+cluster.sbatch_args.comment='a\nb'", "cluster.sbatch_args.comment='comment=a\\nb': holds a control character"),
    ("cluster.setup=['module load cuda\r']", "cluster.setup[0]='module load cuda\\r': holds a control character"),
    ("cluster.partition='gpu\t'", "cluster.partition='gpu\\t': holds a control character"),
])
def test_a_control_character_in_what_reaches_the_sbatch_script_is_refused(override, expected):
    with pytest.raises(ConfigError) as err:
        compose_run(*NO_PARTITION, override)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_min_nodes_is_a_slurm_setting_within_the_nodes_that_keeps_the_effective_batch():
    from xtrain.backends.elastic import on_nodes
    from xtrain.backends.slurm.submit import job_parameters

    cfg = compose_run(*NO_PARTITION, "cluster.nodes=4", "cluster.min_nodes=2", "trainer.grad_accum=2")
    assert job_parameters(cfg.cluster)["nodes"] == 4  # (fewer only when it requeues itself)
    assert on_nodes(cfg, 2).trainer.grad_accum == 4 and on_nodes(cfg, 4) is cfg
    with pytest.raises(ConfigError, match=r"cluster.min_nodes=2: the run trains with an effective batch of 128 .* "
                                          "3 processes cannot keep it .* divides 8"):
        on_nodes(cfg, 3)
    for overrides, expected in [(["cluster.nodes=2", "cluster.min_nodes=3"], "must be in [1, cluster.nodes=2]"),
                                (["cluster=local", "cluster.min_nodes=1"], "it is a setting of cluster=slurm|ray")]:
        line = refusal(*([] if "cluster=local" in overrides else NO_PARTITION), *overrides)
        assert line.startswith("cluster.min_nodes=") and expected in line, line


def test_a_ray_run_may_continue_on_min_nodes_to_nodes_each_keeping_the_effective_batch():
    from xtrain.backends.elastic import check_fewer, on_nodes

    cfg = compose_run("cluster=ray", "cluster.nodes=4", "cluster.min_nodes=2", "trainer.grad_accum=2")
    assert cfg.cluster.max_restarts == 10 and on_nodes(cfg, 2).trainer.grad_accum == 4
    check_fewer(compose_run("cluster=ray", "cluster.nodes=4", "cluster.min_nodes=2", "trainer.grad_accum=3"))  # (on 3: 4)
    with pytest.raises(ConfigError, match=r"cluster.min_nodes=2: the run trains with an effective batch .* 3 processes"):
        check_fewer(cfg)
    assert refusal("cluster=ray", "cluster.nodes=2", "cluster.min_nodes=3").startswith(
        "cluster.min_nodes=3: must be in [1, cluster.nodes=2]")
    assert refusal("cluster=ray", "cluster.max_restarts=-1") == "cluster.max_restarts=-1: must be >= 0"
    assert refusal("cluster=ray", "+cluster.resources.GPU=1") == ("cluster.resources.GPU=1: set by "
                                                                  "cluster.gpus_per_node; use that")
    assert refusal("cluster=ray", "+cluster.resources.special=0") == "cluster.resources.special=0.0: must be > 0"


def test_a_failure_crosses_a_process_boundary_whole():
    """What a Ray task (or any pickling hand-over) raises reaches its driver as raised: message and exit code."""
    import pickle

    from xtrain.core.errors import LaunchFailed, Stopped, SweepFailed

    for err in (LaunchFailed("rank 1 failed", 7), Stopped("stopped at step 3", 10), SweepFailed(["a", "b"], 1)):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.exit_code == err.exit_code


@pytest.mark.parametrize("override", ["cluster.partition=gpu", "cluster.time_limit=04:00:00", "cluster.wait=false",
                                      "cluster.mem_gb=64", "+cluster.sbatch_args.mail-type=END"])
def test_a_slurm_jobs_setting_given_to_a_local_run_is_refused(override):
    """cluster=slurm forgotten: the run would train on this machine (a login node, say) and ignore the setting."""
    owners = "cluster=slurm|ray; use one of those" if override == "cluster.wait=false" else "cluster=slurm; add cluster=slurm"
    assert refusal(override) == (f"{override.lstrip('+')}: no such setting with this cluster: it is a setting of "
                                 f"{owners}, or drop it")


def test_a_newline_in_an_sbatch_args_key_is_refused():
    """(Hydra's command line cannot spell one; a config file or the Python API can.)"""
    with pytest.raises(ConfigError, match="holds a control character"):
        schema.from_container({"cluster": {"kind": "slurm", "sbatch_args": {"mail-type\nx": "END"}}})


@pytest.mark.parametrize("override, name", [
    ("cluster.setup=['export HF_TOKEN=hf_abc']", "HF_TOKEN"),
    ("cluster.setup=['WANDB_API_KEY=x python -c pass']", "WANDB_API_KEY"),
    ("+cluster.sbatch_args.export='ALL,AWS_SECRET_ACCESS_KEY=x'", "AWS_SECRET_ACCESS_KEY"),
    ("cluster.srun_args=['--export=ALL,DB_PASSWORD=x']", "DB_PASSWORD"),
])
def test_a_secret_in_the_shell_strings_is_refused_without_repeating_it(override, name):
    with pytest.raises(ConfigError) as err:
        compose_run(*NO_PARTITION, override)
    text = str(err.value)
    assert f"{name}=... looks like a secret" in text and f"export {name} in the shell you submit from" in text
    assert "hf_abc" not in text and "=x" not in text


def test_ordinary_assignments_in_setup_lines_pass():
    cfg = compose_run(*NO_PARTITION, "cluster.setup=['export KEYRING_PATH=/x', 'export OMP_PROC_BIND=close']")
    assert cfg.cluster.setup == ["export KEYRING_PATH=/x", "export OMP_PROC_BIND=close"]


def test_tracker_hyperparameters_leave_out_the_cluster_shell_strings():
    from xtrain.engine import tracking

    cfg = compose_run(*NO_PARTITION, "cluster.setup=['source /secrets/env.sh']", "cluster.srun_args=['--mpi=pmix']",
                      "+cluster.sbatch_args.mail-user=me@example.com")
    params = tracking.hyperparameters(cfg)
    assert not [k for k in params if k.split("/")[-1] in ("setup", "srun_args", "sbatch_args") or "mail" in k]
    assert "source /secrets" not in str(params) and params["cluster/job_name"] == "xtrain"
