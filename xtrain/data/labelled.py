"""Labelled records for sequence classification (`task=seq_cls`), prepared once into a content-keyed cache entry.

Each record's text (or text pair) is tokenized with the model's tokenizer, truncated to `data.block_size` tokens,
and stored with its label: an int id, a name (names are mapped to ids in sorted order and recorded), a list of
either (multi-label), or a number (regression). A fixed-seed `data.val_fraction` of the records is held out. Each
rank then reads items from memory-mapped arrays; sft.PadToLongest pads a batch to its longest example.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from xtrain.config.schema import DataConfig, DataSource, ModelConfig
from xtrain.config.task import Problem, TaskConfig
from xtrain.core.errors import ConfigError
from xtrain.data.cache import build_once, held_out, node_name, split_rows
from xtrain.data.sources import TEXT, Files, cache_dir, file_format, load_hf, raw_batches, sha

log = logging.getLogger("xtrain")

VERSION = "labelled1"
IDS, STARTS, TYPES, LABELS, LABEL_STARTS, VAL, META = ("ids.npy", "starts.npy", "types.npy", "labels.npy",
                                                       "label_starts.npy", "val.npy", "meta.json")
RECORDS_PER_CALL = 1000


def tokenizer_of(model: ModelConfig):
    """The model's tokenizer, with a pad token (a decoder's eos where it has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(model.name_or_path))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"model.name_or_path={model.name_or_path}: its tokenizer has neither a pad nor an eos "
                              "token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass
class PreparedRecords:
    path: Path
    meta: dict
    tokenizer: object
    fresh: bool

    def describe(self) -> str:
        m = self.meta
        names = f", labels {', '.join(m['label_names'])}" if m["label_names"] else ""
        return f"{m['records']} records ({m['tokens']} tokens), {m['train']} train / {m['val']} val{names}"

    def splits(self, num_labels: int):
        return Records(self.path, self.meta, "train", num_labels), Records(self.path, self.meta, "val", num_labels)


class Source:
    """The records of local files (JSONL, CSV, Parquet, ...) or of a dataset, in order, with where each is from."""

    def __init__(self, data: DataConfig):
        if data.source is DataSource.text:
            self.files = Files(data)
            for path in self.files.files:
                if file_format(path) is TEXT:
                    raise ConfigError(f"data.files: {path} is not a record file; task=seq_cls reads labelled records "
                                      "from .jsonl, .json, .csv or .parquet files")
            self.fingerprint, self.name = self.files.fingerprint, self.files.name
        else:
            self.files = None
            self.ds = load_hf(data)
            self.fingerprint = sha("hf", data.name, str(data.config_name), data.split, self.ds._fingerprint)
            self.name = data.name

    def batches(self) -> Iterator[tuple[str, dict]]:
        if self.files is None:
            yield from ((self.name, batch) for batch in self.ds.iter(batch_size=RECORDS_PER_CALL))
            return
        for path in self.files.files:
            yield from ((path, batch) for batch in raw_batches([path]))


def entry(data: DataConfig, model: ModelConfig, task: TaskConfig, names: list[str] | None = None,
          test: bool = False) -> tuple[Source, object, Path]:
    """(the records, the tokenizer, where their prepared entry is) for these settings."""
    source = Source(data)
    tokenizer = tokenizer_of(model)
    key = sha(source.fingerprint, sha(tokenizer.backend_tokenizer.to_str()) if tokenizer.is_fast else model.name_or_path,
              data.text_column, str(task.text_pair_column), task.label_column, task.problem.value, str(data.block_size),
              str(data.val_fraction), VERSION, *(["test", *(names or [])] if test else []))
    return source, tokenizer, Path(cache_dir(data), "prepared", key)


def check_unprepared(data: DataConfig, model: ModelConfig, task: TaskConfig) -> None:
    """Before anything is prepared (on the driver): where the records are not prepared yet, their labels alone are
    read, so that a `task.num_labels` they do not fit is refused before any tokenizing or caching."""
    source, _, final = entry(data, model, task)
    if final.exists() or task.problem is Problem.regression:
        return
    names, numbers = set(), []
    for where, batch in source.batches():
        columns_of(where, batch, data, task)
        for value in batch[task.label_column]:
            for one in label_values(value, task, where):
                (names.add(one) if isinstance(one, str) else numbers.append(one))
    check_labels({"label_names": sorted(names) if names and not numbers else None,
                  "label_range": [int(min(numbers)), int(max(numbers))] if numbers and not names else None}, task)


def prepare(data: DataConfig, model: ModelConfig, task: TaskConfig, names: list[str] | None = None,
            test: bool = False) -> PreparedRecords:
    """The records prepared (or found prepared); `test`: every record held out (its `val` split), its label names
    mapped as the training data's (`names`)."""
    source, tokenizer, final = entry(data, model, task, names, test)
    fresh = build_once(final, lambda path: write_entry(path, source, tokenizer, data, task, names, test),
                       "the labelled records")
    prepared = PreparedRecords(final, json.loads((final / META).read_text()), tokenizer, fresh)
    check_labels(prepared.meta, task)
    return prepared


def columns_of(where: str, batch: dict, data: DataConfig, task: TaskConfig) -> None:
    for setting, column in (("data.text_column", data.text_column), ("task.text_pair_column", task.text_pair_column),
                            ("task.label_column", task.label_column)):
        if column is not None and column not in batch:
            raise ConfigError(f"{setting}={column}: not a column of {where}; it has {', '.join(batch)}")


def write_entry(path: Path, source: Source, tokenizer, data: DataConfig, task: TaskConfig,
                names_given: list[str] | None = None, test: bool = False) -> None:
    log.info("data: preparing %s on %s into %s", source.name, node_name(), path.parent)
    ids, starts, types, labels, label_starts = [], [0], [], [], [0]
    names: set[str] = set()
    kinds: set[type] = set()
    truncated, seen = 0, 0
    pair = task.text_pair_column is not None
    for where, batch in source.batches():
        columns_of(where, batch, data, task)
        texts, pairs = batch[data.text_column], batch[task.text_pair_column] if pair else None
        for i, text in enumerate(texts):
            if not isinstance(text, str) or (pair and not isinstance(pairs[i], str)):
                raise ConfigError(f"{where} record {seen + i + 1}: its text is {text!r}, not a string")
        encoded = tokenizer(texts, pairs, truncation=True, max_length=data.block_size, return_token_type_ids=pair)
        full = tokenizer(texts, pairs, truncation=False)["input_ids"] if tokenizer.is_fast else encoded["input_ids"]
        for i, row in enumerate(encoded["input_ids"]):
            truncated += len(full[i]) > len(row)
            ids.extend(row)
            starts.append(len(ids))
            if pair:
                types.extend(encoded["token_type_ids"][i])
            value = batch[task.label_column][i]
            for one in label_values(value, task, f"{where} record {seen + i + 1}"):
                kinds.add(type(one))
                if isinstance(one, str):
                    names.add(one)
                labels.append(one)
            label_starts.append(len(labels))
        seen += len(texts)
    if kinds == {str}:
        order = names_given or sorted(names)
        unknown = sorted(names - set(order))
        if unknown:
            raise ConfigError(f"data.test: a label {unknown[0]!r} the training data does not have (it has "
                              f"{', '.join(order[:10])})")
        labels = [order.index(name) for name in labels]
    elif str in kinds:
        raise ConfigError(f"task.label_column={task.label_column}: mixes names and numbers; give one kind")
    n = len(starts) - 1
    if n < (1 if test else 2):
        raise ConfigError(f"data: {source.name} holds {n} record(s); classification needs at least 2 (train and val)")
    held = np.arange(n) if test else held_out(n, data.val_fraction)
    np.save(path / IDS, np.asarray(ids, dtype=np.int32))
    np.save(path / STARTS, np.asarray(starts, dtype=np.int64))
    if pair:
        np.save(path / TYPES, np.asarray(types, dtype=np.uint8))
    float_labels = task.problem is Problem.regression
    np.save(path / LABELS, np.asarray(labels, dtype=np.float32 if float_labels else np.int64))
    np.save(path / LABEL_STARTS, np.asarray(label_starts, dtype=np.int64))
    np.save(path / VAL, held)
    numbers = [] if float_labels or kinds == {str} else labels
    meta = {"records": n, "train": n - len(held), "val": len(held), "tokens": len(ids), "truncated": truncated,
            "pair": pair, "problem": task.problem.value, "label_names": order if kinds == {str} else None,
            "label_range": [int(min(numbers)), int(max(numbers))] if numbers else None, "prepared_on": node_name()}
    (path / META).write_text(json.dumps(meta, indent=2) + "\n")
    cut = f"; {truncated} cut to {data.block_size} tokens" if truncated else ""
    log.info("data: prepared %d records (%d tokens%s): %d train / %d val", n, len(ids), cut, meta["train"], meta["val"])


def label_values(value, task: TaskConfig, where: str) -> list:
    """A record's label as a list of ids, names or (regression) one number."""
    if task.problem is Problem.multi_label:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: task.problem=multi_label needs a list of classes per record; found {value!r}")
        values = list(value)
    else:
        values = [value]
    for one in values:
        if task.problem is Problem.regression:
            if isinstance(one, bool) or not isinstance(one, (int, float)) or not math.isfinite(one):
                raise ConfigError(f"{where}: task.problem=regression needs a number as its label; found {one!r}")
        elif isinstance(one, bool) or not isinstance(one, (int, str)):
            raise ConfigError(f"{where}: a label is an int class id or a class name; found {one!r}")
    return values


def check_labels(meta: dict, task: TaskConfig) -> None:
    """`task.num_labels` fits the data's labels."""
    if task.problem is Problem.regression:
        return
    names, found = meta["label_names"], meta["label_range"]
    if names is not None and len(names) != task.num_labels:
        raise ConfigError(f"task.num_labels={task.num_labels}: the data has {len(names)} label names "
                          f"({', '.join(names[:10])}); use task.num_labels={len(names)}")
    if found is not None and (found[0] < 0 or found[1] >= task.num_labels):
        raise ConfigError(f"task.num_labels={task.num_labels}: the data's label ids run {found[0]}..{found[1]}; ids are "
                          f"0..num_labels-1: use task.num_labels={found[1] + 1}" if found[0] >= 0 else
                          f"task.num_labels={task.num_labels}: the data has a negative label id {found[0]}")


class Records(Dataset):
    """One record per item: `input_ids` (and `token_type_ids` for pairs) and its `labels`."""

    def __init__(self, path: Path, meta: dict, split: str, num_labels: int):
        self.path, self.meta, self.num_labels = path, meta, num_labels
        self.index = split_rows(np.load(path / VAL), meta["records"], split)
        self._arrays = None

    def arrays(self) -> dict:
        if self._arrays is None:  # memory-mapped on first use, in the process that reads
            names = [IDS, STARTS, LABELS, LABEL_STARTS] + ([TYPES] if self.meta["pair"] else [])
            self._arrays = {name: np.load(self.path / name, mmap_mode="r") for name in names}
        return self._arrays

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        a, r = self.arrays(), int(self.index[i])
        start, end = int(a[STARTS][r]), int(a[STARTS][r + 1])
        item = {"input_ids": torch.from_numpy(a[IDS][start:end].astype(np.int64))}
        if self.meta["pair"]:
            item["token_type_ids"] = torch.from_numpy(a[TYPES][start:end].astype(np.int64))
        values = a[LABELS][int(a[LABEL_STARTS][r]):int(a[LABEL_STARTS][r + 1])]
        if self.meta["problem"] == Problem.multi_label.value:
            label = torch.zeros(self.num_labels, dtype=torch.float32)
            label[torch.from_numpy(values.astype(np.int64))] = 1.0
        elif self.meta["problem"] == Problem.regression.value:
            label = torch.tensor(float(values[0]), dtype=torch.float32)
        else:
            label = torch.tensor(int(values[0]), dtype=torch.long)
        item["labels"] = label
        return item

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}
