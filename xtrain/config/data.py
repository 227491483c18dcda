"""The `data` settings: where the text, examples or images come from and how they are cut into training
sequences."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import List, Optional

from xtrain.config.fields import setting
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
    """What every source reads: how its documents or examples become training blocks and the val split. Each option
    of the `data` group extends it with its own settings (`TextData`, `HfData`, `SftData`, `ImagesData`; `PydocData`
    has none): another source's setting is no such setting."""
    source: DataSource = DataSource.pydoc
    """Where the data comes from; each option of the `data` group sets it."""
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
    test: List[str] = field(default_factory=list)
    """`task=seq_cls` and `image_cls`: test files (as `files`), every record a test example, its labels mapped as the
    training data's; evaluated on the model `model/` keeps (`test_<name>` in result.json). (`task=custom`:
    `data.test._target_=...`.)"""

    NAMES = ()  # the sources this schema is the settings of

    def test_files(self) -> DataConfig:
        """`test`'s files, read as files of this source's kind are: images, or labelled records (those of a dataset
        by `name` too)."""
        common = {f.name: getattr(self, f.name) for f in fields(DataConfig) if f.name not in ("source", "test")}
        if self.source is DataSource.images:
            return ImagesData(**common, files=list(self.test))
        return TextData(**common, files=list(self.test))

    def __post_init__(self) -> None:
        if self.source not in self.NAMES:
            raise ConfigError(f"data.source={self.source.value}: set by the data option; use data={self.source.value}")
        positive("data.block_size", self.block_size)
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction={self.val_fraction}: must be between 0 and 1 (exclusive)")
        positive("data.max_val_tokens", self.max_val_tokens)
        if self.num_proc is not None:
            positive("data.num_proc", self.num_proc)


@dataclass
class PydocData(DataConfig):
    """data=pydoc: CPython's bundled documentation topics."""
    NAMES = (DataSource.pydoc,)


@dataclass
class TextData(DataConfig):
    """data=text: local files."""
    source: DataSource = DataSource.text
    files: List[str] = field(default_factory=list)
    """Files, directories or globs (formats: xtrain/data/sources.py)."""

    NAMES = (DataSource.text,)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.files:
            raise ConfigError("data.files is empty: data=text needs files or globs, e.g. data.files=[notes/*.txt]")


@dataclass
class HfData(DataConfig):
    """data=hf: a datasets hub name or a save_to_disk directory."""
    source: DataSource = DataSource.hf
    name: Optional[str] = None
    """A datasets hub name or a directory written by `save_to_disk`."""
    config_name: Optional[str] = None
    """The hub dataset's configuration, if it has several."""
    split: str = "train"
    """The dataset's split to read (the val split is drawn from it)."""

    NAMES = (DataSource.hf,)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.name:
            raise ConfigError("data.name is empty: data=hf needs a datasets hub name or a save_to_disk directory")


@dataclass
class SftData(DataConfig):
    """data=sft: instruction or chat examples (local files or a dataset), rendered with the model's chat template."""
    source: DataSource = DataSource.sft
    files: List[str] = field(default_factory=list)
    """Example files, directories or globs (JSONL, JSON, Parquet, CSV)."""
    name: Optional[str] = None
    """Or a datasets hub name or a directory written by `save_to_disk`."""
    config_name: Optional[str] = None
    """With `name`: the hub dataset's configuration, if it has several."""
    split: str = "train"
    """With `name`: the dataset's split to read (the val split is drawn from it)."""
    format: ExampleFormat = ExampleFormat.auto
    """The examples' shape: `messages`, `prompt_completion`, `alpaca`, or `auto` (from the columns)."""
    train_on: TrainOn = TrainOn.answers
    """Which tokens the loss covers: `answers` (assistant turns, the completion) or `all`."""
    packing: bool = True
    """Several examples per block of `block_size`, each attending only to itself (position ids restart);
    false: one example per sequence, padded to the longest in the batch."""
    chat_template: Optional[str] = None
    """A Jinja chat template (or a file holding one) for a tokenizer that has none, or to replace its own."""

    NAMES = (DataSource.sft,)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.files or self.name):
            raise ConfigError("data.files is empty: data=sft needs example files (data.files=[chat.jsonl]) "
                              "or a dataset (data.name=<hub name or save_to_disk dir>)")
        if not self.name:  # (examples from files: no dataset to pick a configuration or split of)
            for asked in changed_settings(self, "data", ["config_name", "split"]):
                raise ConfigError(f"{asked}: a setting of a dataset by name, and this run reads data.files; "
                                  "use data.name=<hub name or save_to_disk dir>, or drop it")


@dataclass
class ImagesData(DataConfig):
    """data=images: labelled images (task=image_cls)."""
    source: DataSource = DataSource.images
    files: List[str] = field(default_factory=list)
    """Image folders (`<root>/<class>/<image>.png`), .npz arrays or Parquet files."""

    NAMES = (DataSource.images,)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.files:
            raise ConfigError("data.files is empty: data=images needs image folders (<root>/<class>/<image>.png), "
                              ".npz or .parquet files, e.g. 'data.files=[photos]'")


OPTIONS: dict[DataSource, type[DataConfig]] = {name: schema for schema in (PydocData, TextData, HfData, SftData,
                                                                             ImagesData) for name in schema.NAMES}


def data_config(source: DataSource, **settings) -> DataConfig:
    """The settings of data source `source` (its option's schema)."""
    return OPTIONS[source](source=source, **settings)
