"""Bad input: one line naming the setting, the bad value and what would work; exit 2; nothing damaged."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from conftest import ZERO_ON_CPU, assert_one_line_error, compose_run, refusal, run_xtrain, xtrain_in_process
from xtrain.core import runlock


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with a hash of its content (but the run lock, which a test beside this one that runs
    a command on the same shared run holds for a moment)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file() and p.name != runlock.LOCK
    }


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["trainer.batch_size=0"], ["trainer.batch_size=0", "must be > 0"]),
        (["trainer.batch_size=-4"], ["trainer.batch_size=-4", "must be > 0"]),
        (["trainer.max_steps=0"], ["trainer.max_steps=0", "must be > 0"]),
        (["trainer.lr=-0.001"], ["trainer.lr=-0.001", "must be > 0"]),
        (["trainer.lr=nan"], ["trainer.lr=nan: must be a finite number > 0"]),
        (["trainer.lr=inf"], ["trainer.lr=inf: must be a finite number > 0"]),
        (["trainer.max_grad_norm=nan"], ["trainer.max_grad_norm=nan: must be a finite number >= 0"]),
        (["trainer.seed=${nope:1}"], ["trainer.seed=${nope:1}: Unsupported interpolation type nope"]),
        (["trainer.seed=${trainer.nothing}"], ["trainer.seed=${trainer.nothing}: Interpolation key 'trainer.nothing' "
                                               "not found"]),
        (["trainer.lr=fast"], ["trainer.lr=fast", "not a valid float"]),
        (["trainer.compile=maybe"], ["trainer.compile=maybe: not a valid bool; use true or false"]),
        (["precision.fp8_skip=self_attn"],
         ["precision.fp8_skip=self_attn: not a list; give one in brackets, e.g. precision.fp8_skip=[self_attn]"]),
        (["cluster=slurm", "cluster.sbatch_args=[mail-type]"],
         ["cluster.sbatch_args=[mail-type]: not a mapping; add its keys with a plus, e.g. +cluster.sbatch_args.KEY=VALUE"]),
        (["trainer.optimizer=sgd"], ["trainer.optimizer=sgd: not a mapping"]),
        (["trainer.bacth_size=8"], ["trainer.bacth_size=8", "no such setting", "did you mean trainer.batch_size?"]),
        (["resum=auto"], ["resum=auto", "no such setting", "did you mean resume?"]),
        (["model.arch=bert"], ["model.arch=bert", "expected one of [gpt2, llama]"]),
        (["data=text", "data.files=[/no/such/dir/*.txt]"], ["data.files", "/no/such/dir/*.txt", "matches no file"]),
        (["data=hf", "data.name=/no/such/dataset"], ["data.name=/no/such/dataset", "no such directory"]),
        (["data=hf", "data.name=docs"], ["data.name=docs: not a dataset directory", "save_to_disk"]),
        (["data=hf", "data.name=no-such-org/no-such-dataset"],
         ["data.name=no-such-org/no-such-dataset", "cannot be loaded", "save_to_disk directory"]),
        (["model=hf"], ["model.name_or_path", "needs a hub id or a local model directory"]),
        (["model=hf", "model.name_or_path=no-such-org/no-such-model"],
         ["model.name_or_path=no-such-org/no-such-model", "cannot be loaded", "local model directory"]),
        (["resume=/no/such/checkpoint"], ["resume=/no/such/checkpoint", "no such checkpoint", "resume=auto"]),
        (["strategy=zero2", "strategy.offload_optimizer=cpu", "trainer.fused_optimizer=true"],
         ["trainer.fused_optimizer=true", "DeepSpeedCPUAdam", "trainer.fused_optimizer=false"]),
        (["strategy=fsdp", "strategy.fsdp_version=1", "trainer.compile=true"],
         ["trainer.compile=true", "strategy.fsdp_version=1", "strategy.fsdp_version=2"]),
        (["trainer.monitor=val_accuracy"],
         ["trainer.monitor=val_accuracy: the task does not compute it; it computes val_loss, val_ppl"]),
        # a setting of another data source's: data.files without data=text trained on the default corpus
        (["data.files=[notes.txt]"], ["data.files=[notes.txt]: no such setting with this data source: it is a setting of "
                                      "data=text|sft|images; use one of those, or drop it"]),
        (["data=text", "data.files=[README.md]", "data.packing=false"],
         ["data.packing=false: no such setting with this data source: it is a setting of data=sft; add data=sft"]),
        (["data=text", "data.files=[README.md]", "data.split=validation"],
         ["data.split=validation: no such setting with this data source: it is a setting of data=hf|sft"]),
        # a pretrained model's setting with a model built from config, and the other way round; Llama's with GPT-2
        (["model.name_or_path=gpt2"], ["model.name_or_path=gpt2: a pretrained model's, and this run builds a gpt2 from "
                                       "config with random weights; use model=hf to load it, or drop it"]),
        (["model=hf", "model.name_or_path=org/model", "model.num_layers=2"],
         ["model.num_layers=2: a setting of a model built from config, and model=hf loads org/model with its own"]),
        (["model.num_kv_heads=2"], ["model.num_kv_heads=2: grouped-query attention is Llama's; use model=tiny_llama"]),
        (["precision=bf16", "precision.fp8_backend=torchao"],
         ["precision.fp8_backend=torchao: a setting of fp8, and this run has precision=bf16; add precision=fp8"]),
        (["tracker.project=mine"], ["tracker.project=mine: a setting of a tracker, and this run has tracker=none; add "
                                    "tracker=wandb or tracker=tensorboard, or drop it"]),
        (["tracker=tensorboard", "tracker.wandb_mode=offline"],
         ["tracker.wandb_mode=offline: a setting of W&B, and this run has tracker=tensorboard; add tracker=wandb"]),
        (["model.lora.rank=8"], ["model.lora.rank=8: a setting of LoRA, and this run trains every weight "
                                 "(model.lora.enabled=false); add model.lora.enabled=true, or drop it"]),
        (["precision=bf16", "precision.fp8_recipe=rowwise"],
         ["precision.fp8_recipe=rowwise: a setting of fp8 with torchao", "precision=bf16", "precision.fp8_backend=torchao"]),
        (["precision=fp8", "precision.fp8_backend=torchao", "strategy=fsdp", "model=hf", "model.name_or_path=org/model"],
         ["strategy.cpu_ram_efficient_loading=true", "fp8", "strategy.cpu_ram_efficient_loading=false"]),
        (["trainer.monitor=val_ppl", "trainer.monitor_direction=maximize"],
         ["trainer.monitor_direction=maximize: val_ppl is better when lower; use trainer.monitor_direction=minimize"]),
    ],
)
def test_bad_input_is_refused_in_one_line_naming_it(tmp_path, overrides, expected):
    run_dir = tmp_path / "run"
    line = refusal(f"run_dir={run_dir}", *overrides)
    assert "\n" not in line
    for text in expected:
        assert text in line, line
    assert not run_dir.exists()


@pytest.mark.parametrize("overrides,expected", [
    (["trainer.batch_size=0"], ["trainer.batch_size=0", "must be > 0"]),  # the typed config's
    (["trainer.bacth_size=8"], ["trainer.bacth_size=8", "no such setting", "did you mean trainer.batch_size?"]),  # Hydra's
    (["data=text", "data.files=[/no/such/dir/*.txt]"], ["data.files", "/no/such/dir/*.txt", "matches no file"]),  # preflight's
])
def test_bad_input_is_one_line_exit_2_and_creates_nothing(tmp_path, overrides, expected):
    """Each kind of check through the CLI: a value, a name, the world outside the config."""
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", *overrides, check=False)
    assert_one_line_error(proc, *expected)
    assert not run_dir.exists()


@pytest.mark.parametrize("overrides,expected", [
    (["precision=fp64"], "precision=fp64: no such option; did you mean precision=fp16? (options: bf16, fp16, fp32, fp8)"),
    # a typo of a preset is refused, not trained as the default model in fp32
    (["experiment=tiny_lama_bf16"],
     "experiment=tiny_lama_bf16: no such option; did you mean experiment=tiny_llama_bf16? (options: gpt2_deeper, "
     "tiny_llama_bf16)"),
    # the typed schemas are not options
    (["strategy=base_strategy"], "strategy=base_strategy: no such option; choose one of ddp, fsdp, zero1, zero2, zero3"),
    # a setting added with + that the schema does not have is refused, not composed and dropped
    (["+trainer.foo=1"], "trainer.foo=1: no such setting; python -m xtrain --cfg job lists every setting"),
    # the closest real setting: the group first, then an alias, a longer name, or the nearest spelling
    (["trainr.batch_size=8"], "trainr.batch_size=8: no such setting; did you mean trainer.batch_size?"),
    (["trainer.iterations=100"], "trainer.iterations=100: no such setting; did you mean trainer.max_steps?"),
    (["trainer.learning_rate=1e-3"], "trainer.learning_rate=1e-3: the HF Trainer's name for xtrain's trainer.lr; give "
                                     "trainer.lr=1e-3"),
    (["model.name=gpt2"], "model.name=gpt2: no such setting; did you mean model.name_or_path?"),
    (["trainer.warmup=10"], "trainer.warmup=10: no such setting; did you mean trainer.warmup_steps?"),
    # what the command line cannot mean: a setting without a value or a value without a setting, a flag Hydra lacks
    (["trainer.lr"], "trainer.lr: no value; give trainer.lr=VALUE (python -m xtrain --cfg job lists every setting and "
                     "its value)"),
    (["=3e-4"], "=3e-4: no setting's name before '='; give KEY=VALUE, e.g. trainer.lr=3e-4"),
    (["--multi-run"], "unrecognized arguments: --multi-run; python -m xtrain --help lists the options"),
    (["-m", "--cfg", "hydra"], "-m with --cfg: Hydra prints one composed config, not a sweep's; drop -m (a sweep's "
                               "points, checked and planned: -m ... dry_run=true)"),
    (["-m", "trainer.batch_size=range(16,8)"], "trainer.batch_size=range(16,8): the range holds no value (range(start, "
                                               "stop, step) counts from start up to stop, without it); a sweep of "
                                               "nothing runs nothing"),
])
def test_a_mistake_is_refused_with_the_closest_real_option(tmp_path, overrides, expected):
    run_dir = tmp_path / "run"
    line = assert_one_line_error(xtrain_in_process(f"run_dir={run_dir}", *overrides, check=False), expected)
    assert line == f"xtrain: error: {expected}"
    assert not run_dir.exists()


@pytest.mark.parametrize("overrides,fix,kept", [
    (["cluster=ray", "cluster.resources={a: 1, b: 2}"], ["+cluster.resources.a=1", "+cluster.resources.b=2"],
     {"cluster.resources": {"a": 1.0, "b": 2.0}}),
    (["cluster=ray", "cluster.resources.a=1"], ["+cluster.resources.a=1"], {"cluster.resources": {"a": 1.0}}),
    (["cluster=slurm", "cluster.sbatch_args={mail-type: END}"], ["+cluster.sbatch_args.mail-type=END"],
     {"cluster.sbatch_args": {"mail-type": "END"}}),
    (["trainer.optimizer._target_=torch.optim.SGD", "trainer.optimizer.momentum=0.9"], ["+trainer.optimizer.momentum=0.9"],
     {"trainer.optimizer": {"_target_": "torch.optim.SGD", "momentum": 0.9}}),
    (["trainer.optimizer={_target_: torch.optim.SGD, momentum: 0.9}"],
     ["trainer.optimizer._target_=torch.optim.SGD", "+trainer.optimizer.momentum=0.9"],
     {"trainer.optimizer": {"_target_": "torch.optim.SGD", "momentum": 0.9}}),
])
def test_a_new_key_of_a_mapping_without_a_plus_is_refused_with_the_overrides_that_set_it(overrides, fix, kept):
    """A mapping that takes keys of the user's own (cluster.resources, cluster.sbatch_args, trainer.optimizer), given
    a new key without `+` (or whole, in braces): one line naming it and the overrides that set it, which do."""
    [(mapping, values)] = kept.items()
    assert refusal(*overrides) == (f"{overrides[-1]}: {mapping} takes keys of your own, each added with a plus: "
                                   f"{' '.join(fix)}")
    group, field = mapping.split(".")
    assert dict(getattr(getattr(compose_run(*overrides[:-1], *fix, resolve=False), group), field)) == values


def test_resume_pointing_at_a_non_checkpoint(tmp_path):
    proc = xtrain_in_process(f"run_dir={tmp_path / 'run'}", f"resume={tmp_path}", check=False)
    assert_one_line_error(proc, f"resume={tmp_path}", "not an xtrain checkpoint")


def test_existing_run_is_neither_restarted_nor_damaged(short_run):
    before = snapshot(short_run)
    proc = xtrain_in_process(f"run_dir={short_run}", check=False)
    assert_one_line_error(proc, f"run_dir={short_run}", "already holds a run", "resume=auto")
    assert snapshot(short_run) == before


def test_resume_from_a_checkpoint_of_another_model(short_run, tmp_path):
    before = snapshot(short_run)
    checkpoint = sorted((short_run / "checkpoints").iterdir())[-1]
    proc = xtrain_in_process(f"run_dir={tmp_path / 'other'}", "model.hidden_size=64", f"resume={checkpoint}", check=False)
    assert_one_line_error(proc, f"resume={checkpoint}", "another model", "hidden_size: checkpoint 128 vs run 64")
    proc = xtrain_in_process(f"run_dir={short_run}", "model=tiny_llama", "resume=auto", check=False)
    assert_one_line_error(proc, "resume=auto", "another model", "arch: checkpoint 'gpt2' vs run 'llama'")
    assert snapshot(short_run) == before
    assert not (tmp_path / "other").exists()


def test_a_zero_run_refuses_a_checkpoint_it_cannot_read_in_one_line(short_run, tmp_path):
    """A checkpoint moves to DDP and FSDP at any world (test_moves.py); a ZeRO run reads only its own stage's at the
    world that wrote it: refused before anything starts, saying what would work."""
    checkpoint = sorted((short_run / "checkpoints").iterdir())[-1]
    before = snapshot(short_run)
    proc = xtrain_in_process(f"run_dir={tmp_path / 'run'}", "strategy=zero2", f"resume={checkpoint}",
                             "trainer.max_steps=20", check=False, env=ZERO_ON_CPU)
    assert_one_line_error(proc, f"resume={checkpoint}", "written with strategy=ddp on 1 process(es) cannot continue "
                          "under strategy=zero2 on 1", "resume with strategy=ddp or strategy=fsdp")
    assert snapshot(short_run) == before and not (tmp_path / "run").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="fp16 is refused only where there is no CUDA GPU")
def test_fp16_without_gpu_is_refused_not_silently_fp32(tmp_path):
    proc = xtrain_in_process(f"run_dir={tmp_path / 'run'}", "precision=fp16", check=False)
    assert_one_line_error(proc, "precision=fp16", "needs a CUDA GPU", "precision=bf16")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="refused only where there is no CUDA GPU")
@pytest.mark.parametrize("overrides,expected", [
    (["strategy=fsdp"], ["strategy=fsdp: FSDP needs CUDA GPUs", "silently train plain DDP", "use strategy=ddp"]),
    (["strategy=zero2"], ["strategy=zero2: DeepSpeed ZeRO needs CUDA GPUs", "use strategy=ddp", "dry_run=true"]),
    (["strategy=zero3", "precision=bf16"], ["strategy=zero3", "use strategy=ddp"]),
    (["precision=fp8"], ["precision=fp8: needs a GPU with FP8 units", "use precision=bf16"]),
])
def test_strategies_the_cpu_cannot_run_are_refused_before_launch(tmp_path, overrides, expected):
    proc = xtrain_in_process(f"run_dir={tmp_path / 'run'}", *overrides, check=False)
    assert_one_line_error(proc, *expected)
    assert not (tmp_path / "run").exists()


def test_several_nodes_need_a_rendezvous_port(tmp_path):
    proc = xtrain_in_process(f"run_dir={tmp_path / 'run'}", "cluster.nodes=2", check=False)
    assert_one_line_error(proc, "cluster.main_process_port is empty", "cluster.nodes=2",
                          "cluster.main_process_port=29500")
    assert not (tmp_path / "run").exists()


def test_a_refusal_from_the_command_line_is_one_line_exit_2_and_creates_nothing(tmp_path):
    """The contract as a user meets it, in a process of its own (the cases above run the same CLI in-process)."""
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", "trainer.bacth_size=8", check=False, own_process=True)
    assert_one_line_error(proc, "trainer.bacth_size=8", "no such setting", "did you mean trainer.batch_size?")
    assert not run_dir.exists()
