"""A corpus prepared for a causal LM: a source's documents → a cache entry of token files, written once.

    <cache_dir>/tokenizers/<key>/  the byte-level BPE of a built-in model, trained on a sample of the corpus
    <cache_dir>/prepared/<key>/    tokens.bin: every document's tokens, each followed by EOS, cut to whole
                                   blocks (uint16 where the vocabulary fits, else uint32); val.npy: the
                                   held-out block numbers; meta.json: what was prepared, from what, how fast

The key covers the corpus (the files' paths, sizes and mtimes; a dataset's fingerprint), the tokenizer, the
block size and the split. An entry is written beside its final name under a lock and renamed into place: two
preparers never both write it (the second waits, then reuses it), and one that is killed leaves only a
`.tmp-` dir, which the next preparer removes before it starts again.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from xtrain.config.schema import DataConfig, ModelConfig, ModelSource
from xtrain.core import machine, memory
from xtrain.core.errors import ConfigError
from xtrain.data.cache import VAL_SPLIT_SEED, build_once, node_name
from xtrain.data.sources import Counts, cache_dir, open_source, sha
from xtrain.tasks.causal_lm.tokenize import token_arrays

log = logging.getLogger("xtrain")

VERSION = "2"  # of the entry's layout: part of every key
EOS = "<|endoftext|>"
TOKENS, VAL, META = "tokens.bin", "val.npy", "meta.json"
TOKENIZER_SAMPLE_CHARS = 32 << 20  # what a built-in model's tokenizer is trained on, at most
PROGRESS_EVERY_S = 10.0


@dataclass
class Prepared:
    path: Path  # the cache entry
    meta: dict
    load_tokenizer: Callable[[], object]
    fresh: bool  # prepared by this call (not found in the cache)

    @functools.cached_property
    def tokenizer(self):
        """A transformers fast tokenizer, loaded when first asked for (the launcher of a multi-process run finds
        a trained tokenizer's entry without importing transformers)."""
        return self.load_tokenizer()

    def describe(self) -> str:
        m = self.meta
        return (f"{m['documents']} documents, {m['tokens']} tokens, {m['train_blocks']} train / {m['val_blocks']} val "
                f"blocks of {m['block_size']} tokens")

    def splits(self):
        """The train and val sets: blocks read from the entry's token file."""
        from xtrain.tasks.causal_lm.blocks import Blocks

        tokens, val = self.path / TOKENS, self.path / VAL
        return Blocks(tokens, val, self.meta, "train"), Blocks(tokens, val, self.meta, "val")


def trained_tokenizer(source, model: ModelConfig, data: DataConfig) -> Path:
    """A byte-level BPE tokenizer trained on a bounded, evenly spread sample of the corpus (cached): its directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def write(path: Path) -> None:
        from transformers import PreTrainedTokenizerFast

        log.info("data: training a %d-token BPE tokenizer on up to %d MB of %s", model.vocab_size,
                 TOKENIZER_SAMPLE_CHARS >> 20, source.name)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=model.vocab_size, special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tok.train_from_iterator(source.sample(TOKENIZER_SAMPLE_CHARS), trainer)
        memory.give_back_freed()
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS).save_pretrained(path)

    final = Path(cache_dir(data), "tokenizers", sha(source.fingerprint, str(model.vocab_size), VERSION))
    build_once(final, write, "the tokenizer")
    return final


def load_trained_tokenizer(path: Path, block_size: int):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.model_max_length = block_size  # what the exported model's tokenizer says
    return tokenizer


def pretrained_tokenizer(model: ModelConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(model.name_or_path))
    if tokenizer.eos_token is None:
        raise ConfigError(f"model.name_or_path={model.name_or_path}: its tokenizer has no eos token to separate documents")
    if not tokenizer.is_fast:
        raise ConfigError(f"model.name_or_path={model.name_or_path}: its tokenizer has no fast (tokenizers) version, "
                          "which preparation needs; give a model directory with a tokenizer.json")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prepare(data: DataConfig, model: ModelConfig) -> Prepared:
    """The prepared data of this config: from the cache, or prepared now (once, whoever else asks at the same time)."""
    source = open_source(data)
    if model.source is ModelSource.pretrained:
        tokenizer = pretrained_tokenizer(model)
        tokenizer_json, eos = tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id
        load = lambda: tokenizer
    else:
        from tokenizers import Tokenizer

        path = trained_tokenizer(source, model, data)
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))  # what transformers' tokenizer wraps
        tokenizer_json, eos = backend.to_str(), backend.token_to_id(EOS)
        load = functools.cache(functools.partial(load_trained_tokenizer, path, data.block_size))
    key = sha(source.fingerprint, sha(tokenizer_json), str(eos), str(data.block_size),
              str(data.val_fraction), str(data.max_val_tokens), VERSION)
    final = Path(cache_dir(data), "prepared", key)

    def write(path: Path) -> None:
        write_entry(path, source, tokenizer_json, eos, len(load()), data)

    fresh = build_once(final, write, "the data")
    return Prepared(final, json.loads((final / META).read_text()), load, fresh)


def write_entry(path: Path, source, tokenizer_json: str, eos: int, vocab: int, data: DataConfig) -> None:
    """tokens.bin, val.npy and meta.json of a new entry, in `path`."""
    block = data.block_size
    num_proc = data.num_proc or machine.usable_cores()
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    log.info("data: preparing %s on %s with %d process(es) into %s", source.name, node_name(), num_proc, path.parent)
    counts, progress = Counts(), PreparingProgress(source)
    with open(path / TOKENS, "wb") as out:
        for ids in token_arrays(source.batches(counts), tokenizer_json, eos, dtype.name, num_proc):
            out.write(ids.tobytes())
            progress.update(counts, len(ids))
    progress.close()
    n_blocks = progress.tokens // block
    if n_blocks < 2:
        raise ConfigError(
            f"data.block_size={block}: the corpus yields {n_blocks} block(s) of {block} tokens, "
            "too few for a train/val split; use a smaller block size or more text"
        )
    os.truncate(path / TOKENS, n_blocks * block * dtype.itemsize)
    n_val = min(max(1, round(n_blocks * data.val_fraction)), max(1, data.max_val_tokens // block), n_blocks - 1)
    # without replacement, in memory of the sample's size where it is small against the whole
    val = np.sort(np.random.default_rng(VAL_SPLIT_SEED).choice(n_blocks, size=n_val, replace=False))
    np.save(path / VAL, val.astype(np.int64))
    seconds = time.time() - progress.start
    meta = {
        "version": VERSION, "dtype": dtype.name, "block_size": block, "tokens": n_blocks * block,
        "blocks": n_blocks, "train_blocks": n_blocks - n_val, "val_blocks": n_val, "source": source.name,
        "documents": counts.documents, "empty_records": counts.empty, "replaced_bytes": counts.replaced,
        "text_mb": round(counts.chars / 1e6, 3), "prepared_on": node_name(), "num_proc": num_proc,
        "seconds": round(seconds, 3),
    }
    (path / META).write_text(json.dumps(meta, indent=1) + "\n")
    skipped = f"; {counts.empty} empty or null record(s) skipped" if counts.empty else ""
    replaced = f"; {counts.replaced} undecodable byte(s) replaced" if counts.replaced else ""
    log.info("data: prepared %d documents (%.1f MB) into %d tokens in %.1f s on %s (%.2f MB/s, %.0f tokens/s): "
             "%d train / %d val blocks of %d tokens%s%s", counts.documents, counts.chars / 1e6, progress.tokens,
             seconds, node_name(), counts.chars / 1e6 / seconds, progress.tokens / seconds, n_blocks - n_val, n_val,
             block, skipped, replaced)


class PreparingProgress:
    """A log line every PROGRESS_EVERY_S (documents, MB, MB/s, tokens/s, ETA), and a bar on a terminal."""

    def __init__(self, source):
        from tqdm.auto import tqdm

        self.total, self.tokens = source.total_bytes, 0
        self.start = self.last = time.time()
        self.bar = tqdm(total=self.total, unit="B", unit_scale=True, desc="preparing", mininterval=1.0,
                        disable=not sys.stderr.isatty())

    def update(self, counts: Counts, tokens: int) -> None:
        self.tokens += tokens
        done = max(counts.bytes_done, counts.chars)  # whole files read, or the text read so far
        self.bar.update(done - self.bar.n)
        now = time.time()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last, elapsed = now, now - self.start
        rate = done / elapsed
        of = eta = ""
        if self.total:
            of = f" of {self.total / 1e6:.1f}"
            eta = f" | ETA {max(0.0, self.total - done) / rate / 60:.1f} min" if rate else ""
        log.info("data: %d documents | %.1f%s MB | %.2f MB/s | %.0f tokens/s%s", counts.documents, done / 1e6, of,
                 rate / 1e6, self.tokens / elapsed, eta)

    def close(self) -> None:
        self.bar.close()
