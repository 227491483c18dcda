"""The `data` settings: where the text, examples or images come from and how they are cut into training
sequences."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import List, Optional

from xtrain.config.fields import not_read_by, readers, setting
from xtrain.core.errors import ConfigError, changed_settings, positive


class DataSource(Enum):
    pydoc = "pydoc"  # CPython's bundled documentation topics: no download
    text = "text"  # local files (.txt, .jsonl, .json, .jsonl.gz, .json.gz, .parquet, .csv)
    hf = "hf"  # a datasets hub name or a save_to_disk directory
    sft = "sft"  # instruction or chat examples (local files or a dataset), rendered with the model's chat template
    images = "images"  # labelled images (task=image_cls): image folders, .npz arrays or Parquet files


class ExampleFormat(Enum):
    auto = "auto"  # from the columns
    messages = "messages"  # [{role, content}, ...] (OpenAI style; ShareGPT's {from, value} too)
    prompt_completion = "prompt_completion"
    alpaca = "alpaca"  # instruction, input (optional), output


class TrainOn(Enum):
    answers = "answers"  # the assistant turns (the completion, the output); the rest is context
    all = "all"  # every token of the rendered example





@dataclass
class DataConfig:
    source: DataSource = DataSource.pydoc
    """Where the data comes from; each option of the `data` group sets it."""
    files: List[str] = setting(factory=list, only=("text", "sft", "images"))
    """For `source=text`: files, directories or globs (formats: xtrain/data/sources.py)."""
    name: Optional[str] = setting(None, only=("hf", "sft"))
    """For `source=hf`: a datasets hub name or a directory written by `save_to_disk`."""
    config_name: Optional[str] = None
    """For `source=hf`: the hub dataset's configuration, if it has several."""
    split: str = "train"
    """For `source=hf`: the dataset's split to read (the val split is drawn from it)."""
    text_column: str = "text"
    """The column that holds each record's text (record formats and `source=hf`)."""
    block_size: int = 128
    """Tokens per training sequence; documents are packed into blocks of this length."""
    val_fraction: float = 0.05
    """Share of the blocks held out for evaluation, up to `max_val_tokens`."""
    max_val_tokens: int = 16384
    """Validation blocks hold at most this many tokens (at least one block): an eval's cost is bounded."""
    num_proc: Optional[int] = setting(None, free=True)
    """Processes that tokenize while preparing (default: every core of the machine that prepares)."""
    cache_dir: str = setting("~/.cache/xtrain", free=True)
    """Tokenizers and prepared tokens are cached here (env XTRAIN_CACHE_DIR overrides)."""
    # sft only -----------------------------------------------------------------------------
    format: ExampleFormat = setting(ExampleFormat.auto, only=("sft",))
    """The examples' shape: `messages`, `prompt_completion`, `alpaca`, or `auto` (from the columns)."""
    train_on: TrainOn = setting(TrainOn.answers, only=("sft",))
    """Which tokens the loss covers: `answers` (assistant turns, the completion) or `all`."""
    packing: bool = setting(True, only=("sft",))
    """Several examples per block of `block_size`, each attending only to itself (position ids restart);
    false: one example per sequence, padded to the longest in the batch."""
    chat_template: Optional[str] = setting(None, only=("sft",))
    """A Jinja chat template (or a file holding one) for a tokenizer that has none, or to replace its own."""
    test: List[str] = field(default_factory=list)
    """`task=seq_cls` and `image_cls`: test files (as `files`), every record a test example, its labels mapped as the
    training data's; evaluated on the model `model/` keeps (`test_<name>` in result.json). (`task=custom`:
    `data.test._target_=...`.)"""

    def _check_source_settings(self) -> None:
        """A setting of another source's, which this one would not read (`data.files` with data=pydoc: it trained on
        pydoc), is refused."""
        source = self.source
        unread = [*not_read_by(self, source.value), *(["config_name", "split"] if not self.name else [])]
        for asked in changed_settings(self, "data", unread):
            key = asked.partition("=")[0].removeprefix("data.")
            use = ("data=sft" if readers(self, key) == ("sft",) else "data=text (or data=sft, data=images)" if key == "files"
                   else "data=hf (or data=sft)" if key == "name" else "data.name (with data=hf or data=sft)")
            raise ConfigError(f"{asked}: not read by data={source.value}; use {use}, or drop it")

    def test_files(self) -> DataConfig:
        """`test`'s files, read as files of this source's kind are: images, or labelled records (those of a dataset
        by `name` too)."""
        source = DataSource.images if self.source is DataSource.images else DataSource.text
        return replace(self, source=source, files=list(self.test), test=[], name=None, config_name=None, split="train")

    def __post_init__(self) -> None:
        if self.source is DataSource.sft and not (self.files or self.name):
            raise ConfigError("data.files is empty: data=sft needs example files (data.files=[chat.jsonl]) "
                              "or a dataset (data.name=<hub name or save_to_disk dir>)")
        if self.source is DataSource.images and not self.files:
            raise ConfigError("data.files is empty: data=images needs image folders (<root>/<class>/<image>.png), "
                              ".npz or .parquet files, e.g. 'data.files=[photos]'")
        if self.source is DataSource.text and not self.files:
            raise ConfigError("data.files is empty: data=text needs files or globs, e.g. data.files=[notes/*.txt]")
        if self.source is DataSource.hf and not self.name:
            raise ConfigError("data.name is empty: data=hf needs a datasets hub name or a save_to_disk directory")
        self._check_source_settings()
        positive("data.block_size", self.block_size)
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction={self.val_fraction}: must be between 0 and 1 (exclusive)")
        positive("data.max_val_tokens", self.max_val_tokens)
        if self.num_proc is not None:
            positive("data.num_proc", self.num_proc)
