"""Documents → token ids, over `data.num_proc` processes, in the source's order, in bounded memory.

Each document becomes its tokens followed by the end-of-document token. Documents go out in chunks of about
`CHUNK_CHARS` characters; at most two chunks per process are in flight, and results come back in the order
they went out, so the token stream is the same for any number of processes. Each process tokenizes on one
core (`TOKENIZERS_PARALLELISM=false`): `num_proc` is what runs.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from typing import Iterable, Iterator

import numpy as np

from xtrain.data.textfile import Part

CHUNK_CHARS = 1 << 20  # text per task: about half a second of one core's work
LONG_CHARS = 1 << 20  # a longer document is tokenized in pieces cut after a newline, to bound memory

_tokenizer = None
_eos = 0
_dtype = "uint32"


def _init(tokenizer_json: str, eos: int, dtype: str) -> None:
    global _tokenizer, _eos, _dtype
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _tokenizer, _eos, _dtype = Tokenizer.from_str(tokenizer_json), eos, dtype


def pieces(doc: str) -> Iterator[str]:
    """The document, cut after the last newline before every `LONG_CHARS` (or at it, where there is none)."""
    start = 0
    while len(doc) - start > LONG_CHARS:
        cut = doc.rfind("\n", start, start + LONG_CHARS) + 1 or start + LONG_CHARS
        yield doc[start:cut]
        start = cut
    yield doc[start:]


def encode(docs: list[str]) -> np.ndarray:
    """The documents' token ids, each document followed by the end-of-document token (a `Part` goes on in the next)."""
    parts, ends = [], []
    for doc in docs:
        for piece in pieces(doc):
            parts.append(piece)
            ends.append(False)
        ends[-1] = not isinstance(doc, Part)  # (a piece of a text file that goes on in the next)
    ids: list[int] = []
    for encoding, end in zip(_tokenizer.encode_batch_fast(parts, add_special_tokens=False), ends):
        ids.extend(encoding.ids)
        if end:
            ids.append(_eos)
    return np.array(ids, dtype=_dtype)


def chunks(batches: Iterable[list[str]]) -> Iterator[list[str]]:
    """Batches of documents regrouped into chunks of at least `CHUNK_CHARS` characters (the last one less)."""
    chunk, size = [], 0
    for batch in batches:
        for doc in batch:
            chunk.append(doc)
            size += len(doc)
            if size >= CHUNK_CHARS:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def token_arrays(batches: Iterable[list[str]], tokenizer_json: str, eos: int, dtype: str,
                 num_proc: int) -> Iterator[np.ndarray]:
    """The documents of `batches` as arrays of token ids, in order."""
    yield from ordered_map(encode, chunks(batches), _init, (tokenizer_json, eos, dtype), num_proc)


def ordered_map(work, stream: Iterable, init, initargs: tuple, num_proc: int) -> Iterator:
    """`work(item)` for each item of `stream`, in order, over `num_proc` processes each set up by
    `init(*initargs)`, with at most two items per process in flight. A stream of one item is done here."""
    stream = iter(stream)
    first = list(itertools.islice(stream, 2))
    stream = itertools.chain(first, stream)
    if num_proc == 1 or len(first) < 2:
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        init(*initargs)
        try:
            for item in stream:
                yield work(item)
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
        return
    # spawn, not fork: the parent may have used the tokenizers library's threads (a fork would disable them)
    with multiprocessing.get_context("spawn").Pool(num_proc, init, initargs) as pool:
        pending: deque = deque()
        for item in stream:
            pending.append(pool.apply_async(work, (item,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
