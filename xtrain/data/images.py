"""Labelled images for `task=image_cls`, prepared once into a content-keyed cache entry of uint8 pixels.

Sources (`data.files`): an image folder (`<root>/<class name>/<image>.png`, classes in sorted order), `.npz` arrays
(`images`: N x H x W or N x H x W x C; `labels`: N class ids; optional `label_names`), or Parquet files with an
`image` column (encoded bytes, or datasets' `{bytes, path}`) and a label column. Every image is converted to
`task.num_channels` (1: grayscale, 3: RGB) and resized to `task.image_size` (or must share one size), kept as
N x C x H x W uint8; a fixed-seed `data.val_fraction` is held
out. Items are `(pixels, label)`: floats normalized to [-1, 1], augmented (train split, `task.augment`) by draws
seeded by (trainer.seed, epoch, index) alone, so a resumed run sees exactly the unbroken run's images.
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from xtrain.config.schema import DataConfig
from xtrain.config.task import TaskConfig
from xtrain.core.errors import ConfigError
from xtrain.data.cache import build_once, held_out, node_name, split_rows
from xtrain.data.sources import cache_dir, resolve_files, sha

log = logging.getLogger("xtrain")

VERSION = "images1"
PIXELS, LABELS, VAL, META = "pixels.npy", "labels.npy", "val.npy", "meta.json"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


@dataclass
class PreparedImages:
    path: Path
    meta: dict
    fresh: bool

    def describe(self) -> str:
        m = self.meta
        return (f"{m['records']} images of {m['channels']}x{m['size'][0]}x{m['size'][1]}, {m['num_labels']} classes, "
                f"{m['train']} train / {m['val']} val")

    def splits(self, augment: list[str], seed: int):
        return (Images(self.path, self.meta, "train", augment, seed), Images(self.path, self.meta, "val", [], seed))


def sources(data: DataConfig) -> list[str]:
    """Image folders, .npz files and Parquet files, as `data.files` names them."""
    found = []
    for pattern in data.files:
        path = os.path.expanduser(pattern)
        found += [path] if os.path.isdir(path) else resolve_files([pattern])
    for path in found:
        if not (os.path.isdir(path) or path.endswith((".npz", ".parquet"))):
            raise ConfigError(f"data.files: {path} is not an image folder, a .npz or a .parquet file")
    return found


def folder_files(root: str) -> list[tuple[str, str]]:
    """(path, class name) of every image under `root/<class>/`."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise ConfigError(f"data.files: {root} has no class folders (<root>/<class name>/<image>.png)")
    return [(os.path.join(root, name, file), name) for name in classes
            for file in sorted(os.listdir(os.path.join(root, name))) if file.lower().endswith(IMAGE_SUFFIXES)]


def fingerprint(paths: list[str]) -> str:
    stats = []
    for path in paths:
        files = [p for p, _ in folder_files(path)] if os.path.isdir(path) else [path]
        stats += [f"{f}:{os.path.getsize(f)}:{os.stat(f).st_mtime_ns}" for f in files]
    return sha("images", *stats)


def prepare(data: DataConfig, task: TaskConfig, names: list[str] | None = None, test: bool = False) -> PreparedImages:
    """The images prepared (or found prepared); `test`: every image held out (its `val` split), its class names
    mapped as the training data's (`names`)."""
    paths = sources(data)
    key = sha(fingerprint(paths), str(task.image_size), str(task.num_channels), task.label_column, str(data.val_fraction),
              VERSION, *(["test", *(names or [])] if test else []))
    final = Path(cache_dir(data), "prepared", key)
    fresh = build_once(final, lambda path: write_entry(path, paths, data, task, names, test), "the images")
    prepared = PreparedImages(final, json.loads((final / META).read_text()), fresh)
    if task.num_labels != prepared.meta["num_labels"] and not test:
        raise ConfigError(f"task.num_labels={task.num_labels}: the images have {prepared.meta['num_labels']} classes; "
                          f"use task.num_labels={prepared.meta['num_labels']}")
    return prepared


def decoded(blob: bytes, size: int | None, channels: int, where: str) -> np.ndarray:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(blob))
        image.load()
    except Exception as err:  # PIL raises several kinds for bytes it cannot read
        raise ConfigError(f"{where}: not an image PIL can read ({type(err).__name__}: {err})") from None
    image = image.convert("L" if channels == 1 else "RGB")
    if size is not None:
        image = image.resize((size, size), Image.BILINEAR)
    pixels = np.asarray(image, dtype=np.uint8)
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def arrays(path: str, size: int | None, channels: int) -> Iterator[tuple[np.ndarray, object]]:
    """(C x H x W uint8 pixels, label) of a .npz file; numbers other than uint8 are scaled to 0..255 over the file."""
    with np.load(path, allow_pickle=False) as found:
        if "images" not in found or "labels" not in found:
            raise ConfigError(f"data.files: {path} needs arrays named images and labels; it has {', '.join(found)}")
        images, labels = found["images"], found["labels"]
        names = list(found["label_names"]) if "label_names" in found else None
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4 and images.shape[-1] in (1, 3) and images.shape[1] not in (1, 3):
        images = images.transpose(0, 3, 1, 2)
    if images.ndim != 4 or len(images) != len(labels):
        raise ConfigError(f"data.files: {path}: images of shape {images.shape} and {len(labels)} labels; give N x H x W "
                          "or N x H x W x C images and N labels")
    if images.dtype != np.uint8:
        low, high = float(images.min()), float(images.max())
        images = np.round((images - low) / max(high - low, 1e-12) * 255).astype(np.uint8)
    if images.shape[1] != channels:  # grayscale repeated, or RGB to luminance (ITU-R 601, as PIL's "L")
        images = (np.repeat(images, 3, axis=1) if channels == 3 else
                  np.round(np.tensordot([0.299, 0.587, 0.114], images.astype(np.float32), axes=([0], [1]))
                           )[:, None].astype(np.uint8))
    for pixels, label in zip(images, labels):
        if size is not None and pixels.shape[1:] != (size, size):
            t = torch.nn.functional.interpolate(torch.from_numpy(pixels[None]).float(), size=(size, size),
                                                mode="bilinear", align_corners=False)
            pixels = t[0].round().clamp(0, 255).byte().numpy()
        yield pixels, (str(names[int(label)]) if names else int(label))


def parquet_rows(path: str, task: TaskConfig, size: int | None) -> Iterator[tuple[np.ndarray, object]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for column in ("image", task.label_column):
        if column not in table.column_names:
            setting = "task.label_column" if column == task.label_column else "image column"
            raise ConfigError(f"{setting} {column}: not a column of {path}; it has {', '.join(table.column_names)}")
    for i, (image, label) in enumerate(zip(table.column("image").to_pylist(), table.column(task.label_column).to_pylist())):
        blob = image.get("bytes") if isinstance(image, dict) else image
        yield decoded(blob, size, task.num_channels, f"{path} row {i + 1}"), label


def records(paths: list[str], task: TaskConfig) -> Iterator[tuple[np.ndarray, object]]:
    for path in paths:
        if os.path.isdir(path):
            for file, name in folder_files(path):
                with open(file, "rb") as f:
                    yield decoded(f.read(), task.image_size, task.num_channels, file), name
        elif path.endswith(".npz"):
            yield from arrays(path, task.image_size, task.num_channels)
        else:
            yield from parquet_rows(path, task, task.image_size)


def write_entry(path: Path, paths: list[str], data: DataConfig, task: TaskConfig, names_given: list[str] | None = None,
                test: bool = False) -> None:
    log.info("data: preparing %d image source(s) on %s into %s", len(paths), node_name(), path.parent)
    pixels, labels = [], []
    for image, label in records(paths, task):
        if pixels and image.shape != pixels[0].shape:
            raise ConfigError(f"task.image_size is empty: the images differ in size ({pixels[0].shape[1:]} and "
                              f"{image.shape[1:]}) or channels; set task.image_size=<pixels> to resize them all")
        pixels.append(image)
        labels.append(label)
    if len(pixels) < (1 if test else 2):
        raise ConfigError(f"data.files: {len(pixels)} image(s) found; classification needs at least 2 (train and val)")
    found = sorted(set(map(str, labels))) if any(isinstance(label, str) for label in labels) else None
    names = names_given or found
    if found and set(found) - set(names):
        raise ConfigError(f"data.test: a class {sorted(set(found) - set(names))[0]!r} the training data does not have "
                          f"(it has {', '.join(names[:10])})")
    ids = [names.index(str(label)) for label in labels] if names else [int(label) for label in labels]
    if min(ids) < 0:
        raise ConfigError(f"data.files: a label id is {min(ids)}; ids are 0..num_labels-1")
    n = len(ids)
    held = np.arange(n) if test else held_out(n, data.val_fraction)
    np.save(path / PIXELS, np.stack(pixels))
    np.save(path / LABELS, np.asarray(ids, dtype=np.int64))
    np.save(path / VAL, held)
    meta = {"records": n, "train": n - len(held), "val": len(held), "channels": int(pixels[0].shape[0]),
            "size": list(pixels[0].shape[1:]), "num_labels": len(names) if names else max(ids) + 1,
            "label_names": names, "prepared_on": node_name()}
    (path / META).write_text(json.dumps(meta, indent=2) + "\n")
    log.info("data: prepared %d images (%s classes): %d train / %d val", n, meta["num_labels"], meta["train"],
             meta["val"])


class Images(Dataset):
    """(pixels, label): C x H x W floats in [-1, 1]; the train split augmented per (seed, epoch, index)."""

    def __init__(self, path: Path, meta: dict, split: str, augment: list[str], seed: int):
        self.path, self.meta, self.augment, self.seed, self.epoch = path, meta, list(augment), seed, 0
        self.index = split_rows(np.load(path / VAL), meta["records"], split)
        self.labels = torch.from_numpy(np.load(path / LABELS)[self.index])
        self._pixels = None

    def set_epoch(self, epoch: int) -> None:
        """The epoch the loop is in: the augmentation's draws depend on it (the loop sets it)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        if self._pixels is None:  # memory-mapped on first use, in the process that reads
            self._pixels = np.load(self.path / PIXELS, mmap_mode="r")
        image = torch.from_numpy(np.array(self._pixels[int(self.index[i])])).float().div_(127.5).sub_(1.0)
        if self.augment:
            image = augmented(image, self.augment, torch.Generator().manual_seed(
                (self.seed * 1_000_003 + self.epoch) * 10_000_019 + int(self.index[i])))
        return image, self.labels[i]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pixels": None}


def augmented(image: torch.Tensor, augment: list[str], g: torch.Generator) -> torch.Tensor:
    """A random horizontal flip (`hflip`) and a random crop of the image padded by an eighth (`crop`)."""
    if "hflip" in augment and torch.rand((), generator=g) < 0.5:
        image = image.flip(-1)
    if "crop" in augment:
        h, w = image.shape[1:]
        pad = max(1, h // 8)
        padded = torch.nn.functional.pad(image[None], (pad, pad, pad, pad), mode="reflect")[0]
        top, left = (int(v) for v in torch.randint(0, 2 * pad + 1, (2,), generator=g))
        image = padded[:, top:top + h, left:left + w]
    return image
