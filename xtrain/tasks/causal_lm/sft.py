"""Instruction and chat examples (`data=sft`) prepared once into a cache entry, then read by every rank.

    <cache_dir>/prepared/<key>/  tokens.bin and mask.bin: every kept example's token ids and trained-token
                                 flags, one after another; examples.npy: where each example starts;
                                 train.npy / val.npy: each split's examples in order; train_items.npy /
                                 val_items.npy: where each item (a packed block, or one example) starts in them

Examples are rendered and masked in `data.num_proc` processes (chat.py), in the source's order. An example
longer than `data.block_size` keeps its first `block_size` tokens (counted, and said); one with no trained
token left is dropped (counted). Packing is best-fit decreasing (`pack`): blocks come out ~95 % full or more
where examples are short against the block. The entry goes through the same once-only, locked, renamed-into-place write as text data
(cache.build_once), keyed by the examples, the tokenizer, the template and every setting that shapes it.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from xtrain.config.schema import DataConfig, ModelConfig, TrainOn
from xtrain.core import machine
from xtrain.core.errors import ConfigError
from xtrain.tasks.causal_lm import chat
from xtrain.data.cache import VAL_SPLIT_SEED, build_once, node_name
from xtrain.tasks.causal_lm.corpus import PreparingProgress, pretrained_tokenizer
from xtrain.data.sources import TEXT, Counts, Files, cache_dir, file_format, load_hf, raw_batches, sha
from xtrain.tasks.causal_lm.tokenize import ordered_map

log = logging.getLogger("xtrain")

VERSION = "sft1"
TOKENS, MASK, EXAMPLES, META = "tokens.bin", "mask.bin", "examples.npy", "meta.json"
EXAMPLES_PER_TASK = 256
IGNORE = -100  # the label of a token the loss skips


@dataclass
class PreparedExamples:
    path: Path
    meta: dict
    tokenizer: object
    template: str
    fresh: bool

    def describe(self) -> str:
        m = self.meta
        unit = f"blocks of {m['block_size']} tokens" if m["packing"] else "examples"
        return (f"{m['examples']} examples, {m['tokens']} tokens ({m['trained_tokens']} trained), "
                f"{m['train_items']} train / {m['val_items']} val {unit}")

    def splits(self):
        pad = self.tokenizer.pad_token_id
        return Examples(self.path, self.meta, "train", pad), Examples(self.path, self.meta, "val", pad)


class ExampleSource:
    """Records of local files (record formats only) or of a dataset, with where each came from."""

    def __init__(self, data: DataConfig):
        self.shape = data.format
        if data.files:
            self.files = Files(data)
            for path in self.files.files:
                if file_format(path) is TEXT:
                    raise ConfigError(f"data.files: {path} is not a record file; data=sft reads examples from "
                                      ".jsonl, .json, .jsonl.gz, .json.gz, .parquet or .csv files")
            self.fingerprint, self.name, self.total_bytes = self.files.fingerprint, self.files.name, self.files.total_bytes
            self.ds = None
        else:
            self.ds = load_hf(data)
            self.fingerprint = sha("hf", data.name, str(data.config_name), data.split, self.ds._fingerprint)
            self.name, self.total_bytes = data.name, None

    def examples(self, counts: Counts) -> Iterator[tuple[str, list[dict]]]:
        """(where, messages) for each record, in order."""
        if self.ds is not None:
            yield from self._from_batches(self.ds.iter(batch_size=1000), self.name, "row", counts)
            return
        for path in self.files.files:
            yield from self._from_batches(raw_batches([path]), path, "record", counts)
            counts.bytes_done += os.path.getsize(path)

    def _from_batches(self, batches, name: str, unit: str, counts: Counts):
        shape, seen = None, 0
        for batch in batches:
            columns = list(batch)
            shape = shape or chat.detect(columns, self.shape, name)
            for i in range(len(batch[columns[0]])):
                where = f"{name} {unit} {seen + i + 1}"
                messages = chat.to_messages({c: batch[c][i] for c in columns}, shape, where)
                counts.documents += 1
                counts.chars += sum(len(m["content"]) for m in messages)
                yield where, messages
            seen += len(batch[columns[0]])


_renderer: chat.Renderer | None = None


def _init(name_or_path: str, template: str, train_on: str) -> None:
    global _renderer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(name_or_path))
    _renderer = chat.Renderer(tokenizer, template, TrainOn(train_on))


def _encode(examples: list[tuple[str, list[dict]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [_renderer.encode(messages, where) for where, messages in examples]


def prepare(data: DataConfig, model: ModelConfig) -> PreparedExamples:
    source = ExampleSource(data)
    tokenizer = pretrained_tokenizer(model)
    template = chat.template_of(tokenizer, data.chat_template, model.name_or_path)
    tokenizer.chat_template = template
    key = sha(source.fingerprint, sha(tokenizer.backend_tokenizer.to_str()), sha(template), str(data.block_size),
              str(data.val_fraction), str(data.max_val_tokens), data.format.value, data.train_on.value,
              str(data.packing), VERSION)
    final = Path(cache_dir(data), "prepared", key)

    def write(path: Path) -> None:
        write_entry(path, source, model.name_or_path, template, len(tokenizer), data)

    fresh = build_once(final, write, "the examples")
    return PreparedExamples(final, json.loads((final / META).read_text()), tokenizer, template, fresh)


def write_entry(path: Path, source: ExampleSource, name_or_path: str, template: str, vocab: int,
                data: DataConfig) -> None:
    block = data.block_size
    num_proc = data.num_proc or machine.usable_cores()
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    log.info("data: preparing %s on %s with %d process(es) into %s", source.name, node_name(), num_proc, path.parent)
    counts, progress = Counts(), PreparingProgress(source)
    lengths, trained, truncated, cut_tokens, no_answer = [], 0, 0, 0, 0
    stream = iter(source.examples(counts))
    tasks = iter(lambda: list(itertools.islice(stream, EXAMPLES_PER_TASK)), [])
    with open(path / TOKENS, "wb") as tokens_out, open(path / MASK, "wb") as mask_out:
        for encoded in ordered_map(_encode, tasks, _init, (name_or_path, template, data.train_on.value), num_proc):
            for ids, mask in encoded:
                if len(ids) > block:
                    truncated, cut_tokens = truncated + 1, cut_tokens + len(ids) - block
                    ids, mask = ids[:block], mask[:block]
                if not mask[1:].any():  # a first token is never trained: nothing precedes it in its sequence
                    no_answer += 1
                    continue
                tokens_out.write(ids.astype(dtype).tobytes())
                mask_out.write(mask.tobytes())
                lengths.append(len(ids))
                trained += int(mask[1:].sum())
            progress.update(counts, sum(len(ids) for ids, _ in encoded))
    progress.close()
    if len(lengths) < 2:
        raise ConfigError(
            f"data.train_on={data.train_on.value}: {len(lengths)} of the {counts.documents} examples of {source.name} "
            f"keep a token to train on after masking and truncation to data.block_size={block} ({no_answer} have no "
            "answer left); give examples with assistant turns, a larger data.block_size, or data.train_on=all"
        )
    lengths = np.asarray(lengths, dtype=np.int64)
    np.save(path / EXAMPLES, np.concatenate([[0], np.cumsum(lengths)]))
    val = split_off_val(lengths, data)
    train = np.setdiff1d(np.arange(len(lengths)), val)
    items = {}
    for name, order in (("train", train), ("val", val)):
        if data.packing:
            within, bounds = pack(lengths[order], block)
            order = order[within]
        else:
            bounds = np.arange(len(order) + 1)
        np.save(path / f"{name}.npy", order)
        np.save(path / f"{name}_items.npy", bounds)
        items[name] = len(bounds) - 1
    meta = {
        "version": VERSION, "dtype": dtype.name, "block_size": block, "packing": data.packing,
        "source": source.name, "records": counts.documents, "examples": len(lengths),
        "tokens": int(lengths.sum()), "trained_tokens": trained, "truncated": truncated, "cut_tokens": cut_tokens,
        "no_answer": no_answer, "train_examples": len(train), "val_examples": len(val),
        "train_items": items["train"], "val_items": items["val"],
        "fill": round(float(lengths[train].sum()) / (items["train"] * block), 4) if data.packing else None,
        "prepared_on": node_name(), "num_proc": num_proc,
    }
    (path / META).write_text(json.dumps(meta, indent=1) + "\n")
    cut = (f"; {truncated} longer than data.block_size={block} kept their first {block} tokens "
           f"({cut_tokens} tokens cut)") if truncated else ""
    dropped = f"; {no_answer} with no answer token dropped" if no_answer else ""
    layout = (f"packed into {items['train']} train / {items['val']} val blocks of {block} tokens "
              f"({meta['fill']:.0%} filled)") if data.packing else f"{len(train)} train / {len(val)} val, padded per batch"
    log.info("data: prepared %d examples (%d tokens, %d trained: %s) on %s, %s%s%s", len(lengths), meta["tokens"],
             trained, data.train_on.value, node_name(), layout, cut, dropped)


def split_off_val(lengths: np.ndarray, data: DataConfig) -> np.ndarray:
    """Held-out examples: a fixed-seed draw of `val_fraction` of them, up to `max_val_tokens` (at least one)."""
    n = len(lengths)
    drawn = np.random.default_rng(VAL_SPLIT_SEED).permutation(n)[: max(1, round(n * data.val_fraction))]
    within = int(np.searchsorted(np.cumsum(lengths[drawn]), data.max_val_tokens, side="right"))
    return np.sort(drawn[: min(max(1, within), n - 1)])


def pack(lengths: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: examples from the longest down, each into the block whose free space it fills most
    closely (a new block where none has room). Returns the examples' order (positions in `lengths`), block by
    block, and where each block starts in it. Deterministic; the loader shuffles the blocks."""
    free: dict[int, list[int]] = {}  # free tokens -> the blocks with that much room
    sizes: list[int] = []  # the distinct free sizes that have blocks, sorted
    blocks: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[i])
        at = bisect.bisect_left(sizes, length)
        if at == len(sizes):
            blocks.append([i])
            target, room = len(blocks) - 1, block - length
        else:
            size = sizes[at]
            target = free[size].pop()
            if not free[size]:
                del free[size], sizes[at]
            blocks[target].append(i)
            room = size - length
        if room:
            if room not in free:
                free[room] = []
                bisect.insort(sizes, room)
            free[room].append(target)
    order = np.fromiter((i for b in blocks for i in b), dtype=np.int64, count=len(lengths))
    return order, np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).astype(np.int64)


class Examples(Dataset):
    """One item per packed block (`input_ids`, `labels`, `position_ids` restarting at each example, padded to
    `block_size`) or per example (`input_ids`, `labels`; `PadToLongest` pads the batch)."""

    def __init__(self, path: Path, meta: dict, split: str, pad_id: int):
        self.path, self.dtype, self.block, self.packing = path, np.dtype(meta["dtype"]), meta["block_size"], meta["packing"]
        self.starts = np.load(path / EXAMPLES)
        self.order, self.bounds = np.load(path / f"{split}.npy"), np.load(path / f"{split}_items.npy")
        self.pad_id = pad_id
        self._fds = None

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def example(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        if self._fds is None:  # opened on first use, in the process that reads
            self._fds = os.open(self.path / TOKENS, os.O_RDONLY), os.open(self.path / MASK, os.O_RDONLY)
        start, end = int(self.starts[e]), int(self.starts[e + 1])
        size = self.dtype.itemsize
        ids = np.frombuffer(os.pread(self._fds[0], (end - start) * size, start * size), dtype=self.dtype)
        mask = np.frombuffer(os.pread(self._fds[1], end - start, start), dtype=np.uint8)
        return ids.astype(np.int64), mask

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(i)
        ids, labels, positions = [], [], []
        for e in self.order[self.bounds[i]:self.bounds[i + 1]]:
            tokens, mask = self.example(int(e))
            label = np.where(mask.astype(bool), tokens, IGNORE)
            label[0] = IGNORE  # nothing before it in its own sequence predicts it
            ids.append(tokens)
            labels.append(label)
            positions.append(np.arange(len(tokens)))
        if not self.packing:
            return {"input_ids": torch.from_numpy(ids[0]), "labels": torch.from_numpy(labels[0])}
        pad = self.block - sum(map(len, ids))
        ids.append(np.full(pad, self.pad_id))
        labels.append(np.full(pad, IGNORE))
        positions.append(np.arange(pad))  # padding is a sequence of its own: attended by no example
        return {key: torch.from_numpy(np.concatenate(parts).astype(np.int64))
                for key, parts in (("input_ids", ids), ("labels", labels), ("position_ids", positions))}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fds": None}

    def __del__(self, close=os.close) -> None:
        for fd in getattr(self, "_fds", None) or ():
            close(fd)
