"""A text file, one document, read in bounded pieces, with what is not text found anywhere in it as it is read.

A piece holds at most `PIECE_CHARS` characters, cut after the last newline before that (or at it, in a longer
line): the cuts the tokenizer makes in any long document (tokenize.pieces), so the tokens are those of the whole
document. A piece the document goes on after is a `Part`: no end-of-document token follows it. Memory holds a piece
and a read, never the file, whatever its size or the length of its lines.

Bytes that are not text (NUL, or not UTF-8) are replaced by U+FFFD and counted. Where NULs pass `NUL_SHARE` of a read
(`READ_BYTES`, or the whole of a smaller file), or bytes that are not UTF-8 `UNDECODABLE_SHARE` of it (as the head's
check, sources.not_text), the file is binary data: refused, naming the file and the offset.
"""

from __future__ import annotations

import codecs
import gzip
import io
import logging
from typing import Iterator

from xtrain.core.errors import ConfigError

log = logging.getLogger("xtrain")

PIECE_CHARS = 1 << 20  # as tokenize.LONG_CHARS
READ_BYTES = 1 << 20
NUL_SHARE = 0.01  # of a read's bytes NUL: past it, the file is refused
UNDECODABLE_SHARE = 0.1  # of a read's bytes not UTF-8 (sources.not_text's share of a file's head)
_REPLACEMENT = "\ufffd"
_REPLACEMENT_BYTES = _REPLACEMENT.encode()


class Part(str):
    """A piece of a document that goes on in the next piece."""


def _first_bad(raw: bytes) -> int:
    """The offset in `raw` of its first byte that is not text (NUL, or not UTF-8)."""
    nul = raw.find(b"\0")
    decoded = raw.decode("utf-8", errors="surrogateescape")
    bad = next((i for i, char in enumerate(decoded) if "\udc80" <= char <= "\udcff"), None)
    undecodable = len(decoded[:bad].encode("utf-8", errors="surrogateescape")) if bad is not None else -1
    return min(o for o in (nul, undecodable) if o >= 0) if max(nul, undecodable) >= 0 else 0


def pieces(path: str, counts) -> Iterator[str]:
    """The file's text in pieces (`Part`s, then the last one a plain str); `counts`: `replaced` (bytes not text),
    `documents`, `chars`, `empty`, updated as it reads. Raises ConfigError where the file holds binary data."""
    opener = gzip.open if path.endswith(".gz") else open
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(errors="replace"), translate=True)
    buffer, offset, replaced, first_replaced = "", 0, 0, None
    try:
        f = opener(path, "rb")
    except OSError as err:
        raise ConfigError(f"data.files: {path} cannot be read ({err.strerror or err}); fix its permissions or remove it") from None
    with f:
        while True:
            try:
                raw = f.read(READ_BYTES)
            except (OSError, EOFError) as err:  # (a gzip file cut short, a disk error)
                raise ConfigError(f"data.files: {path} cannot be read at offset {offset:,} ({err}); fix or remove it") from None
            text = decoder.decode(raw, final=not raw)
            nul = text.count("\0")
            bad = nul + max(0, text.count(_REPLACEMENT) - raw.count(_REPLACEMENT_BYTES))
            if bad:
                if nul > NUL_SHARE * max(len(raw), 1) or bad > UNDECODABLE_SHARE * max(len(raw), 1):
                    raise ConfigError(
                        f"data.files: {path} holds binary data at offset {offset + _first_bad(raw):,} ({bad:,} of "
                        f"{len(raw):,} bytes from offset {offset:,} are NUL or not UTF-8); remove it or give text files"
                    )
                first_replaced = offset + _first_bad(raw) if first_replaced is None else first_replaced
                replaced += bad
                text = text.replace("\0", _REPLACEMENT)
            offset += len(raw)
            buffer += text
            while len(buffer) > PIECE_CHARS:
                cut = buffer.rfind("\n", 0, PIECE_CHARS) + 1 or PIECE_CHARS
                counts.chars += cut
                yield Part(buffer[:cut])
                buffer = buffer[cut:]
            if not raw:
                break
    counts.replaced += replaced
    if replaced:
        log.warning("data.files: %s: %d byte(s) that are not text (NUL or not UTF-8) replaced, the first at offset %d",
                    path, replaced, first_replaced)
    if not buffer and not offset:
        counts.empty += 1
        return
    counts.documents += 1
    counts.chars += len(buffer)
    yield buffer
