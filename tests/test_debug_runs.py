"""`trainer.max_epochs` (worked out as steps once the data is known, recorded in run.yaml) and the debug runs a
Lightning or lightning-hydra-template user reaches for: `debug=fdr|overfit|limit`, `trainer.limit_train_batches`,
`limit_val_batches` and `overfit_batches`."""

from __future__ import annotations

import pytest
import yaml

from conftest import SMALL, assert_one_line_error, read_metrics, read_result, xtrain_in_process

FEW = ["trainer.batch_size=4", "trainer.log_every=1", "trainer.eval_every=100", "trainer.save_every=100", *SMALL]


def test_max_epochs_become_the_steps_of_that_many_epochs_and_run_yaml_says_so(tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", "trainer.max_epochs=2", "trainer.limit_train_batches=3", *FEW)
    result = read_result(run_dir)
    assert (result["steps_per_epoch"], result["max_steps"], result["steps"]) == (3, 6, 6)
    assert result["examples"]["train"] == 12  # 3 micro-batches of 4
    assert "trainer.max_epochs=2: 6 steps (3 an epoch)" in proc.stdout
    text = (run_dir / "run.yaml").read_text()
    assert text.splitlines()[0] == "# max_epochs=2: 6 steps (3 an epoch: 12 training blocks, 4 a step), warmup 0"
    trainer = yaml.safe_load(text)["trainer"]
    assert (trainer["max_epochs"], trainer["max_steps"], trainer["warmup_steps"]) == (2, None, None)
    epochs = {r["step"]: r["epoch"] for r in read_metrics(run_dir) if "epoch" in r}
    assert (epochs[3], epochs[6]) == (1.0, 2.0)


def test_max_epochs_raised_on_resume_trains_on_to_the_new_total(tmp_path):
    run_dir = tmp_path / "run"
    xtrain_in_process(f"run_dir={run_dir}", "trainer.max_epochs=1", "trainer.limit_train_batches=3", *FEW)
    proc = xtrain_in_process(f"run_dir={run_dir}", "trainer.max_epochs=2", "trainer.limit_train_batches=3", *FEW,
                             "resume=auto", "resume_changes=apply")
    assert "resumed from" in proc.stdout and read_result(run_dir)["steps"] == 6
    assert (run_dir / "run.yaml").read_text().startswith("# max_epochs=2: 6 steps")


@pytest.mark.parametrize("overrides,line", [
    (["trainer.max_epochs=2", "trainer.max_steps=10"],
     "trainer.max_steps=10 with trainer.max_epochs=2: give one (max_epochs works out the steps from the data)"),
    (["trainer.max_epochs=0"], "trainer.max_epochs=0: must be > 0"),
    (["trainer.overfit_batches=1", "trainer.limit_train_batches=2"],
     "trainer.overfit_batches=1 with trainer.limit_train_batches=2: give one"),
    (["trainer.limit_val_batches=-1"], "trainer.limit_val_batches=-1: must be >= 0"),
    (["trainer.num_train_epochs=3"], "trainer.num_train_epochs=3: the HF Trainer's name for xtrain's trainer.max_epochs; "
                                     "give trainer.max_epochs=3"),
    (["trainer.fast_dev_run=true"], "trainer.fast_dev_run=true: Lightning's name for xtrain's debug; give debug=fdr"),
    (["debug=fdx"], "debug=fdx: no such option; did you mean debug=fdr? (options: fdr, limit, overfit)"),
])
def test_a_bad_length_or_debug_setting_is_one_line(tmp_path, overrides, line):
    run_dir = tmp_path / "run"
    assert_one_line_error(xtrain_in_process(f"run_dir={run_dir}", *overrides, check=False), line)
    assert not run_dir.exists()


def test_an_epoch_shorter_than_a_step_is_refused_when_the_data_is_known(tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", "trainer.max_epochs=1", "trainer.limit_train_batches=1", *FEW,
                             "trainer.grad_accum=2", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "xtrain: error: trainer.max_epochs=1: an epoch of the 4 training blocks is less than one step of 8")


def test_debug_fdr_runs_every_part_once_on_a_few_batches(tmp_path):
    run_dir = tmp_path / "run"
    xtrain_in_process(f"run_dir={run_dir}", "debug=fdr", *SMALL)
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["steps"] == 4
    assert result["examples"] == {"train": 4 * 16, "val": 2 * 16}  # the default batch of 16
    assert [r["step"] for r in read_metrics(run_dir) if "val/loss" in r] == [0, 2, 4]
    assert (run_dir / "checkpoints" / "step_00000004").is_dir() and (run_dir / "model").is_dir()


def test_overfitting_one_batch_drives_its_loss_down_and_evaluates_on_it(tmp_path):
    run_dir = tmp_path / "run"
    xtrain_in_process(f"run_dir={run_dir}", "trainer.overfit_batches=1", "trainer.max_steps=60", "trainer.warmup_steps=0",
                      "trainer.lr=5e-3", "trainer.eval_every=60", *FEW[:2], "trainer.save_every=60")
    result, rows = read_result(run_dir), read_metrics(run_dir)
    assert result["examples"] == {"train": 4, "val": 4}
    evals = [r["val/loss"] for r in rows if "val/loss" in r]
    assert evals[-1] < 0.4 * evals[0]
    last_train = [r["train/loss"] for r in rows if "train/loss" in r][-1]
    assert evals[-1] == pytest.approx(last_train, rel=0.25)  # (the same batch: eval right after the last step)
