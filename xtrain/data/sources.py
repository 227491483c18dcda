"""Where documents come from, in a fixed order: CPython's bundled documentation (`pydoc`), local files
(`text`), a datasets hub name or `save_to_disk` directory (`hf`).

Record files are read through datasets' own builders, chosen by extension (`FORMATS`): a document per record, its
text in `data.text_column`. Any other file is one document, read in bounded pieces (textfile.py: UTF-8, stray bytes
that are not text replaced and counted, binary data refused). Records whose text is empty or null are skipped and
counted. Nothing is held whole in memory: a source yields its documents in batches.
"""

from __future__ import annotations

import functools
import glob
import gzip
import hashlib
import itertools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from xtrain.config.schema import DataConfig, DataSource
from xtrain.core.errors import ConfigError
from xtrain.data import textfile

log = logging.getLogger("xtrain")

# file name ending -> (datasets builder, its options); anything else is a text file, one document per file
FORMATS = {
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".jsonl.gz": ("json", {}),
    ".json.gz": ("json", {}),
    ".parquet": ("parquet", {}),
    ".csv": ("csv", {}),
}
TEXT = ("text", {})  # read by textfile.py
FILES_PER_READ = 64  # text files read by one builder call (a document each)
SAMPLE_FILES = 64  # files a tokenizer's training sample is drawn from, spread over the corpus
BATCH = 1000  # records per batch read


def cache_dir(data: DataConfig) -> str:
    """Where tokenizers, prepared tokens and hub datasets are cached (env XTRAIN_CACHE_DIR overrides)."""
    return os.path.expanduser(os.environ.get("XTRAIN_CACHE_DIR") or data.cache_dir)


def sha(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def file_format(path: str) -> tuple[str, dict]:
    name = path.lower()
    for ending, builder in FORMATS.items():
        if name.endswith(ending):
            return builder
    return TEXT


def resolve_files(patterns: list[str]) -> list[str]:
    """Expand files, directories (all files below) and globs; error if any pattern matches nothing."""
    files: list[str] = []
    for pattern in patterns:
        path = os.path.expanduser(pattern)
        if os.path.isdir(path):
            matched = sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
        else:
            matched = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not matched:
            raise ConfigError(f"data.files: '{pattern}' matches no file; give existing files, a directory or a glob")
        files.extend(matched)
    return files


@dataclass
class Counts:
    """What a pass over a source saw."""

    documents: int = 0
    empty: int = 0  # records whose text is empty or null: skipped
    replaced: int = 0  # undecodable bytes of text files, replaced by U+FFFD
    chars: int = 0
    bytes_done: int = 0  # of the source's files read completely (progress)


class Files:
    """Local files of any mix of formats, each read by its own builder, in the order `resolve_files` gives."""

    def __init__(self, data: DataConfig):
        self.column = data.text_column
        self.files = resolve_files(data.files)
        self.total_bytes = sum(os.path.getsize(f) for f in self.files)
        stats = [f"{f}:{os.path.getsize(f)}:{os.stat(f).st_mtime_ns}" for f in self.files]
        self.fingerprint = sha("files", self.column, *stats)
        self.name = f"{len(self.files)} file(s), {self.total_bytes / 1e6:.1f} MB"

    def reads(self) -> list[list[str]]:
        """The files in builder calls: text files grouped (their errors are not fatal), record files one each."""
        groups: list[list[str]] = []
        for path in self.files:
            previous = groups[-1] if groups else None
            if (previous and file_format(path) is TEXT and file_format(previous[0]) is TEXT
                    and len(previous) < FILES_PER_READ):
                previous.append(path)
            else:
                groups.append([path])
        return groups

    def batches(self, counts: Counts) -> Iterator[list[str]]:
        for group in self.reads():
            yield from self._read(group, counts)
            counts.bytes_done += sum(os.path.getsize(f) for f in group)

    def _read(self, group: list[str], counts: Counts) -> Iterator[list[str]]:
        builder = file_format(group[0])[0]
        if builder == "text":
            for path in group:
                for piece in textfile.pieces(path, counts):
                    yield [piece]
            return
        column = "text" if builder == "text" else self.column
        seen = 0
        for batch in raw_batches(group):
            if column not in batch:
                raise ConfigError(
                    f"data.text_column={self.column}: not a column of {group[0]}; it has {', '.join(batch)}"
                )
            texts = keep_texts(batch[column], counts, lambda i: f"{group[0]} record {seen + i + 1}", column)
            seen += len(batch[column])
            yield texts

    def sample(self, budget_chars: int) -> Iterator[str]:
        """The first documents of up to 64 files spread evenly over the corpus, an equal share of the budget
        from each."""
        k = min(SAMPLE_FILES, len(self.files))
        for path in (self.files[i * len(self.files) // k] for i in range(k)):
            yield from within(itertools.chain.from_iterable(self._read([path], Counts())), budget_chars // k)


def raw_batches(group: list[str]) -> Iterator[dict]:
    """The files' records in batches (column -> values), read by the builder of their format."""
    import datasets

    builder, options = file_format(group[0])
    try:
        ds = datasets.load_dataset(builder, data_files=group, split="train", streaming=True, **options)
        yield from builders_quiet(ds.iter(batch_size=BATCH))
    except ConfigError:
        raise
    except Exception as err:  # datasets and pyarrow raise many kinds for a file they cannot read
        raise unreadable(group, builder, err) from None


def within(texts: Iterator[str], budget_chars: int) -> Iterator[str]:
    """Texts until `budget_chars` characters are reached (the last one cut there)."""
    for text in texts:
        yield text[:budget_chars]
        budget_chars -= len(text)
        if budget_chars <= 0:
            return


def builders_quiet(batches: Iterator[dict]) -> Iterator[dict]:
    """The builders' batches, with their own error log lines held back: xtrain reports a bad file in one line."""
    logger = logging.getLogger("datasets.packaged_modules")
    it = iter(batches)
    while True:
        level = logger.level
        logger.setLevel(logging.CRITICAL)  # setLevel, not .level: it clears the loggers' cached levels
        try:
            batch = next(it)
        except StopIteration:
            return
        finally:
            logger.setLevel(level)
        yield batch


def keep_texts(values: list, counts: Counts, where, column: str) -> list[str]:
    """The non-empty texts of a batch; empty and null ones counted, anything that is not text an error."""
    texts = []
    for i, value in enumerate(values):
        if value is None or value == "":
            counts.empty += 1
        elif isinstance(value, str):
            texts.append(value)
        else:
            raise ConfigError(
                f"data.text_column={column}: {where(i)} holds {value!r:.40} ({type(value).__name__}), not text; "
                "choose the column that holds the text"
            )
    counts.documents += len(texts)
    counts.chars += sum(map(len, texts))
    return texts


def unreadable(group: list[str], builder: str, err: BaseException) -> ConfigError:
    """The one-line error for a file its builder cannot read: which file, and for JSON which line."""
    if builder == "json":
        for path in group:
            bad = bad_json_line(path)
            if bad:
                return ConfigError(f"data.files: {path} line {bad[0]}: not valid JSON ({bad[1]}); fix or remove it")
    empty = [path for path in group if os.path.getsize(path) == 0]
    if empty:
        return ConfigError(f"data.files: {empty[0]} is empty (no records); remove it or fill it")
    where = group[0] if len(group) == 1 else f"one of {group[0]} ... {group[-1]}"
    return ConfigError(f"data.files: {where} cannot be read as {builder} ({first_line(err)[:200]}); fix or remove it")


def bad_json_line(path: str) -> tuple[int, str] | None:
    """The first line of a JSON Lines file (or a JSON document) that does not parse, with the reason."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()[:1]
        f.seek(0)
        if head == "[":  # one JSON document, not JSON Lines
            try:
                json.load(f)
            except json.JSONDecodeError as err:
                return err.lineno, err.msg
            return None
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as err:
                    return number, err.msg
    return None


class Rows:
    """A datasets `Dataset` (memory-mapped Arrow, or in memory for pydoc): its text column, in row order."""

    def __init__(self, ds, column: str, fingerprint: str, name: str):
        """`ds`: the dataset, or what makes it when it is first read (a source found prepared is never read)."""
        self._ds, self.column, self.fingerprint, self.name = ds, column, fingerprint, name
        self.total_bytes = None
        if not callable(ds):
            self.ds  # noqa: B018 (its column checked now)

    @functools.cached_property
    def ds(self):
        ds = self._ds() if callable(self._ds) else self._ds
        if self.column not in ds.column_names:
            raise ConfigError(f"data.text_column={self.column}: not a column of {self.name}; choose one of "
                              f"{', '.join(ds.column_names)}")
        return ds.select_columns([self.column])

    def batches(self, counts: Counts) -> Iterator[list[str]]:
        where = lambda i: f"{self.name} row {i}"  # noqa: E731
        for batch in self.ds.iter(batch_size=BATCH):
            yield keep_texts(batch[self.column], counts, where, self.column)

    def sample(self, budget_chars: int) -> Iterator[str]:
        """Every k-th row (up to 10,000 rows spread over the dataset), until the budget."""
        n = len(self.ds)
        stride = max(1, n // 10_000)

        def texts() -> Iterator[str]:
            for start in range(0, n, stride * BATCH):
                rows = self.ds.select(range(start, min(n, start + stride * BATCH), stride))
                yield from keep_texts(rows[self.column], Counts(), str, self.column)

        yield from within(texts(), budget_chars)


def in_memory(texts: list[str]):
    import datasets

    return datasets.Dataset.from_dict({"text": texts})


def open_source(data: DataConfig) -> Files | Rows:
    """The configured source, ready to read (cheap: files are only listed, datasets memory-mapped)."""
    if data.source is DataSource.pydoc:
        from pydoc_data.topics import topics

        texts = [topics[key] for key in sorted(topics)]
        return Rows(lambda: in_memory(texts), "text", sha("pydoc", *texts), "pydoc topics")
    if data.source is DataSource.text:
        return Files(data)
    ds = load_hf(data)
    return Rows(ds, data.text_column, sha("hf", data.name, str(data.config_name), data.split, ds._fingerprint),
                data.name)


def is_local_dataset_dir(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))


def load_hf(data: DataConfig):
    import datasets

    name = os.path.expanduser(data.name)
    try:
        if is_local_dataset_dir(name):
            ds = datasets.load_from_disk(name)
        else:
            ds = datasets.load_dataset(name, data.config_name, cache_dir=os.path.join(cache_dir(data), "hub"))
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as err:
        raise ConfigError(
            f"data.name={data.name}: cannot be loaded ({first_line(err)}); "
            "give a save_to_disk directory, or a hub dataset that is cached or reachable"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if data.split not in ds:
            raise ConfigError(f"data.split={data.split}: not in {data.name}; choose one of {', '.join(ds)}")
        ds = ds[data.split]
    return ds


def check(data: DataConfig) -> None:
    """Cheap checks of the data source before anything is launched (on a login node too): the files exist and
    the first record file of each format has the text column; a hub dataset can be resolved."""
    if data.source is DataSource.text:
        source = Files(data)
        firsts = {}
        for path in source.files:
            firsts.setdefault(file_format(path)[0], path)
        for builder, path in firsts.items():
            if builder != "text":
                next(iter(source._read([path], Counts())), None)
        for path in (p for p in source.files if file_format(p) is TEXT):
            why = not_text(path)
            if why and why.startswith(UNREADABLE):
                raise ConfigError(f"data.files: {path} {why.removeprefix('it ')}; fix its permissions or remove it")
            if why:
                raise ConfigError(f"data.files: {path} is not text ({why}); give UTF-8 text files, or records "
                                  f"({', '.join(FORMATS)}) with data.text_column")
    elif data.source is DataSource.sft and data.files:
        Files(data)  # every pattern matches a file (the shapes are read while preparing)
    elif data.source in (DataSource.hf, DataSource.sft) and is_local_dataset_dir(data.name):
        check_saved_dataset(data)
    elif data.source in (DataSource.hf, DataSource.sft):
        if _looks_like_path(data.name):
            raise ConfigError(
                f"data.name={data.name}: no such directory; give a save_to_disk directory or a hub dataset name"
            )
        import datasets

        try:  # resolves the hub dataset (from the cache when offline) without loading it
            datasets.load_dataset_builder(data.name, data.config_name, cache_dir=os.path.join(cache_dir(data), "hub"))
        except Exception as err:  # datasets raises many kinds here; each means "cannot be loaded"
            raise ConfigError(
                f"data.name={data.name}: cannot be loaded ({first_line(err)[:200]}); "
                "give a save_to_disk directory, or a hub dataset that is cached or reachable"
            ) from None


SNIFF = 8192  # bytes of a text file's head that `not_text` reads
UNREADABLE = "it cannot be read"


def not_text(path: str) -> str | None:
    """Why a file read as text is none (binary: a NUL byte, or mostly bytes that are not UTF-8, in its head, with the
    first one's offset); None for text, where a stray undecodable byte is replaced and counted."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            head = f.read(SNIFF)
    except OSError as err:
        return f"{UNREADABLE} ({err.strerror or first_line(err)})"
    nul = head.find(b"\0")
    if nul >= 0:
        return f"a NUL byte at offset {nul}"
    decoded = head.decode("utf-8", errors="surrogateescape")
    bad = [i for i, char in enumerate(decoded) if "\udc80" <= char <= "\udcff"]
    if len(bad) > 0.1 * max(len(head), 1):
        first = len(decoded[:bad[0]].encode("utf-8", errors="surrogateescape"))
        return f"{len(bad)} of its first {len(head)} bytes are not UTF-8, the first at offset {first}"
    return None


def check_saved_dataset(data: DataConfig) -> None:
    """A local `data.name` is what `save_to_disk` writes (a Dataset, or a DatasetDict holding `data.split`), read
    from its index files only: a dry run refuses what the run would."""
    path = Path(os.path.expanduser(data.name))
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if data.split not in splits:
            raise ConfigError(f"data.split={data.split}: not in {data.name}; choose one of {', '.join(splits)}")
    elif not ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()):
        raise ConfigError(
            f"data.name={data.name}: not a dataset directory (no dataset_dict.json or state.json): "
            "give a directory that datasets' save_to_disk wrote, or a hub dataset name"
        )


def _looks_like_path(name: str) -> bool:
    """Hub names are `name` or `org/name`; anything else is meant as a directory."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1
