"""Text corpora → tokenized, packed, cached train/val splits.

Sources: CPython's bundled documentation (`pydoc`), local text files (`text`), and a
datasets hub name or `save_to_disk` directory (`hf`). Built-in models get a byte-level
BPE tokenizer trained on the corpus; pretrained models bring their own. Both the
tokenizer and the packed splits are cached under `data.cache_dir`, keyed by content.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile
import logging
from dataclasses import dataclass
from pathlib import Path

from xtrain.config import DataConfig, DataSource, ModelConfig, ModelSource, cache_dir
from xtrain.errors import ConfigError

log = logging.getLogger("xtrain")

EOS = "<|endoftext|>"
VAL_SPLIT_SEED = 1234  # the split is a property of the data, not of trainer.seed


@dataclass
class Corpus:
    texts: "datasets.Dataset"  # noqa: F821 - one column, `text`
    fingerprint: str


def _sha(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def resolve_files(patterns: list[str]) -> list[str]:
    """Expand files, directories (all files below) and globs; error if any pattern matches nothing."""
    files: list[str] = []
    for pattern in patterns:
        path = os.path.expanduser(pattern)
        if os.path.isdir(path):
            matched = sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
        else:
            matched = sorted(glob.glob(path, recursive=True))
        if not matched:
            raise ConfigError(f"data.files: '{pattern}' matches no file; give existing text files, a directory or a glob")
        files.extend(matched)
    return files


def is_local_dataset_dir(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))


def check(data: DataConfig) -> None:
    """Cheap checks of the data source before anything is launched."""
    if data.source is DataSource.text:
        resolve_files(data.files)
    elif data.source is DataSource.hf and not is_local_dataset_dir(data.name):
        if _looks_like_path(data.name):
            raise ConfigError(
                f"data.name={data.name}: no such directory; give a save_to_disk directory or a hub dataset name"
            )
        import datasets

        try:  # resolves the hub dataset (from the cache when offline) without loading it
            datasets.load_dataset_builder(data.name, data.config_name, cache_dir=os.path.join(cache_dir(data), "hub"))
        except Exception as err:  # datasets raises many kinds here; each means "cannot be loaded"
            raise ConfigError(
                f"data.name={data.name}: cannot be loaded ({_first_line(err)[:200]}); "
                "give a save_to_disk directory, or a hub dataset that is cached or reachable"
            ) from None


def _looks_like_path(name: str) -> bool:
    """Hub names are `name` or `org/name`; anything else is meant as a directory."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def load_corpus(data: DataConfig) -> Corpus:
    import datasets

    if data.source is DataSource.pydoc:
        from pydoc_data.topics import topics

        texts = [topics[key] for key in sorted(topics)]
        return Corpus(datasets.Dataset.from_dict({"text": texts}), _sha("pydoc", *texts))

    if data.source is DataSource.text:
        files = resolve_files(data.files)
        identity = [f"{f}:{os.path.getsize(f)}:{os.path.getmtime(f)}" for f in files]
        # One document per file, so packing keeps documents whole and in order.
        texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
        return Corpus(datasets.Dataset.from_dict({"text": texts}), _sha("text", *identity))

    name = os.path.expanduser(data.name)
    try:
        if is_local_dataset_dir(name):
            ds = datasets.load_from_disk(name)
        else:
            ds = datasets.load_dataset(name, data.config_name, cache_dir=os.path.join(cache_dir(data), "hub"))
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as err:
        raise ConfigError(
            f"data.name={data.name}: cannot be loaded ({_first_line(err)}); "
            "give a save_to_disk directory, or a hub dataset that is cached or reachable"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if data.split not in ds:
            raise ConfigError(f"data.split={data.split}: not in {data.name}; choose one of {', '.join(ds)}")
        ds = ds[data.split]
    if data.text_column not in ds.column_names:
        raise ConfigError(
            f"data.text_column={data.text_column}: not a column of {data.name}; choose one of {', '.join(ds.column_names)}"
        )
    ds = ds.select_columns([data.text_column])
    if data.text_column != "text":
        ds = ds.rename_column(data.text_column, "text")
    return Corpus(ds, _sha("hf", name, str(data.config_name), data.split, ds._fingerprint))


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _atomic_dir(final: Path, write) -> Path:
    """Write a directory beside `final` and rename it into place, so readers never see half of it."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    try:
        write(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def train_tokenizer(corpus: Corpus, model: ModelConfig, data: DataConfig):
    """A byte-level BPE tokenizer trained on the corpus (cached): no download, any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def write(path: Path) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=model.vocab_size,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(corpus.texts["text"], trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)
        fast.model_max_length = data.block_size
        fast.save_pretrained(path)

    final = Path(cache_dir(data), "tokenizers", _sha(corpus.fingerprint, str(model.vocab_size), str(data.block_size)))
    return PreTrainedTokenizerFast.from_pretrained(_atomic_dir(final, write))


def load_pretrained_tokenizer(model: ModelConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(model.name_or_path))
    if tokenizer.eos_token is None:
        raise ConfigError(f"model.name_or_path={model.name_or_path}: its tokenizer has no eos token to separate documents")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_for(corpus: Corpus, model: ModelConfig, data: DataConfig):
    if model.source is ModelSource.pretrained:
        return load_pretrained_tokenizer(model)
    return train_tokenizer(corpus, model, data)


def pack(corpus: Corpus, tokenizer, data: DataConfig):
    """Tokenize, join documents with EOS, cut into `block_size` blocks, split train/val (cached)."""
    import datasets

    block = data.block_size
    tok_id = _sha(json.dumps(tokenizer.get_vocab(), sort_keys=True), str(tokenizer.eos_token_id))
    key = _sha(corpus.fingerprint, tok_id, str(block), str(data.val_fraction), "v1")

    def write(path: Path) -> None:
        eos = tokenizer.eos_token_id
        log.info("tokenizing %d documents into blocks of %d tokens (cached for later runs)", len(corpus.texts), block)
        datasets.disable_progress_bars()

        def to_blocks(batch):
            ids: list[int] = []
            # whole documents, longer than a block by design: no "sequence length is longer" warning
            for seq in tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]:
                ids.extend(seq)
                ids.append(eos)
            usable = len(ids) // block * block
            return {"input_ids": [ids[i : i + block] for i in range(0, usable, block)]}

        blocks = corpus.texts.map(
            to_blocks, batched=True, batch_size=1000, remove_columns=corpus.texts.column_names,
            desc="tokenizing", new_fingerprint=key,
        )
        if len(blocks) < 2:
            raise ConfigError(
                f"data.block_size={block}: the corpus yields {len(blocks)} block(s) of {block} tokens, "
                "too few for a train/val split; use a smaller block size or more text"
            )
        n_val = max(1, round(len(blocks) * data.val_fraction))
        split = blocks.train_test_split(test_size=n_val, seed=VAL_SPLIT_SEED, shuffle=True)
        datasets.DatasetDict(train=split["train"], val=split["test"]).flatten_indices().save_to_disk(str(path))

    final = Path(cache_dir(data), "packed", key)
    splits = datasets.load_from_disk(str(_atomic_dir(final, write)))
    return splits["train"].with_format("torch"), splits["val"].with_format("torch")
