"""A plain-text file read in bounded pieces, binary data found anywhere in it (data/textfile.py)."""

from __future__ import annotations

import gzip
import logging
import os
import random
import resource
import subprocess
import sys
import tracemalloc

import pytest

from conftest import REPO, assert_one_line_error
from xtrain.core.errors import ConfigError
from xtrain.data import sources, textfile
from xtrain.data.sources import Counts


def read(path) -> tuple[list[str], Counts]:
    counts = Counts()
    return list(textfile.pieces(str(path), counts)), counts


def test_a_long_document_comes_in_pieces_cut_as_the_tokenizer_cuts_it(tmp_path, monkeypatch):
    monkeypatch.setattr(textfile, "PIECE_CHARS", 1000)
    monkeypatch.setattr(textfile, "READ_BYTES", 333)  # reads that split lines, "\r\n" pairs and UTF-8 sequences
    rng = random.Random(0)
    lines = ["".join(rng.choice("abcé€ ") for _ in range(rng.randrange(0, 1500))) for _ in range(40)]
    text = "\r\n".join(lines) + "\n"
    (tmp_path / "a.txt").write_bytes(text.encode())
    pieces, counts = read(tmp_path / "a.txt")
    whole = text.replace("\r\n", "\n")  # (universal newlines, as a text file opened in Python reads)
    assert "".join(pieces) == whole and counts.chars == len(whole) and counts.documents == 1
    assert all(isinstance(p, textfile.Part) for p in pieces[:-1]) and not isinstance(pieces[-1], textfile.Part)
    assert max(map(len, pieces)) <= 1000
    from xtrain.tasks.causal_lm import tokenize

    monkeypatch.setattr(tokenize, "LONG_CHARS", 1000)
    assert list(tokenize.pieces(whole)) == pieces  # the same cuts as the whole document's: the same tokens


def test_the_tokens_of_a_file_read_in_pieces_are_the_whole_documents(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from xtrain.tasks.causal_lm import tokenize

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_tokens(list("abcdefgh \n"))
    monkeypatch.setattr(textfile, "PIECE_CHARS", 64)
    monkeypatch.setattr(tokenize, "LONG_CHARS", 64)
    text = "".join(random.Random(1).choice("abcdefgh \n") for _ in range(5000))
    (tmp_path / "a.txt").write_text(text)
    tokenize._init(tok.to_str(), 0, "uint32")
    assert tokenize.encode(read(tmp_path / "a.txt")[0]).tolist() == tokenize.encode([text]).tolist()
    assert tokenize.encode(read(tmp_path / "a.txt")[0]).tolist()[-1] == 0  # one end-of-document token, at the end
    assert tokenize.encode(read(tmp_path / "a.txt")[0]).tolist().count(0) == 1


def test_memory_holds_a_piece_not_the_file_one_huge_line_included(tmp_path):
    path = tmp_path / "line.txt"
    with open(path, "w") as f:
        for _ in range(24):
            f.write("word " * 200_000)  # 24 MB, not one newline
    tracemalloc.start()
    try:
        total = sum(len(p) for p in textfile.pieces(str(path), Counts()))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == 24_000_000
    assert peak < 12 * textfile.PIECE_CHARS  # a read, a piece and the buffer: not the 24 MB file


def test_the_tokenizers_sample_keeps_its_budget_whatever_the_documents(tmp_path):
    (tmp_path / "line.txt").write_text("x" * 3_000_000)
    sample = list(sources.within(iter(read(tmp_path / "line.txt")[0]), 1_500_000))
    assert sum(map(len, sample)) == 1_500_000


@pytest.mark.parametrize("case,offset", [("nuls", 200_000), ("random", 150_000), ("gzip_nuls", 200_000)])
def test_binary_data_anywhere_in_a_file_is_refused_with_its_offset(tmp_path, case, offset):
    head = b"plain text, line after line\n" * 10_000  # 280,000 bytes
    rng = random.Random(2)
    if case == "random":
        data = head[:offset] + bytes(rng.randrange(256) for _ in range(1 << 20))
    else:
        data = head[:offset] + b"\0" * 65536 + head
    path = tmp_path / ("f.txt.gz" if case.startswith("gzip") else "f.txt")
    path.write_bytes(gzip.compress(data) if case.startswith("gzip") else data)
    assert sources.not_text(str(path)) is None  # (the head's check passes it)
    with pytest.raises(ConfigError) as err:
        read(path)
    found = int(str(err.value).split(" at offset ")[1].split(" ")[0].replace(",", ""))
    assert str(err.value).startswith(f"data.files: {path} holds binary data at offset ")
    assert offset <= found < offset + 4  # (a random byte may start a UTF-8 sequence that goes wrong 1-3 bytes on)
    assert str(err.value).endswith("are NUL or not UTF-8); remove it or give text files")


def test_a_few_stray_bytes_are_replaced_counted_and_warned(tmp_path, caplog):
    data = b"text " * 100_000 + b"\0\xff" + b"more text " * 1000
    (tmp_path / "f.txt").write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="xtrain"):
        pieces, counts = read(tmp_path / "f.txt")
    assert counts.replaced == 2 and "".join(pieces).count("\ufffd") == 2 and "\0" not in "".join(pieces)
    assert f"{tmp_path / 'f.txt'}: 2 byte(s) that are not text (NUL or not UTF-8) replaced, the first at offset " \
           "500000" in caplog.text


def test_an_empty_or_unreadable_text_file(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    pieces, counts = read(tmp_path / "empty.txt")
    assert pieces == [] and counts.empty == 1 and counts.documents == 0
    locked = tmp_path / "locked.txt"
    locked.write_text("x")
    locked.chmod(0)
    if os.access(locked, os.R_OK):  # (root reads it anyway: a folder, which cannot be read as a file, stands in)
        locked = tmp_path / "folder.txt"
        locked.mkdir()
    with pytest.raises(ConfigError, match=rf"data.files: {locked} cannot be read \(.*\); fix its permissions or remove it"):
        read(locked)


def test_a_4_gb_text_file_with_a_hole_after_its_head_is_refused_in_bounded_memory(tmp_path):
    """4 GB of `.txt`: 3 MB of one line of text, then a sparse hole (NULs on reading): the run's preparation reads
    the head in pieces, finds the binary data at its offset and refuses it in one line, its memory bounded."""
    path = tmp_path / "big.txt"
    with open(path, "wb") as f:
        f.write(b"word " * 600_000)
        f.truncate(4 << 30)
    code = ("import resource, runpy, sys; sys.argv = ['xtrain', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('xtrain', run_name='__main__')\n"
            "finally:\n    print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, f"run_dir={tmp_path / 'run'}", "data=text",
                           f"data.files=[{path}]", "trainer.max_steps=2"], capture_output=True, text=True, cwd=REPO,
                          timeout=600, env={**os.environ, "XTRAIN_CACHE_DIR": str(tmp_path / "cache")})
    *lines, rss = proc.stderr.strip().splitlines()
    proc.stderr = "\n".join(lines)
    assert_one_line_error(proc, f"data.files: {path} holds binary data at offset 3,000,000 ")
    assert int(rss.split()[1]) * 1024 < 2 << 30  # (the file read whole: 4 GiB; measured 0.8-1.7 GiB)
    assert not (tmp_path / "run").exists()
