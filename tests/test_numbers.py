"""Every number xtrain reports is one the user would compute: on a user project of scikit-learn tables (the
examples/tabular project, copied outside the package), metrics get the inputs they need (scores for AUROC, a one-logit
model thresholded at 0) and equal scikit-learn's on the exported model; bests follow each value's direction; losses
average over what counts; a metric that cannot be computed is one line before anything launches."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import SHORT, assert_one_line_error, example_project, read_metrics, read_result, run_xtrain

AUROC = "{_target_: torchmetrics.classification.BinaryAUROC, name: auroc}"

# What a user's project holds besides the example's own modules: models, datasets and metrics that each probe one
# way a number goes wrong.
PROBES = '''import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from tables import Table


class Column(nn.Module):
    """One output per example as an (N, 1) column: against (N,) targets an elementwise loss broadcasts."""

    def __init__(self, in_features=10):
        super().__init__()
        self.linear = nn.Linear(in_features, 1)

    def forward(self, features):
        return self.linear(features)


class DictNet(nn.Module):
    """Returns a dict, as many research models do: the outputs are its `logits`."""

    def __init__(self, in_features=13, classes=3):
        super().__init__()
        self.linear = nn.Linear(in_features, classes)

    def forward(self, features):
        return {"logits": self.linear(features), "features": features}


class Tagger(nn.Module):
    """Per-position class scores, (N, C, T), from an embedding of each token."""

    def __init__(self, classes=3, uniform=False):
        super().__init__()
        self.embed = nn.Embedding(5, classes)
        if uniform:  # every class equally likely at every position, whatever the weights learn
            nn.init.zeros_(self.embed.weight)
            self.embed.weight.requires_grad_(False)
            self.bias = nn.Parameter(torch.zeros(()))
        self.uniform = uniform

    def forward(self, tokens):
        scores = self.embed(tokens).transpose(1, 2)
        return scores + self.bias if self.uniform else scores


class Sequences(Dataset):
    """Token sequences with a class per position; the positions after each one's length are padding (-100)."""

    def __init__(self, split="train", n=96, length=12):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.tokens = torch.randint(0, 5, (n, length), generator=g)
        self.targets = torch.randint(0, 3, (n, length), generator=g)
        lengths = torch.randint(2, length + 1, (n,), generator=g)
        self.targets[torch.arange(length)[None, :] >= lengths[:, None]] = -100

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.tokens[i], self.targets[i]


class Failing(Table):
    """A table whose items past `fail_at` cannot be read."""

    def __init__(self, fail_at=300, **kwargs):
        super().__init__(**kwargs)
        self.fail_at = fail_at

    def __getitem__(self, index):
        if index >= self.fail_at:
            raise IndexError(f"row {index} is unreadable")
        return super().__getitem__(index)


def ranks_only(preds, targets):
    """A metric that cannot take what the ranks give it, and is not asked before (on the driver) where it could."""
    import os

    if "RANK" in os.environ:
        raise ValueError("no metric here")
    return 0.0


def slow_accuracy(preds, targets):
    """Accuracy that takes a second to compute: an eval the throughput must not count."""
    time.sleep(1.0)
    return float((preds == targets).double().mean())


import torchmetrics


class Counted(torchmetrics.Metric):
    """A user's own metric with a sum state: the examples it saw."""

    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds, targets):
        self.n += len(targets)

    def compute(self):
        return self.n


class Gathered(torchmetrics.Metric):
    """A user's own metric with a list state (concatenated across ranks by a sync): the targets it kept."""

    def __init__(self):
        super().__init__()
        self.add_state("kept", default=[], dist_reduce_fx="cat")

    def update(self, preds, targets):
        self.kept.append(targets)

    def compute(self):
        return torch.tensor(float(sum(len(t) for t in self.kept) if isinstance(self.kept, list) else len(self.kept)))


CALLS = []


def fails_once_started(preds, targets):
    """A metric the driver's check passes (its first call in the process) that fails at the run's first eval."""
    CALLS.append(len(targets))
    if len(CALLS) > 1:
        raise ValueError("a metric that fails once the run has started")
    return 0.0


class Wide(Table):
    """Test items with twice the features the model takes."""

    def __getitem__(self, index):
        features, target = super().__getitem__(index)
        return np.concatenate([features, features]), target


class Watch:
    """Writes the error its on_exception hook is given into <run dir>/exception.txt."""

    def on_exception(self, state, error):
        (state.run_dir / "exception.txt").write_text(f"{type(error).__name__}: {error}")
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return example_project(tmp_path_factory, "tabular", {"probes.py": PROBES})


def table(project, name: str, split: str = "val", targets: str = "ids"):
    import sys

    sys.path.insert(0, str(project))
    try:
        from tables import Table
    finally:
        sys.path.remove(str(project))
    return Table(name, split, targets=targets)


def outputs_of(run_dir, val) -> torch.Tensor:
    import xtrain

    with torch.no_grad():
        return xtrain.load_model(run_dir)(torch.tensor(val.features, dtype=torch.float32))


def evals(run_dir, name: str) -> dict[int, float]:
    return {row["step"]: row[f"val/{name}"] for row in read_metrics(run_dir) if f"val/{name}" in row}


@pytest.mark.parametrize("outputs", [1, 2])
def test_a_binary_classifier_gets_ids_and_scores_whatever_its_outputs(project, tmp_path, outputs):
    """One logit (binary_cross_entropy_with_logits on 0./1. floats) or two (cross-entropy on ids): accuracy and F1 see
    the classes (the logit thresholded at 0, the argmax), AUROC the scores (the sigmoid, the softmax's second
    column), each equal to scikit-learn's on the model the run kept; AUROC is maximised (torchmetrics says so) and
    the best is the highest."""
    from sklearn import metrics as sk

    run_dir = tmp_path / "run"
    two = ["model.outputs=2", "task.loss._target_=null", "data.train.targets=ids", "data.val.targets=ids"] if outputs == 2 else []
    proc = run_xtrain("--config-dir", "conf", "experiment=cancer", f"run_dir={run_dir}", *two,
                      f"task.metrics=[accuracy,f1_macro,{AUROC}]", "trainer.monitor=val_auroc", "trainer.export=best",
                      cwd=project)
    result, val = read_result(run_dir), table(project, "breast_cancer")
    out = outputs_of(run_dir, val)
    scores, classes = (out.sigmoid(), out > 0) if outputs == 1 else (out.softmax(1)[:, 1], out.argmax(1))
    kept = result["model_eval"]
    assert kept["step"] == result["model_step"] == result["monitor"]["best_step"]
    assert kept["val_auroc"] == pytest.approx(sk.roc_auc_score(val.targets, scores.numpy()), abs=1e-6)
    assert kept["val_accuracy"] == pytest.approx(sk.accuracy_score(val.targets, classes.numpy()), abs=1e-12)
    assert kept["val_f1_macro"] == pytest.approx(sk.f1_score(val.targets, classes.numpy(), average="macro"), abs=1e-6)
    aurocs = evals(run_dir, "auroc")
    assert result["monitor"]["direction"] == "maximize" and result["best_val_auroc"] == max(aurocs.values())
    assert aurocs[kept["step"]] == max(aurocs.values()) and kept["step"] > 0
    assert result["best_val_accuracy"] == max(evals(run_dir, "accuracy").values())
    text = proc.stdout + proc.stderr
    assert text.count("the datasets' float64 tensors are cast to float32") == 1


def test_multiclass_scores_a_confusion_matrix_and_a_dict_output(project, tmp_path):
    """Wine, three classes: multiclass AUROC gets the softmax (scikit-learn's one-vs-rest), the confusion matrix is
    saved per eval (JSON, and a picture) and listed in result.json, and a model returning {"logits": ...} trains."""
    from sklearn import metrics as sk

    run_dir = tmp_path / "run"
    run_xtrain("--config-dir", "conf", "experiment=wine", f"run_dir={run_dir}", "trainer.max_steps=10",
               "trainer.eval_every=5", cwd=project)
    result, val = read_result(run_dir), table(project, "wine")
    out = outputs_of(run_dir, val)
    assert result["val_auroc"] == pytest.approx(sk.roc_auc_score(val.targets, out.softmax(1).numpy(), multi_class="ovr"),
                                                abs=1e-6)
    assert result["val_accuracy"] == pytest.approx(sk.accuracy_score(val.targets, out.argmax(1).numpy()), abs=1e-12)
    assert "val_confusion" not in result and "best_val_confusion" not in result
    files = result["eval_files"]["confusion"]
    assert files == [f"evals/confusion/step_{s:08d}.{kind}" for s in (0, 5, 10) for kind in ("json", "png")]
    saved = json.loads((run_dir / files[-2]).read_text())
    assert saved["step"] == 10
    assert saved["confusion"] == sk.confusion_matrix(val.targets, out.argmax(1).numpy()).tolist()
    import matplotlib.image

    assert matplotlib.image.imread(run_dir / files[-1]).shape[0] > 100

    dict_run = tmp_path / "dict"
    run_xtrain("--config-dir", "conf", "experiment=wine", f"run_dir={dict_run}", "model._target_=probes.DictNet",
               "~model.outputs", "~model.in_features", "~model.hidden", "trainer.max_steps=5", "task.metrics=[accuracy]",
               cwd=project)
    assert read_result(dict_run)["status"] == "completed" and 0 <= read_result(dict_run)["val_accuracy"] <= 1


def test_a_regression_keeps_the_best_model_by_a_metric_of_its_own(project, tmp_path):
    """Diabetes: the user's R² says it is maximised; the monitor, best_val_r2 and the model kept follow it (R² of
    the exported model is the recorded one), the error metrics are minimised, and a metric with no direction has no
    best."""
    run_dir = tmp_path / "run"
    run_xtrain("--config-dir", "conf", "experiment=diabetes", f"run_dir={run_dir}",
               "task.metrics=[mse,mae,{_target_: mymetrics.r2, name: r2, direction: maximize},"
               "{_target_: mymetrics.r2, name: plain_r2}]", cwd=project)
    result, val = read_result(run_dir), table(project, "diabetes", targets="standardized")
    r2s, mses = evals(run_dir, "r2"), evals(run_dir, "mse")
    assert result["monitor"]["direction"] == "maximize"
    assert result["best_val_r2"] == result["monitor"]["best"] == max(r2s.values()) == result["model_eval"]["val_r2"]
    assert result["best_val_mse"] == min(mses.values()) and "best_val_plain_r2" not in result
    out = outputs_of(run_dir, val).double()
    truth = torch.tensor(val.targets)
    r2 = 1 - ((truth - out) ** 2).sum() / ((truth - truth.mean()) ** 2).sum()
    assert result["model_eval"]["val_r2"] == pytest.approx(float(r2), abs=1e-6)
    assert result["model_eval"]["val_mse"] == pytest.approx(float(((truth - out) ** 2).mean()), rel=1e-5)


COUNTS = ("task.metrics=[accuracy,{_target_: torchmetrics.classification.MulticlassConfusionMatrix, num_classes: 3, "
          "name: confusion},{_target_: torchmetrics.classification.MulticlassStatScores, num_classes: 3, average: null, "
          "name: stats},{_target_: probes.Counted, name: counted},{_target_: probes.Gathered, name: gathered}]")
TEST_SPLIT = ["data.test._target_=tables.table", "+data.test.name=wine", "+data.test.split=test"]


def test_counts_and_arrays_on_two_processes_are_one_processs(project, tmp_path):
    """Wine's 36 val and 36 test examples, dealt to 2 ranks in batches of 16 (the sampler pads the last): every
    torchmetrics metric with sum or list states (a confusion matrix, per-class stat scores, a user's own metric
    classes) counts each example once, as one process does, in the run and in `xtrain.eval num_processes=2`; the
    test split's matrix is the exported model's and listed in result.json with the val ones."""
    from sklearn import metrics as sk

    args = ["--config-dir", "conf", "experiment=wine", COUNTS, *TEST_SPLIT, "trainer.max_steps=2",
            "trainer.warmup_steps=1", "trainer.eval_every=2", "trainer.save_every=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_xtrain(*args, f"run_dir={one}", cwd=project)
    run_xtrain(*args, f"run_dir={two}", "cluster.num_processes=2", cwd=project)
    first = "evals/{}/step_00000000.json"
    for name in ("confusion", "stats"):  # step 0: the same initial weights
        assert json.loads((two / first.format(name)).read_text()) == json.loads((one / first.format(name)).read_text())
    assert sum(map(sum, json.loads((two / first.format("confusion")).read_text())["confusion"])) == 36
    step0 = read_metrics(two)[0]
    assert step0["step"] == 0 and step0["val/counted"] == step0["val/gathered"] == 36
    result, test = read_result(two), table(project, "wine", split="test")
    assert result["test_counted"] == result["test_gathered"] == 36
    last = f"evals/test_confusion/step_{result['model_step']:08d}"
    assert {f"{last}.json", f"{last}.png"} <= set(result["eval_files"]["test_confusion"])
    assert json.loads((two / f"{last}.json").read_text())["test_confusion"] == sk.confusion_matrix(
        test.targets, outputs_of(two, test).argmax(1).numpy()).tolist()
    from conftest import xtrain_in_process

    evaluated = {}
    for processes in (1, 2):
        xtrain_in_process(str(two), f"num_processes={processes}", cwd=project, command="xtrain.eval")
        evaluated[processes] = json.loads((two / "eval.json").read_text())["val"]
    loss = {processes: numbers.pop("loss") for processes, numbers in evaluated.items()}
    assert evaluated[2] == evaluated[1] and evaluated[2]["counted"] == 36
    assert loss[2] == pytest.approx(loss[1], rel=1e-6)  # a float32 mean summed in another order on 2 ranks
    assert sum(map(sum, evaluated[2]["confusion"])) == 36


def test_a_failure_after_the_start_is_recorded_and_told_to_the_callbacks(project, tmp_path):
    """What the driver cannot see coming (a metric of the user's that fails only once the run has started) ends the
    run `failed` with its one line in result.json, as `xtrain.status` shows it, never `running`; the callbacks'
    on_exception gets the error."""
    run_dir = tmp_path / "run"
    proc = run_xtrain("--config-dir", "conf", "experiment=wine", f"run_dir={run_dir}", "trainer.export=best",
                      "task.metrics=[{_target_: probes.fails_once_started, name: late, direction: maximize}]",
                      "trainer.monitor=val_late", "trainer.callbacks=[{_target_: probes.Watch}]", check=False,
                      cwd=project)
    line = assert_one_line_error(proc, "task.metrics: probes.fails_once_started failed on preds of shape (36,)")
    result = read_result(run_dir)
    assert result["status"] == "failed" and result["error"] == line.removeprefix("xtrain: error: ")
    from xtrain.commands import status

    assert status.run_status(run_dir).startswith(f"run {run_dir}: failed, step 0 of 60")
    assert (run_dir / "exception.txt").read_text() == f"ConfigError: {result['error']}"


@pytest.mark.parametrize("experiment,overrides,expected", [
    ("wine", ["trainer.monitor=val_confusion", "trainer.monitor_direction=maximize"],
     "trainer.monitor=val_confusion: val_confusion is an array at each eval (saved under evals/), not one number, so no "
     "eval is better than another by it; choose one of val_loss, val_accuracy, val_auroc"),
    ("wine", ["task.metrics=[acuracy]", "trainer.monitor=val_accuracy"],
     "task.metrics: no built-in metric acuracy; choose from accuracy, f1_macro"),
    ("wine", ["task.metrics=[{_target_: torchmetrics.classification.MulticlassAccuracy, num_classes: 2, name: acc}]",
              "trainer.monitor=val_acc", "trainer.monitor_direction=minimize"],
     "task.metrics: torchmetrics.classification.MulticlassAccuracy failed on probs of shape (36, 3) (float32)"),
    ("wine", ["task.loss._target_=torch.nn.CrossEntropyLoss", "+task.loss.smooth=0.2"],
     "task.loss.smooth=0.2: torch.nn.CrossEntropyLoss takes no argument smooth; did you mean task.loss.label_smoothing? "
     "(it takes weight, size_average, ignore_index, reduce, reduction, label_smoothing)"),
    ("wine", ["task.loss._target_=torch.nn.functional.cross_entropy", "+task.loss.smoothing=0.2"],
     "task.loss.smoothing=0.2: torch.nn.functional.cross_entropy takes no argument smoothing; did you mean "
     "task.loss.label_smoothing?"),
    ("wine", ["data.test._target_=probes.Wide", "+data.test.name=wine", "+data.test.split=test"],
     "model._target_=nets.mlp: its forward failed on a batch of data.test ((36, 26) (float32)): RuntimeError: mat1 and "
     "mat2 shapes cannot be multiplied"),
    ("wine", [*TEST_SPLIT, "task.metrics=[{_target_: torchmetrics.classification.MulticlassAUROC, num_classes: 3, "
                            "nme: auroc}]"],
     "task.metrics[0]._target_=torchmetrics.classification.MulticlassAUROC: calling it failed: ValueError: Unexpected "
     "keyword arguments: `nme`"),
    ("diabetes", ["task.metrics=[accuracy]", "trainer.monitor=val_loss"],
     "task.metrics: accuracy measures classes, but the eval gives outputs of shape (88,) and targets of shape (88,) "
     "with targets other than class ids (a regression); use mse or mae"),
    ("wine", ["task.metrics=[mse]"],
     "task.metrics: mse measures numbers, but the eval gives outputs of shape (36, 3) and targets of shape (36,): 3 "
     "outputs per class id (a classification); use accuracy, f1_macro, precision_macro, recall_macro"),
    ("wine", [f"task.metrics=[{AUROC}]"],
     "task.metrics: torchmetrics.classification.BinaryAUROC failed on probs of shape (36, 3) (float32) and targets of "
     "shape (36,) (int64): "),
    ("diabetes", ["model._target_=probes.Column", "~model.outputs", "~model.hidden", "task.metrics=[mse]",
                  "trainer.monitor=val_loss", "trainer.export=last"],
     "task.loss: gave losses of shape (32, 32) for outputs of shape (32, 1) and targets of shape (32,): the two "
     "broadcast against each other"),
    ("cancer", ["model._target_=probes.Column", "~model.outputs", "model.in_features=30"],
     "task.loss._target_=torch.nn.functional.binary_cross_entropy_with_logits: failed on outputs of shape (32, 1) "
     "(float32) and targets of shape (32,) (float32): ValueError: Target size (torch.Size([32])) must be the same as "
     "input size (torch.Size([32, 1]))"),
    ("cancer", ["task.metrics=[accuracy,{_target_: mymetrics.r2, name: loss}]"],
     "task.metrics: a metric is named loss, the eval's own val_loss; give it another name"),
    ("cancer", [f"task.metrics=[{AUROC[:-1]}, direction: minimize}}]"],
     "task.metrics[0].direction=minimize: BinaryAUROC is better when higher (its higher_is_better); use direction: "
     "maximize"),
    ("diabetes", ["task.metrics=[{_target_: mymetrics.r2, name: r2}]"],
     "trainer.monitor_direction=auto: whether a higher val_r2 is better is not known; set "
     "trainer.monitor_direction=maximize or minimize (or direction: in its task.metrics entry)"),
])
def test_a_number_that_cannot_be_computed_is_one_line_before_anything_starts(project, tmp_path, experiment, overrides,
                                                                             expected):
    """A train batch and a val batch go through the model, the loss and every metric on the driver first."""
    run_dir = tmp_path / "run"
    proc = run_xtrain("--config-dir", "conf", f"experiment={experiment}", f"run_dir={run_dir}", *overrides,
                      check=False, cwd=project)
    assert_one_line_error(proc, expected)
    assert not run_dir.exists()


def test_the_monitor_and_objective_may_name_only_what_the_metrics_compute_as_one_number(project, tmp_path):
    """Checked after the metrics ran on the driver's probe: a function metric that returns an array (scikit-learn's
    confusion matrix) is neither offered nor taken as a monitor or a study's objective."""
    cm = "task.metrics=[accuracy,{_target_: sklearn.metrics.confusion_matrix, name: cm}]"
    cases = [
        (["trainer.monitor=val_acc"], "trainer.monitor=val_acc: the task does not compute it; it computes val_loss, "
                                      "val_accuracy"),
        (["trainer.monitor=val_cm", "trainer.monitor_direction=minimize"],
         "trainer.monitor=val_cm: val_cm is an array at each eval (saved under evals/), not one number, so no eval is "
         "better than another by it; choose one of val_loss, val_accuracy"),
        (["-m", "hydra/sweeper=xtrain_optuna", "hydra.sweeper.objective=val_cm", "hydra.sweeper.direction=maximize",
          "trainer.lr=interval(1e-4,1e-1)"],
         "hydra.sweeper.objective=val_cm: val_cm is an array at each eval (saved under evals/), not one number, so no "
         "eval is better than another by it; choose one of val_loss, val_accuracy"),
    ]
    for overrides, expected in cases:
        run_dir = tmp_path / "run"
        proc = run_xtrain("--config-dir", "conf", "experiment=wine", f"run_dir={run_dir}", cm, *overrides, check=False,
                          cwd=project)
        assert assert_one_line_error(proc) == f"xtrain: error: {expected}"
        assert not run_dir.exists()


def test_a_study_against_a_metrics_own_direction_is_refused(project, tmp_path):
    sweep_dir = tmp_path / "study"
    proc = run_xtrain("-m", "--config-dir", "conf", "experiment=cancer", f"run_dir={sweep_dir}",
                      "hydra/sweeper=xtrain_optuna", "hydra.sweeper.objective=val_auroc",
                      "hydra.sweeper.direction=minimize", "trainer.lr=tag(log,interval(1e-4,1e-1))",
                      f"task.metrics=[{AUROC}]", check=False, cwd=project)
    assert_one_line_error(proc, "hydra.sweeper.direction=minimize: val_auroc is better when higher; use "
                                "hydra.sweeper.direction=maximize")
    assert not sweep_dir.exists()


def test_a_metric_that_fails_at_the_first_eval_on_the_ranks_is_one_line_and_a_failed_run(project, tmp_path):
    """What the driver cannot check (a task's first eval runs on the ranks) still ends as one line, exit 2, and the
    run dir records the failure, not a run that looks to be running."""
    run_dir = tmp_path / "run"
    proc = run_xtrain("--config-dir", "conf", "experiment=cancer", f"run_dir={run_dir}", "cluster.num_processes=2",
                      "task.metrics=[{_target_: probes.ranks_only, name: picky}]", check=False, cwd=project)
    assert_one_line_error(proc, "task.metrics: probes.ranks_only failed on preds of shape (114,) (int64) and targets "
                                "of shape (114,) (int64): ValueError: no metric here")
    result = read_result(run_dir)
    assert result["status"] == "failed" and result["error"].startswith("task.metrics: probes.ranks_only failed")


TAGGER = ["task=custom", "model._target_=probes.Tagger", "data.train._target_=probes.Sequences",
          "+data.train.split=train", "data.val._target_=probes.Sequences", "+data.val.split=val",
          "trainer.batch_size=16", "trainer.warmup_steps=1", "trainer.eval_every=4", "trainer.log_every=1",
          "trainer.save_every=4", "task.metrics=[]"]


def test_a_per_position_loss_averages_over_the_positions_that_count(project, tmp_path):
    """Uniform scores over 3 classes: every loss xtrain reports is ln 3, as CrossEntropyLoss gives it, however much
    of each sequence is padding; with real scores the val loss is CrossEntropyLoss over the split's counted
    positions."""
    uniform = tmp_path / "uniform"
    run_xtrain(f"run_dir={uniform}", *TAGGER, "+model.uniform=true", "trainer.max_steps=4", cwd=project)
    rows = read_metrics(uniform)
    assert [row["train/loss"] for row in rows if "train/loss" in row] == pytest.approx([math.log(3)] * 4, abs=1e-6)
    assert [row["val/loss"] for row in rows if "val/loss" in row] == pytest.approx([math.log(3)] * 2, abs=1e-6)

    learned = tmp_path / "learned"
    run_xtrain(f"run_dir={learned}", *TAGGER, "trainer.max_steps=4", cwd=project)
    import sys

    sys.path.insert(0, str(project))
    try:
        from accelerate.utils import set_seed
        from probes import Sequences, Tagger

        set_seed(0)  # as the run seeds itself before it builds the model
        model, val = Tagger(), Sequences("val")
    finally:
        sys.path.remove(str(project))
    with torch.no_grad():
        expected = torch.nn.CrossEntropyLoss()(model(val.tokens), val.targets)
    assert read_result(learned)["initial_val_loss"] == pytest.approx(expected.item(), rel=1e-6)


def test_the_throughput_counts_training_steps_only(project, tmp_path):
    """Each eval takes a second (a slow metric): the examples per second of a window after one are the rate its
    steps trained at, not one that counts the eval's second."""
    run_dir = tmp_path / "run"
    run_xtrain("--config-dir", "conf", "experiment=cancer", f"run_dir={run_dir}", "trainer.max_steps=20",
               "trainer.eval_every=10", "trainer.log_every=10", "task.metrics=[{_target_: probes.slow_accuracy}]",
               cwd=project)
    rates = [row["train/examples_per_s"] for row in read_metrics(run_dir) if "train/loss" in row]
    assert len(rates) == 2 and all(rate > 10 * 32 / 1.0 for rate in rates)  # 10 steps of 32 in well under a second


def test_a_failed_run_keeps_its_best_model_but_load_model_says_it_did_not_complete(project, tmp_path):
    import xtrain
    from xtrain.tasks.exports import NotCompleted

    run_dir = tmp_path / "run"
    proc = run_xtrain("--config-dir", "conf", "experiment=cancer", f"run_dir={run_dir}", "trainer.export=best",
                      "data.train._target_=probes.Failing", check=False, cwd=project)
    result = read_result(run_dir)
    assert proc.returncode == 1 and result["status"] == "failed" and "row" in result["error"]
    assert result["model_step"] == 0 and (run_dir / "model").is_dir()  # the best so far: the untrained model's eval
    with pytest.raises(NotCompleted) as refused:
        xtrain.load_model(run_dir)
    assert str(refused.value) == (f"{run_dir}: the run has not completed (failed: {result['error']}); its model/ holds "
                                  "step 0's model: load it with xtrain.load_model(run_dir, incomplete=True)")
    assert isinstance(xtrain.load_model(run_dir, incomplete=True), torch.nn.Module)


def test_a_nan_eval_never_becomes_the_best():
    from types import SimpleNamespace

    from xtrain.config.schema import TrainerConfig
    from xtrain.engine.monitor import Monitor
    from xtrain.tasks.metrics import better

    trainer = TrainerConfig(monitor="val_accuracy", early_stop_patience=3)
    monitor, one = Monitor.of(trainer, "maximize"), SimpleNamespace(num_processes=1)
    verdicts = [monitor.judge(one, step, {"val_accuracy": value}, trainer)
                for step, value in ((0, math.nan), (10, 0.5), (20, math.nan), (30, 0.7))]
    assert [improved for improved, _ in verdicts] == [False, True, False, True]
    assert (monitor.best, monitor.best_step) == (0.7, 30)
    assert not better("minimize", math.nan, None) and better("minimize", 1.0, math.nan)
    assert better("minimize", 0.5, 1.0, min_delta=0.4) and not better("minimize", 0.5, 1.0, min_delta=0.5)
    assert not better(None, 0.5, None)  # no direction known: no best


def test_train_lr_is_the_rate_each_logged_step_used(short_run):
    from xtrain.config import schema
    from xtrain.engine.optim import lr_factor

    trainer = schema.load(str(short_run / "run.yaml")).trainer
    for row in read_metrics(short_run):
        if "train/lr" in row:  # step s is the schedule's (s - 1)th: the first step runs at warmup's first rate
            assert row["train/lr"] == pytest.approx(trainer.lr * lr_factor(row["step"] - 1, trainer), rel=1e-12)


def test_summaries_keep_three_significant_digits():
    from xtrain.sweeps.summary import fmt

    assert [fmt(v) for v in (3e-5, 0.00123, 0.0123, 4.60781, 426.004, 8295.4, -0.0005)] == [
        "3e-05", "0.00123", "0.0123", "4.6078", "426.00", "8295", "-0.0005"]


def test_qlora_counts_its_4bit_base_at_half_a_byte_a_weight():
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import compose_run
    from xtrain.config.lora import BaseQuantization, LoraConfig
    from xtrain.parallel import estimate
    from xtrain.tasks import lora

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    settings = LoraConfig(enabled=True, quantize_base=BaseQuantization.nf4)
    quantized = lora.quantized_parameters(meta, settings)
    per_layer = 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128  # q, o; k, v; the MLP
    assert quantized == 2 * per_layer  # not the embeddings, the norms or the output head
    assert lora.quantized_parameters(meta, LoraConfig(enabled=True)) == 0
    n, trained = sum(p.numel() for p in meta.parameters()), lora.trainable_parameters(meta, settings)
    memory = estimate.model_state_memory(n, compose_run(), trained, quantized)
    assert memory.params == 4 * (n - quantized) + 0.5 * quantized  # fp32 under DDP, 4 bits where quantized
    assert (memory.grads, memory.optimizer) == (4 * trained, 8 * trained)


STEP_LOSSES = '''import json


class StepLosses:
    """Each step's loss as callbacks get it, in <run dir>/step_losses.jsonl."""

    def on_train_batch_end(self, state, loss):
        with open(state.run_dir / "step_losses.jsonl", "a") as f:
            f.write(json.dumps([state.step, loss]) + "\\n")
'''


def test_one_process_reads_its_losses_where_they_are_used_and_each_is_its_steps(tmp_path, monkeypatch):
    """One process keeps each step's loss on the device and reads those of the steps since the last read together,
    where a log line, eval or checkpoint needs them (on a GPU, no wait for the device between them). The logged
    losses are bitwise those of a run that reads every step's loss at once (a callback takes each); a diverged loss is
    named by its own step all the same."""
    from xtrain.engine import loop

    (tmp_path / "steplosses.py").write_text(STEP_LOSSES)
    callback = "trainer.callbacks=[{_target_: steplosses.StepLosses}]"
    reads, read_losses = [], loop.read_losses
    monkeypatch.setattr(loop, "read_losses", lambda unread, *args: (reads.append([s for s, _ in unread]),
                                                                     read_losses(unread, *args))[1])
    runs = {}
    for name, extra in (("deferred", []), ("each_step", [callback])):
        reads.clear()
        runs[name] = tmp_path / name
        run_xtrain(f"run_dir={runs[name]}", *SHORT, *extra, cwd=tmp_path)  # logs at 4, 8, 12; evals, saves at 6, 12
        runs[name + "_reads"] = list(reads)
    assert runs["deferred_reads"] == [[1], [2, 3, 4], [5, 6], [7, 8], [9, 10, 11, 12]]
    assert runs["each_step_reads"] == [[step] for step in range(1, 13)]
    logged = {name: [(r["step"], r["train/loss"]) for r in read_metrics(runs[name]) if "train/loss" in r]
              for name in ("deferred", "each_step")}
    assert logged["deferred"] == logged["each_step"] and [step for step, _ in logged["deferred"]] == [4, 8, 12]
    per_step = [json.loads(line)[1] for line in (runs["each_step"] / "step_losses.jsonl").read_text().splitlines()]
    assert [loss for _, loss in logged["deferred"]] == pytest.approx(
        [sum(per_step[:4]) / 4, sum(per_step[4:8]) / 4, sum(per_step[8:]) / 4], rel=1e-12)

    errors = {}
    for name, extra in (("deferred", []), ("each_step", [callback])):
        run_dir = tmp_path / f"diverged_{name}"
        proc = run_xtrain(f"run_dir={run_dir}", *SHORT, "trainer.lr=1e6", "trainer.max_grad_norm=0", *extra,
                          check=False, cwd=tmp_path)
        assert proc.returncode == 1 and read_result(run_dir)["status"] == "failed"
        errors[name] = read_result(run_dir)["error"]
    assert errors["deferred"] == errors["each_step"] and "the loss is nan" in errors["deferred"]


CLASSIFYING = [
    {"_target_": "torchmetrics.classification.MulticlassConfusionMatrix", "num_classes": 3, "name": "confusion"},
    {"_target_": "torchmetrics.classification.MulticlassStatScores", "num_classes": 3, "average": None,
     "name": "stats"},
    {"_target_": "torchmetrics.classification.MulticlassAUROC", "num_classes": 3, "name": "auroc"},
    {"_target_": "torchmetrics.classification.MulticlassROC", "num_classes": 3, "thresholds": 5, "name": "roc"},
    {"_target_": "torchmetrics.classification.MulticlassAveragePrecision", "num_classes": 3, "name": "ap"},
    {"_target_": "torchmetrics.classification.MulticlassCalibrationError", "num_classes": 3, "name": "ece"},
    {"_target_": "probes.Counted", "name": "counted"},
    {"_target_": "probes.Gathered", "name": "gathered"},
]
REGRESSING = [
    {"_target_": "torchmetrics.regression.MeanSquaredError", "name": "mse"},
    {"_target_": "torchmetrics.regression.PearsonCorrCoef", "name": "pearson"},
    {"_target_": "torchmetrics.MeanMetric", "name": "mean"},
    {"_target_": "probes.Counted", "name": "counted"},
]


def metric_cases():
    """(the metrics, outputs, targets): a 3-class classifier's and a regression's, 45 examples each."""
    g = torch.Generator().manual_seed(0)
    return [(CLASSIFYING, torch.randn(45, 3, generator=g), torch.arange(45) % 3),
            (REGRESSING, torch.randn(45, generator=g), torch.randn(45, generator=g))]


def _metrics_on_a_rank(rank: int, init: str, project: str, got) -> None:
    """One rank of a 2-process gloo group: every kind, built as a run builds it, on the gathered outputs."""
    import sys

    import torch.distributed as dist

    sys.path.insert(0, project)
    from xtrain.tasks import metrics

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        got[rank] = [metrics.compute_all(metrics.build(specs), metrics.Outputs(outputs, targets))
                     for specs, outputs, targets in metric_cases()]
    finally:
        dist.destroy_process_group()


def test_every_metric_kind_computes_one_processs_value_on_every_rank_of_a_process_group(project, tmp_path):
    """Sum states (a confusion matrix, stat scores, counts), list states (curves, scores, a user's list), a mean,
    regression metrics: on each rank of a real process group, the gathered outputs give the value one process
    computes, each example counted once."""
    import sys

    import torch.multiprocessing as mp

    from xtrain.tasks import metrics

    sys.path.insert(0, str(project))
    try:
        alone = [metrics.compute_all(metrics.build(specs), metrics.Outputs(outputs, targets))
                 for specs, outputs, targets in metric_cases()]
    finally:
        sys.path.remove(str(project))
    got = mp.get_context("spawn").Manager().dict()
    mp.start_processes(_metrics_on_a_rank, args=(f"file://{tmp_path / 'rendezvous'}", str(project), got), nprocs=2,
                       start_method="spawn")
    assert alone[0]["counted"] == alone[0]["gathered"] == alone[1]["counted"] == 45
    assert sum(map(sum, alone[0]["confusion"])) == 45
    for rank in (0, 1):
        assert got[rank] == alone, rank
