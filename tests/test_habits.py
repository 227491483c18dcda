"""What a Lightning, lightning-hydra-template or HF Trainer user types on their first day: each name of theirs is
refused in one line naming xtrain's setting and the override that does what they meant."""

from __future__ import annotations

import pytest

from conftest import assert_one_line_error, xtrain_in_process
from xtrain.config import habits, schema


def test_every_name_in_the_table_maps_to_a_setting_or_an_option_that_exists():
    settings = schema.setting_index()
    for name, habit in habits.HABITS.items():
        assert name not in settings, name  # (a name xtrain has is never refused)
        if habits.choices(habit.setting):  # a config group: its values are its options
            assert set(habit.values.values()) <= set(habits.choices(habit.setting)), name
        else:
            assert habit.setting in settings or not habit.setting, name


@pytest.mark.parametrize("given,line", [
    ("seed=7", "seed=7: lightning-hydra-template's name for xtrain's trainer.seed; give trainer.seed=7"),
    ("trainer.gradient_clip_val=0.5", "trainer.gradient_clip_val=0.5: Lightning's name for xtrain's "
                                      "trainer.max_grad_norm; give trainer.max_grad_norm=0.5"),
    ("trainer.accumulate_grad_batches=4", "trainer.accumulate_grad_batches=4: Lightning's name for xtrain's "
                                          "trainer.grad_accum; give trainer.grad_accum=4"),
    ("trainer.precision=16-mixed", "trainer.precision=16-mixed: Lightning's name for xtrain's precision; give "
                                   "precision=fp16"),
    ("trainer.precision=64", "trainer.precision=64: Lightning's name for xtrain's precision; give "
                             "precision=bf16|fp16|fp32|fp8"),
    ("trainer.devices=2", "trainer.devices=2: Lightning's name for xtrain's cluster.num_processes; give "
                          "cluster.num_processes=2 (processes on each node)"),
    ("trainer.strategy=deepspeed_stage_3", "trainer.strategy=deepspeed_stage_3: Lightning's name for xtrain's strategy; "
                                           "give strategy=zero3"),
    ("logger=tensorboard", "logger=tensorboard: lightning-hydra-template's name for xtrain's tracker; give "
                           "tracker=tensorboard (metrics.jsonl is written whatever the tracker)"),
    ("ckpt_path=last", "ckpt_path=last: lightning-hydra-template's name for xtrain's resume; give resume=auto (a "
                       "checkpoint dir, or auto: the run dir's newest)"),
    ("data.batch_size=64", "data.batch_size=64: lightning-hydra-template's name for xtrain's trainer.batch_size; give "
                           "trainer.batch_size=64 (per process, before trainer.grad_accum)"),
    ("trainer.accelerator=gpu", "trainer.accelerator=gpu: Lightning's setting; xtrain trains on the GPUs it finds, and "
                                "on the CPU where there are none: drop it"),
    ("bf16=true", "bf16=true: the HF Trainer's name for xtrain's precision; give precision=bf16"),
    ("bf16=false", "bf16=false: the HF Trainer's name for xtrain's precision; drop it (xtrain's default is "
                   "precision=fp32)"),
    ("per_device_train_batch_size=8", "per_device_train_batch_size=8: the HF Trainer's name for xtrain's "
                                      "trainer.batch_size; give trainer.batch_size=8"),
    ("trainer.fast_dev_run=1", "trainer.fast_dev_run=1: Lightning's name for xtrain's debug; give debug=fdr (a few "
                               "steps on a few batches, evals and a checkpoint included)"),
    ("trainer.min_epochs=1", "trainer.min_epochs=1: Lightning's setting; xtrain trains trainer.max_epochs or "
                             "trainer.max_steps, with no minimum before trainer.early_stop_patience may stop it: drop it"),
    ("num_train_epochs=3", "num_train_epochs=3: the HF Trainer's name for xtrain's trainer.max_epochs; give "
                           "trainer.max_epochs=3"),
    ("trainer.save_total_limit=2", "trainer.save_total_limit=2: the HF Trainer's name for xtrain's "
                                   "trainer.keep_checkpoints; give trainer.keep_checkpoints=2"),
])
def test_another_tools_name_is_refused_naming_xtrains(given, line):
    name, _, value = given.partition("=")
    assert habits.refusal(name, value) == line


def test_the_command_line_refuses_them_in_one_line_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", "trainer.gradient_clip_val=1.0", check=False)
    assert_one_line_error(proc, "trainer.gradient_clip_val=1.0: Lightning's name for xtrain's trainer.max_grad_norm")
    assert not run_dir.exists()


@pytest.mark.parametrize("given,recorded", [("val/acc", "val_accuracy"), ("val/loss", "val_loss"),
                                             ("val/f1", "val_f1"), ("val_loss", "val_loss"), ("a/b/c", "a/b/c")])
def test_a_monitor_in_lightnings_slash_form_is_xtrains_name(given, recorded):
    from xtrain.config.trainer import TrainerConfig

    assert TrainerConfig(monitor=given).monitor == recorded


@pytest.mark.parametrize("overrides,line", [
    (["task=custom", "data.block_size=64"], "data.block_size=64: no such setting with this data source: it is a setting "
                                            "of data=pydoc|text|hf|sft|images; use one of those, or drop it"),
    (["task=custom", "model.num_layers=2"], "model.num_layers=2: no such setting with this model: it is a setting of "
                                            "model=hf|tiny_gpt2|tiny_llama; use one of those, or drop it"),
])
def test_a_setting_of_another_option_names_the_options_that_have_it(tmp_path, overrides, line):
    proc = xtrain_in_process(f"run_dir={tmp_path / 'run'}", "dry_run=true", *overrides, check=False)
    assert assert_one_line_error(proc, line) == f"xtrain: error: {line}"
