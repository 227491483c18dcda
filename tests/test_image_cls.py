"""task=image_cls: scikit-learn's digits as an image folder and as .npz arrays, a ResNet and a ViT from transformers
configs; augmentation drawn per (seed, epoch, image), so a resumed run ends bitwise equal to an unbroken one."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import assert_equal_weights, assert_one_line_error, read_metrics, read_result, run_xtrain, xtrain_in_process

TRAIN = ["task=image_cls", "task.num_labels=10", "task.num_channels=1", "trainer.batch_size=32", "trainer.lr=3e-3",
         "trainer.warmup_steps=10", "data.val_fraction=0.15", "trainer.log_every=20"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """digits/<label>/<n>.png: 1,797 8x8 grayscale PNGs."""
    from PIL import Image
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("images") / "digits"
    images, labels = load_digits(return_X_y=True)
    for i, (pixels, label) in enumerate(zip(images, labels)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray((pixels.reshape(8, 8) * 16).clip(0, 255).astype(np.uint8)).save(root / str(label) / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def sevens(folder, tmp_path_factory):
    """A test folder of the digits 3 and 7 only: its classes must map as the training folder's (3 -> 3, 7 -> 7)."""
    root = tmp_path_factory.mktemp("test_images") / "digits"
    for label in ("3", "7"):
        shutil.copytree(folder / label, root / label)
    return root


@pytest.fixture(scope="module")
def resnet_run(folder, sevens, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("image_cls") / "run"
    run_xtrain(f"run_dir={run_dir}", f"data.files=[{folder}]", *TRAIN, "trainer.max_steps=150",
               "trainer.eval_every=50", "trainer.save_every=50", f"data.test=[{sevens}]")
    return run_dir


def test_a_test_folder_is_evaluated_with_the_training_classes(resnet_run, sevens):

    result = read_result(resnet_run)
    assert result["model_test"]["step"] == 150 and result["test_accuracy"] >= 0.8
    predictions = resnet_run / "test_predictions.jsonl"
    proc = xtrain_in_process(str(resnet_run), "split=test", f"predictions={predictions}", check=False,
                             command="xtrain.eval")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert {row["target"] for row in rows} == {3, 7} and len(rows) == sum(1 for _ in sevens.rglob("*.png"))
    assert sum(row["prediction"] == row["target"] for row in rows) / len(rows) == pytest.approx(result["test_accuracy"])
    assert all(row["label"] == str(row["prediction"]) for row in rows)


def test_a_resnet_from_a_transformers_config_learns_digits_from_an_image_folder(resnet_run, folder):
    result = read_result(resnet_run)
    assert result["status"] == "completed" and result["val_accuracy"] >= 0.85 and result["examples_per_s"] > 0
    assert [row["step"] for row in read_metrics(resnet_run) if "val/accuracy" in row] == [0, 50, 100, 150]
    import xtrain

    model = xtrain.load_model(resnet_run)
    assert type(model).__name__ == "ResNetForImageClassification"
    assert model.config.id2label == {i: str(i) for i in range(10)} and model.config.num_channels == 1
    from PIL import Image

    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(path), dtype=np.float32)) / 127.5 - 1
                          for path in sorted((folder / "7").glob("*.png"))[:50]])[:, None]
    with torch.no_grad():
        assert (model(pixels).logits.argmax(dim=1) == 7).double().mean() >= 0.8


def test_an_augmented_run_resumed_after_an_epoch_boundary_ends_bitwise_equal(folder, tmp_path):
    """1,527 train images, batch 32: epoch 1 starts at step 48. Resumed at step 20, the crops drawn after it (in
    epoch 0 and in epoch 1) are the unbroken run's."""
    augmented = [*TRAIN, f"data.files=[{folder}]", "task.augment=[crop,hflip]", "trainer.max_steps=60",
                 "trainer.save_every=20", "trainer.eval_every=60", "trainer.keep_checkpoints=3"]
    unbroken = tmp_path / "unbroken"
    run_xtrain(f"run_dir={unbroken}", *augmented)
    broken = tmp_path / "broken"  # as killed after step 20's checkpoint: the later files gone
    shutil.copytree(unbroken, broken)
    for later in ("model", "checkpoints/step_00000040", "checkpoints/step_00000060"):
        shutil.rmtree(broken / later)
    run_xtrain(f"run_dir={broken}", *augmented, "resume=auto")
    assert read_result(broken)["resumed_from"].endswith("step_00000020")
    assert_equal_weights(unbroken, broken)
    no_crop = tmp_path / "plain"  # the augmentation is real: without it the run ends elsewhere
    run_xtrain(f"run_dir={no_crop}", *[a for a in augmented if not a.startswith("task.augment")])
    assert read_result(no_crop)["train_loss"] != read_result(unbroken)["train_loss"]


def digits_npz(where) -> str:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    arrays = where / "digits.npz"
    np.savez(arrays, images=images.reshape(-1, 8, 8), labels=labels)  # floats 0..16: scaled to 0..255
    return arrays


def test_a_vit_learns_from_npz_arrays(tmp_path):
    arrays = digits_npz(tmp_path)
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", f"data.files=[{arrays}]", *TRAIN, "model=vit", "model.patch_size=2",
               "trainer.max_steps=300", "trainer.eval_every=300")
    result = read_result(run_dir)
    assert result["val_accuracy"] >= 0.8 and result["val_loss"] < result["initial_val_loss"] / 2
    import xtrain

    model = xtrain.load_model(run_dir)
    assert type(model).__name__ == "ViTForImageClassification" and model.config.image_size == 8


def test_a_vit_on_two_processes_follows_one_process(tmp_path):
    """2 ranks x batch 16 against 1 process x batch 32 (the same effective batch; a ViT has no batch statistics):
    the same weights within rtol 1e-3 / atol 1e-4, and step 0's eval over 270 images (2 x 16 does not divide them)
    one process's: its accuracy exactly, its loss to float32's rounding (on some CPUs a batch of 16 and one of 32
    round a logit differently)."""
    vit = [f"data.files=[{digits_npz(tmp_path)}]", *[a for a in TRAIN if not a.startswith("trainer.batch_size")],
           "model=vit", "model.patch_size=2", "trainer.max_steps=24", "trainer.eval_every=12", "trainer.save_every=24"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_xtrain(f"run_dir={one}", *vit, "trainer.batch_size=32")
    run_xtrain(f"run_dir={two}", *vit, "trainer.batch_size=16", "cluster.num_processes=2")
    assert read_result(two)["world_size"] == 2
    first_one, first_two = read_metrics(one)[0], read_metrics(two)[0]
    assert first_one["step"] == first_two["step"] == 0 and first_two["val/accuracy"] == first_one["val/accuracy"]
    assert first_two["val/loss"] == pytest.approx(first_one["val/loss"], rel=1e-6)
    from conftest import model_weights

    expected, got = model_weights(one), model_weights(two)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-3, atol=1e-4)


def test_parquet_images_prepare_to_the_folders_pixels(folder, tmp_path):
    """The same PNGs as encoded bytes in a Parquet file (datasets' {bytes, path} form) give the same pixels."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from xtrain.config.schema import DataSource, data_config
    from xtrain.data import images
    from xtrain.config.task import TaskConfig, TaskKind

    files = sorted(folder.glob("*/*.png"), key=lambda p: (p.parent.name, p.name))
    pq.write_table(pa.table({"image": [{"bytes": p.read_bytes(), "path": p.name} for p in files],
                             "label": [int(p.parent.name) for p in files]}), tmp_path / "digits.parquet")
    task = TaskConfig(name=TaskKind.image_cls, num_labels=10, num_channels=1)
    cache = dict(cache_dir=str(tmp_path / "cache"), val_fraction=0.15)
    from_folder = images.prepare(data_config(DataSource.images, files=[str(folder)], **cache), task)
    from_parquet = images.prepare(data_config(DataSource.images, files=[str(tmp_path / "digits.parquet")],
                                            **cache), task)
    assert from_parquet.meta["num_labels"] == 10 and from_parquet.meta["records"] == 1797
    assert np.array_equal(np.load(from_folder.path / images.PIXELS), np.load(from_parquet.path / images.PIXELS))
    assert np.array_equal(np.load(from_folder.path / images.LABELS), np.load(from_parquet.path / images.LABELS))


@pytest.mark.parametrize("settings,expected", [
    (["task.num_labels=9"], "task.num_labels=9: the images have 10 classes; use task.num_labels=10"),
    (["task.augment=[rotate]"], "task.augment: no augmentation rotate; choose from hflip, crop"),
    (["model=tiny_gpt2"], "task=image_cls: the model is built by _target_: use model=resnet, model=vit, or "
                          "model._target_=<a callable returning an nn.Module>"),
    # the metrics, before anything starts, on outputs of the shape the task declares
    (["task.metrics=[{_target_: torchmetrics.classification.MulticlassAccuracy, num_classes: 5, name: acc}]"],
     "task.metrics: torchmetrics.classification.MulticlassAccuracy failed on probs of shape (64, 10) (float32) and "
     "targets of shape (64,) (int64)"),
    (["task.metrics=[accuracy,{_target_: torchmetrics.classification.MulticlassConfusionMatrix, num_classes: 10, "
      "name: cm}]", "trainer.monitor=val_cm"],
     "trainer.monitor=val_cm: val_cm is an array at each eval (saved under evals/), not one number, so no eval is "
     "better than another by it; choose one of val_loss, val_accuracy"),
])
def test_bad_image_cls_settings_are_one_line_and_write_nothing(folder, tmp_path, settings, expected):
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", f"data.files=[{folder}]", *TRAIN, *settings, check=False)
    assert_one_line_error(proc, expected)
    assert not run_dir.exists()
