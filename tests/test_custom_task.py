"""task=custom: a user's own model, datasets, loss and metrics by `_target_`, from the user's own modules (the
examples/digits project, copied outside the package, the command run from there)."""

from __future__ import annotations

import json
import shutil
import signal
import time

import pytest
import torch

from conftest import (FSDP_ON_CPU, REPO, ZERO_ON_CPU, assert_equal_weights, assert_one_line_error, read_metrics,
                      read_result, run_xtrain, start_xtrain)

SPELLED = ["task=custom", "model._target_=mymodels.cnn", "+model.channels=16", "data.train._target_=mydata.digits",
           "+data.train.split=train", "data.val._target_=mydata.digits", "+data.val.split=val",
           "task.metrics=[accuracy,f1_macro]"]
# as conf/experiment/digits.yaml sets them
TRAINER = ["trainer.batch_size=32", "trainer.max_steps=200", "trainer.warmup_steps=10", "trainer.lr=3e-3",
           "trainer.eval_every=50", "trainer.save_every=50", "trainer.log_every=25"]


# A model whose repeated block FSDP2 finds only as the children of its nn.ModuleList (no _no_split_modules)
BLOCKS = """import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, width=64, depth=2, num_classes=10):
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)

    def forward(self, images):
        x = self.embed(images.flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.head(x)
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The example project, outside the package: its modules import only from there."""
    where = tmp_path_factory.mktemp("project") / "digits"
    shutil.copytree(REPO / "examples" / "digits", where, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    (where / "badsets.py").write_text(
        "import torch\n\n\ndef triples(split='train'):\n    return [(torch.zeros(1, 8, 8), 0, 1)] * 8\n\n\n"
        "def records(split='train'):\n    return [{'image': torch.zeros(1, 8, 8)}] * 8\n\n\n"
        "def not_a_model(channels=16):\n    return {'channels': channels}\n")
    (where / "blocks.py").write_text(BLOCKS)
    return where


@pytest.fixture(scope="module")
def digits_run(project, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("digits") / "run"
    run_xtrain(f"run_dir={run_dir}", *SPELLED, *TRAINER, cwd=project)
    return run_dir


def test_a_cnn_from_the_users_own_modules_learns_digits(digits_run, project):
    result = read_result(digits_run)
    assert result["status"] == "completed" and result["val_accuracy"] >= 0.9
    assert result["best_val_accuracy"] >= result["val_accuracy"] and "best_val_f1_macro" in result
    assert result["examples_per_s"] > 0 and "tokens_per_s" not in result and "val_ppl" not in result
    evals = [row for row in read_metrics(digits_run) if "val/loss" in row]
    assert [row["step"] for row in evals] == [0, 50, 100, 150, 200]
    assert all(0 <= row["val/accuracy"] <= 1 and 0 <= row["val/f1_macro"] <= 1 for row in evals)
    assert evals[0]["val/accuracy"] < 0.5  # step 0 is the untrained model
    assert all("train/examples_per_s" in row for row in read_metrics(digits_run) if "train/loss" in row)
    import yaml

    recorded = yaml.safe_load((digits_run / "run.yaml").read_text())
    assert recorded["model"] == {"_target_": "mymodels.cnn", "channels": 16}
    assert recorded["data"]["val"] == {"_target_": "mydata.digits", "split": "val"}
    assert recorded["task"]["code_dir"] == str(project)


def test_the_experiment_in_the_users_config_dir_is_the_same_run(digits_run, project, tmp_path):
    run_dir = tmp_path / "run"
    run_xtrain("--config-dir", "conf", "experiment=digits", f"run_dir={run_dir}", cwd=project)
    assert_equal_weights(digits_run, run_dir)


def test_load_model_returns_the_trained_module_whose_accuracy_the_run_recorded(digits_run, project, tmp_path):
    import xtrain

    model = xtrain.load_model(digits_run)
    assert isinstance(model, torch.nn.Module)
    from mydata import Digits  # (importable: load_model put the project's directory on the path)

    val = Digits("val")
    with torch.no_grad():
        predicted = model(val.images).argmax(dim=1)
    assert (predicted == val.labels).double().mean().item() == pytest.approx(read_result(digits_run)["val_accuracy"],
                                                                              abs=1e-12)
    # `python -m xtrain.export`: the last checkpoint as safetensors and the model's node, loadable the same way
    from xtrain.commands.export import main

    main([str(digits_run), f"out={tmp_path / 'exported'}"])
    exported = xtrain.load_model(tmp_path / "exported")
    with torch.no_grad():
        assert torch.equal(exported(val.images), model(val.images))


def test_a_custom_run_killed_and_resumed_ends_bitwise_equal_with_its_best_values(digits_run, project, tmp_path):
    run_dir = tmp_path / "run"
    # checkpoints every 10 steps (when they are written does not change what trains): killed at once after the
    # first is recorded, with ~190 steps to go (waiting longer, a fast machine can finish the 200 steps first)
    proc = start_xtrain(f"run_dir={run_dir}", *SPELLED, *TRAINER, "trainer.save_every=10", quiet=True, cwd=project)
    deadline = time.monotonic() + 300
    while (json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}).get(
            "checkpoint_step") != 10:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    killed = read_result(run_dir)
    assert killed["status"] == "running"  # killed mid-run: nothing recorded an end
    # (written behind training, the checkpoint is recorded as published a few steps on: those steps are lost)
    assert killed["checkpoint_step"] == 10 and 10 <= killed["steps"] < 200 and 0 < killed["epoch"] < 1
    from xtrain.commands import status

    text = status.run_status(run_dir)
    assert text.startswith(f"run {run_dir}: lost, step ")  # its process is gone
    assert (f"  resume           from its checkpoint of step 10: run the same command with run_dir={run_dir} "
            "resume=auto") in text.splitlines()
    run_xtrain(f"run_dir={run_dir}", *SPELLED, *TRAINER, "resume=auto", cwd=project)
    assert_equal_weights(digits_run, run_dir)
    resumed, unbroken = read_result(run_dir), read_result(digits_run)
    for key in ("val_accuracy", "best_val_accuracy", "best_val_f1_macro", "best_val_loss"):
        assert resumed[key] == unbroken[key], key


def test_two_processes_give_the_one_process_metrics_exactly(digits_run, project, tmp_path):
    """297 val examples, 2 ranks x batch 16: the sampler pads the last batch; the gathered metrics drop the pad.
    (The val loss to float32's rounding: on some CPUs a batch of 16 and one of 32 round a logit differently.)"""
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", *SPELLED, *TRAINER, "trainer.batch_size=16", "cluster.num_processes=2",
               cwd=project)
    one, two = read_metrics(digits_run), read_metrics(run_dir)
    assert read_result(run_dir)["world_size"] == 2
    first_one, first_two = one[0], two[0]  # step 0: the same initial weights
    assert first_one["step"] == first_two["step"] == 0
    assert first_two["val/accuracy"] == first_one["val/accuracy"]
    assert first_two["val/f1_macro"] == first_one["val/f1_macro"]
    assert first_two["val/loss"] == pytest.approx(first_one["val/loss"], rel=1e-6)
    from safetensors.torch import load_file

    expected, got = load_file(digits_run / "model" / "model.safetensors"), load_file(run_dir / "model" / "model.safetensors")
    for name in expected:  # the same effective batch: DDP follows one process up to rounding
        torch.testing.assert_close(got[name], expected[name], rtol=1e-3, atol=1e-4)


def test_built_in_metrics_equal_scikit_learns():
    from sklearn import metrics as sk

    from xtrain.tasks import metrics

    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 5, (300,), generator=g)
    preds = torch.where(torch.rand(300, generator=g) < 0.6, targets, torch.randint(0, 6, (300,), generator=g))
    y, p = targets.numpy(), preds.numpy()
    assert metrics.accuracy(preds, targets) == pytest.approx(sk.accuracy_score(y, p), abs=1e-12)
    assert metrics.f1_macro(preds, targets) == pytest.approx(sk.f1_score(y, p, average="macro", zero_division=0),
                                                             abs=1e-12)
    assert metrics.precision_macro(preds, targets) == pytest.approx(
        sk.precision_score(y, p, average="macro", zero_division=0), abs=1e-12)
    assert metrics.recall_macro(preds, targets) == pytest.approx(
        sk.recall_score(y, p, average="macro", zero_division=0), abs=1e-12)
    values, truth = torch.randn(100, generator=g), torch.randn(100, generator=g)
    assert metrics.mse(values, truth) == pytest.approx(sk.mean_squared_error(truth.numpy(), values.numpy()), rel=1e-6)
    assert metrics.mae(values, truth) == pytest.approx(sk.mean_absolute_error(truth.numpy(), values.numpy()), rel=1e-6)


def test_a_torchmetrics_metric_and_a_plain_function_give_the_built_in_value():
    from xtrain.tasks import metrics

    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, 4, (257,), generator=g)
    preds = torch.where(torch.rand(257, generator=g) < 0.7, targets, torch.randint(0, 4, (257,), generator=g))
    built = metrics.build([
        "f1_macro",
        {"_target_": "torchmetrics.classification.MulticlassF1Score", "num_classes": 4, "average": "macro",
         "name": "tm_f1"},
        {"_target_": "sklearn.metrics.f1_score", "average": "macro", "name": "sk_f1"},
    ])
    values = {m.name: m.compute(preds, targets) for m in built}
    assert values["tm_f1"] == pytest.approx(values["f1_macro"], abs=1e-6)
    assert values["sk_f1"] == pytest.approx(values["f1_macro"], abs=1e-12)


@pytest.mark.parametrize("overrides,expected", [
    (["model._target_=mymodels.nope"], "model._target_=mymodels.nope: module mymodels has no nope"),
    (["model._target_=nosuchmodule.cnn"],
     "model._target_=nosuchmodule.cnn: cannot import: ModuleNotFoundError: No module named 'nosuchmodule'"),
    (["model._target_=badsets.not_a_model"], "model._target_=badsets.not_a_model: returned a dict, not a torch.nn.Module"),
    (["data.train._target_=badsets.triples"],
     "data.train: an item is a tuple of 3; give (inputs, target) tuples or dicts of tensors with a target"),
    (["data.train._target_=badsets.records"],
     "data.train: an item is a dict with keys image: it needs its target under one of target, label, labels"),
    (["task.metrics=[accuracy,auc]"],
     "task.metrics: no built-in metric auc; choose from accuracy, f1_macro, precision_macro, recall_macro, mse, mae"),
    (["trainer.monitor=val_auc"],
     "trainer.monitor=val_auc: the task does not compute it; it computes val_loss, val_accuracy, val_f1_macro"),
    (["trainer.monitor=val_accuracy", "trainer.monitor_direction=minimize"],
     "trainer.monitor_direction=minimize: val_accuracy is better when higher; use trainer.monitor_direction=maximize "
     "(or auto)"),
    (["task.metrics=[{_target_:sklearn.metrics.f1_score,average:macro,name:skf1}]", "trainer.monitor=val_skf1"],
     "trainer.monitor_direction=auto: whether a higher val_skf1 is better is not known; set "
     "trainer.monitor_direction=maximize or minimize"),
])
def test_a_bad_custom_piece_is_one_line_and_writes_nothing(project, tmp_path, overrides, expected):
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", *SPELLED, *overrides, check=False, cwd=project)
    assert_one_line_error(proc, expected)
    assert not run_dir.exists()


def test_a_model_by_target_without_task_custom_says_to_add_it(project, tmp_path):
    proc = run_xtrain(f"run_dir={tmp_path / 'run'}", "model=custom", "model._target_=mymodels.cnn", check=False,
                      cwd=project)
    assert_one_line_error(proc, "model._target_=mymodels.cnn: a model by _target_ is trained by task=custom; "
                                "add task=custom")


STUDY = ["hydra/sweeper=xtrain_optuna", "hydra.sweeper.objective=val_accuracy", "trainer.max_steps=40",
         "trainer.eval_every=10", "trainer.warmup_steps=2", "trainer.save_every=40", "trainer.batch_size=32",
         "trainer.lr=tag(log,interval(1e-4,1e-1))"]


def test_a_study_maximises_a_metric_and_its_summary_ranks_by_it(project, tmp_path):
    """Each trial is told what the model it kept scored (export=best: its best eval's), and reports its evals at the
    steps of the space's smallest batch that see as many examples: trials of batch 32 report step 10 as step 20."""
    import csv

    import optuna

    from xtrain.engine import study_settings

    sweep_dir = tmp_path / "study"
    run_xtrain("-m", f"run_dir={sweep_dir}", *SPELLED, *STUDY, "hydra.sweeper.direction=maximize",
               "hydra.sweeper.n_trials=4", "hydra.sweeper.pruner_settings.n_startup_trials=2", "hydra.sweeper.seed=1",
               "trainer.batch_size=choice(16,32)", "trainer.monitor=val_accuracy", "trainer.export=best", cwd=project)
    rows = list(csv.DictReader((sweep_dir / "sweep.csv").open()))
    done = [r for r in rows if r["status"] == "completed"]
    assert len(rows) == 4 and done and all(r["val_accuracy"] for r in done)
    top = max(done, key=lambda r: float(r["model_val_accuracy"]))
    assert f"Best (highest val_accuracy): **{top['point']}**" in (sweep_dir / "summary.md").read_text()
    trials = optuna.load_study(study_name=sweep_dir.name, storage=study_settings.open_storage(
        str(sweep_dir / study_settings.JOURNAL))).trials
    batches = set()
    for row in rows:
        trial, result = trials[int(row["point"].split("_")[0])], read_result(sweep_dir / row["point"])
        batch = int(row["trainer.batch_size"])
        batches.add(batch)
        evaluated = [r["step"] for r in read_metrics(sweep_dir / row["point"]) if "val/accuracy" in r and r["step"]]
        assert sorted(trial.intermediate_values) == [step * batch // 16 for step in evaluated]
        if trial.state.name == "COMPLETE":
            assert trial.value == result["model_eval"]["val_accuracy"] == result["best_val_accuracy"]
    assert batches == {16, 32}


@pytest.mark.parametrize("settings,expected", [
    (["hydra.sweeper.direction=minimize"],
     "hydra.sweeper.direction=minimize: val_accuracy is better when higher; use hydra.sweeper.direction=maximize"),
    (["hydra.sweeper.direction=maximize", "hydra.sweeper.objective=val_auc"],
     "hydra.sweeper.objective=val_auc: the task does not compute it; it computes val_loss, val_accuracy, val_f1_macro"),
])
def test_a_study_objective_that_cannot_be_met_is_refused(project, tmp_path, settings, expected):
    proc = run_xtrain("-m", f"run_dir={tmp_path / 'study'}", *SPELLED, *STUDY, *settings, check=False, cwd=project)
    assert_one_line_error(proc, expected)
    assert not (tmp_path / "study").exists()


POINTS = ("0_early_stop_patience=0", "1_early_stop_patience=1")
MONITORED = ["trainer.monitor=val_accuracy", "trainer.export=best", "trainer.eval_every=20"]


@pytest.fixture(scope="module")
def monitored_sweep(project, tmp_path_factory):
    """Two points watching val accuracy, their models the best eval's: one stops after an eval without improving."""
    sweep_dir = tmp_path_factory.mktemp("monitored") / "sweep"
    run_xtrain("-m", f"run_dir={sweep_dir}", *SPELLED, *TRAINER, *MONITORED, "trainer.early_stop_patience=0,1",
               cwd=project)
    return sweep_dir


def test_export_best_holds_the_model_of_the_best_eval_and_an_early_stop_ends_at_a_step_boundary(monitored_sweep):
    import xtrain
    from mydata import Digits

    val = Digits("val")
    for point in POINTS:
        result = read_result(monitored_sweep / point)
        assert result["status"] == "completed"
        accuracies = {row["step"]: row["val/accuracy"] for row in read_metrics(monitored_sweep / point)
                      if "val/accuracy" in row}
        best_step = max(accuracies, key=lambda step: (accuracies[step], -step))  # the first eval of the highest
        assert result["monitor"]["best_step"] == result["model_step"] == best_step
        assert result["monitor"]["best"] == accuracies[best_step] == result["best_val_accuracy"]
        with torch.no_grad():
            predicted = xtrain.load_model(monitored_sweep / point)(val.images).argmax(dim=1)
        assert (predicted == val.labels).double().mean().item() == accuracies[best_step]
    unbroken, stopped = (read_result(monitored_sweep / point) for point in POINTS)
    assert unbroken["steps"] == 200 and "early_stop" not in unbroken
    stop_step = stopped["early_stop"]["step"]
    assert stopped["steps"] == stop_step < 200 and stop_step % 20 == 0
    assert stopped["early_stop"] == {"step": stop_step, "patience": 1, "best_step": stop_step - 20}
    steps = [row["step"] for row in read_metrics(monitored_sweep / POINTS[1]) if "val/accuracy" in row]
    assert steps[-1] == stop_step and max(row["step"] for row in read_metrics(monitored_sweep / POINTS[1])) == stop_step
    assert (monitored_sweep / POINTS[1] / "checkpoints" / f"step_{stop_step:08d}").is_dir()


def test_a_grid_sweep_ranks_its_points_by_the_monitored_metric(monitored_sweep):
    """By what the model each point kept scored (export=best: its best eval), not by its last eval; the points are
    examples, not token blocks."""
    import csv

    rows = list(csv.DictReader((monitored_sweep / "sweep.csv").open()))
    for row in rows:
        result = read_result(monitored_sweep / row["point"])
        assert float(row["model_val_accuracy"]) == result["best_val_accuracy"] == result["model_eval"]["val_accuracy"]
        assert "batch_tokens" not in row and "tokens_per_s" not in row and row["batch_sequences"] == "32"
    top = max(rows, key=lambda r: float(r["model_val_accuracy"]))
    assert f"Best (highest val_accuracy): **{top['point']}**" in (monitored_sweep / "summary.md").read_text()
    from xtrain.commands import status

    text = status.sweep_status(monitored_sweep)
    assert text.splitlines()[0].split()[:9] == ["point", "trainer.early_stop_patience", "status", "steps", "restarts",
                                                "train_loss", "val_loss", "val_accuracy", "examples_per_s"]
    assert f"best: {top['point']} (val_accuracy " in text


def test_a_resumed_sweep_leaves_its_early_stopped_point_as_it_was(monitored_sweep, project, tmp_path):
    """An early stop completes a point: resuming the sweep trains neither point again, nor rewrites its files."""
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(monitored_sweep, sweep_dir)
    stopped = sweep_dir / POINTS[1]
    files = {path: path.read_bytes() for path in stopped.rglob("*") if path.is_file()}
    run_xtrain("-m", f"run_dir={sweep_dir}", *SPELLED, *TRAINER, *MONITORED, "trainer.early_stop_patience=0,1",
               "resume=auto", cwd=project)
    assert {path: path.read_bytes() for path in stopped.rglob("*") if path.is_file()} == files
    assert read_result(stopped)["steps"] < 200 and "early_stop" in read_result(stopped)


def test_an_early_stopped_run_resumes_from_its_stop_to_the_unbroken_weights(monitored_sweep, digits_run, project,
                                                                            tmp_path):
    """Evals and the monitor change nothing that trains: resumed without the early stop, it ends where a run that
    never stopped ends."""
    run_dir = tmp_path / "run"
    shutil.copytree(monitored_sweep / POINTS[1], run_dir)
    stop_step = read_result(run_dir)["early_stop"]["step"]
    run_xtrain(f"run_dir={run_dir}", *SPELLED, *TRAINER, *MONITORED, "resume=auto", "trainer.export=last", cwd=project)
    result = read_result(run_dir)
    assert result["resumed_from"].endswith(f"step_{stop_step:08d}") and result["steps"] == 200
    assert result["restarts"][-1]["changed"] == {"trainer.early_stop_patience": [1, 0], "trainer.export": ["best", "last"]}
    assert result["model_step"] == 200 and "early_stop" not in result
    assert_equal_weights(digits_run, run_dir)


BLOCKS_RUN = ["task=custom", "model._target_=blocks.Net", "data.train._target_=mydata.digits",
              "+data.train.split=train", "data.val._target_=mydata.digits", "+data.val.split=val",
              "task.metrics=[accuracy]", "trainer.max_steps=24", "trainer.warmup_steps=4", "trainer.lr=3e-3",
              "trainer.eval_every=12", "trainer.save_every=24", "trainer.log_every=6"]


@pytest.fixture(scope="module")
def blocks_one_process(project, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("blocks") / "run"
    run_xtrain(f"run_dir={run_dir}", *BLOCKS_RUN, "trainer.batch_size=32", cwd=project)
    return run_dir


def blocks_weights(*run_dirs):
    from safetensors.torch import load_file

    return [load_file(run_dir / "model" / "model.safetensors") for run_dir in run_dirs]


# ZeRO partitions and reduce-scatters in buckets, FSDP2 per block: their sums round differently from one process's
@pytest.mark.parametrize("strategy,env", [
    ("zero1", ZERO_ON_CPU),
    ("zero2", ZERO_ON_CPU),
    ("zero3", ZERO_ON_CPU),
    ("fsdp", FSDP_ON_CPU),
])
def test_a_custom_model_under_every_sharded_strategy_follows_one_process(project, blocks_one_process, tmp_path,
                                                                        strategy, env):
    """2 ranks x batch 16 against 1 process x batch 32 (the same effective batch), within rtol 1e-3 / atol 1e-4;
    FSDP2 wraps the blocks of the model's nn.ModuleList."""
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", *BLOCKS_RUN, f"strategy={strategy}", "cluster.num_processes=2",
               "trainer.batch_size=16", env=env, cwd=project)
    result, one = read_result(run_dir), read_result(blocks_one_process)
    assert result["status"] == "completed" and result["world_size"] == 2
    assert result["model_parameters"] == one["model_parameters"]
    if strategy == "fsdp":
        assert result["fsdp_units"] == {"Block": 2, "Net": 1}
    else:
        assert json.loads((run_dir / "deepspeed.json").read_text())["zero_optimization"]["stage"] == int(strategy[-1])
    first, first_one = read_metrics(run_dir)[0], read_metrics(blocks_one_process)[0]
    assert first["step"] == 0 and first["val/accuracy"] == first_one["val/accuracy"]  # the same initial weights
    expected, got = blocks_weights(blocks_one_process, run_dir)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-3, atol=1e-4)
    assert abs(result["val_accuracy"] - one["val_accuracy"]) <= 2 / 297  # at most two of 297 answers differ


def test_a_compiled_custom_model_follows_eager_under_eagers_names(project, blocks_one_process, tmp_path):
    """Each of the nn.ModuleList's blocks compiled in place, the other modules leaf by leaf: the same parameter
    names and, up to rounding, the same weights."""
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", *BLOCKS_RUN, "trainer.batch_size=32", "trainer.compile=true", cwd=project)
    assert read_result(run_dir)["compiled_regions"] == 4  # embed, the 2 blocks and head
    expected, got = blocks_weights(blocks_one_process, run_dir)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)


def test_a_custom_model_in_bf16_trains_under_autocast_near_fp32(project, blocks_one_process, tmp_path):
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", *BLOCKS_RUN, "trainer.batch_size=32", "precision=bf16", cwd=project)
    result, one = read_result(run_dir), read_result(blocks_one_process)
    assert result["precision"] == "bf16" and result["autocast"] is True
    assert result["val_loss"] == pytest.approx(one["val_loss"], rel=0.05) and result["val_loss"] != one["val_loss"]
    assert {t.dtype for t in blocks_weights(run_dir)[0].values()} == {torch.float32}  # fp32 master weights


def test_two_ranks_stop_early_together_at_a_step_boundary(project, tmp_path):
    """A min_delta no eval can beat: the first eval after step 0 does not improve on it, and patience 1 ends the run
    there. Both ranks stop at that step (rank 0's verdict) and each saves its part of the step's checkpoint."""
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", *BLOCKS_RUN, "trainer.batch_size=16", "cluster.num_processes=2",
               "trainer.monitor=val_accuracy", "trainer.early_stop_patience=1", "trainer.early_stop_min_delta=2",
               cwd=project)
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["world_size"] == 2
    assert result["steps"] == 12 and result["early_stop"] == {"step": 12, "patience": 1, "best_step": 0}
    assert max(row["step"] for row in read_metrics(run_dir)) == 12
    saved = run_dir / "checkpoints" / "step_00000012"
    assert {p.name for p in saved.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}


def test_fsdp_refuses_a_model_without_a_repeated_block_in_one_line(project, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", *SPELLED, "strategy=fsdp", "cluster.num_processes=2", check=False,
                      env=FSDP_ON_CPU, cwd=project)
    assert_one_line_error(proc, "strategy.wrap_layer is empty: Sequential declares no layer class to wrap "
                                "(_no_split_modules) and holds no nn.ModuleList of blocks; set it to the class of its "
                                "repeated block")
    assert not run_dir.exists()
