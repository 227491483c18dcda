"""Data at scale: every file format, preparation once (in parallel, outside the training ranks, under a lock,
redone after a kill), memory-mapped blocks, a capped val split, the chunked eval loss, and bad input."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (PACED, REPO, SMALL, assert_equal_weights, assert_one_line_error, compose_run,
                      kill_after_checkpoint, logged, read_result, run_xtrain, start_xtrain, xtrain_in_process)
from corpus import documents, write

FORMATS = [".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".csv", ".txt"]
TINY = ["trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.log_every=1", "trainer.eval_every=2",
        "trainer.save_every=2", "trainer.batch_size=4"]
PREPARING = "data: preparing "


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own: what it prepares, and nothing else, is there."""
    path = tmp_path / "cache"
    monkeypatch.setenv("XTRAIN_CACHE_DIR", str(path))
    return path


def entries(cache: Path) -> list[Path]:
    """The complete prepared entries in the cache."""
    return sorted(p.parent for p in (cache / "prepared").glob("*/meta.json"))


def prepare(*overrides: str):
    from xtrain.tasks.causal_lm.task import CausalLM

    cfg = compose_run(*overrides)
    return CausalLM(cfg).prepare()


def write_formats(root: Path, docs: list[str]) -> dict[str, Path]:
    """The same documents in every format: one file each, and a directory of one .txt file per document."""
    paths = {ext: write(root / f"corpus{ext}", docs) for ext in FORMATS[:-1]}
    for i, doc in enumerate(docs):
        write(root / "txt" / f"{i:03d}.txt", [doc])
    paths[".txt"] = root / "txt"
    return paths


def test_every_format_gives_the_same_tokens_and_trains(tmp_path, cache):
    docs = list(documents(120_000, seed=1))
    paths = write_formats(tmp_path / "corpus", docs)
    tokens = {}
    for ext, path in paths.items():
        prepared = prepare("data=text", f"data.files=[{path}]")
        assert prepared.meta["documents"] == len(docs), ext
        tokens[ext] = (prepared.path / "tokens.bin").read_bytes()
    assert len(set(tokens.values())) == 1  # one token stream, whatever the format it came in
    assert len(entries(cache)) == len(FORMATS)  # keyed by content: each file is its own corpus

    sweep_dir = tmp_path / "sweep"
    choices = ",".join(f"[{p}]" for p in paths.values())
    run_xtrain("-m", f"run_dir={sweep_dir}", "data=text", f"data.files={choices}", *TINY)
    results = [read_result(p) for p in sorted(sweep_dir.iterdir()) if (p / "result.json").exists()]
    assert [r["status"] for r in results] == ["completed"] * len(FORMATS)
    # same tokens, tokenizer, split and seed: every point starts from the same val loss
    assert len({round(r["initial_val_loss"], 6) for r in results}) == 1


def test_a_mix_of_formats_and_empty_or_undecodable_text(tmp_path, cache):
    docs = list(documents(300_000, seed=2))
    assert len(docs) > 8
    write(tmp_path / "a.jsonl", docs[:3] + ["", None] + docs[3:5])  # an empty and a null text
    (tmp_path / "b.txt").write_bytes(("caf\xe9 cr\xe8me " + "plain text " * 10).encode("latin-1") * 200)
    write(tmp_path / "c.parquet", docs[5:])
    prepared = prepare("data=text", f"data.files=[{tmp_path}/a.jsonl,{tmp_path}/b.txt,{tmp_path}/c.parquet]")
    meta = prepared.meta
    assert meta["documents"] == len(docs) + 1 and meta["empty_records"] == 2
    assert meta["replaced_bytes"] == 400  # é and è, each replaced by U+FFFD
    # the files in the order given, each document followed by EOS
    ids = np.fromfile(prepared.path / "tokens.bin", dtype=meta["dtype"])
    first = prepared.tokenizer(docs[0], add_special_tokens=False)["input_ids"]
    assert list(ids[:len(first) + 1]) == first + [prepared.tokenizer.eos_token_id]


def test_blocks_split_and_val_cap(tmp_path, cache):
    write(tmp_path / "c.jsonl", documents(400_000, seed=3))
    prepared = prepare("data=text", f"data.files=[{tmp_path}/c.jsonl]", "data.block_size=64", "data.max_val_tokens=1024")
    meta, (train, val) = prepared.meta, prepared.splits()
    assert meta["dtype"] == "uint16" and len(val) == 1024 // 64 == meta["val_blocks"]
    assert len(train) + len(val) == meta["blocks"] == meta["tokens"] // 64
    all_tokens = np.fromfile(prepared.path / "tokens.bin", dtype=np.uint16).astype(np.int64).reshape(-1, 64)
    train_ids = [train.block_id(i) for i in range(len(train))]
    val_ids = [val.block_id(i) for i in range(len(val))]
    assert sorted(train_ids + val_ids) == list(range(meta["blocks"]))  # disjoint, and every block used
    for split, ids in ((train, train_ids), (val, val_ids)):
        for i in (0, 1, len(split) // 2, len(split) - 1):
            assert torch.equal(split[i]["input_ids"], torch.from_numpy(all_tokens[ids[i]]))
    with pytest.raises(IndexError):
        train[len(train)]
    # the split is a property of the data: the same config finds the same entry and split
    again = prepare("data=text", f"data.files=[{tmp_path}/c.jsonl]", "data.block_size=64", "data.max_val_tokens=1024")
    assert not again.fresh and again.path == prepared.path


def test_the_cache_key_follows_corpus_tokenizer_block_size_and_split(tmp_path, cache):
    path = write(tmp_path / "c.jsonl", documents(200_000, seed=13))
    base = ["data=text", f"data.files=[{path}]"]
    first = prepare(*base).path
    others = [prepare(*base, extra).path for extra in ("data.block_size=64", "data.val_fraction=0.1",
                                                       "data.max_val_tokens=2048", "model.vocab_size=1024")]
    assert len({first, *others}) == 5
    assert len([p for p in (cache / "tokenizers").iterdir() if p.is_dir()]) == 2  # a block size or a split needs no new tokenizer
    assert prepare(*base, "data.num_proc=1").path == first  # how it was prepared is not what was prepared
    write(path, documents(200_000, seed=14))  # new content: its size or mtime changes
    assert prepare(*base).path != first


def test_a_prepared_corpus_is_found_without_importing_transformers(short_run):
    """A multi-process run's launcher finds the entry (by its key: the tokenizer's JSON and EOS id, read with
    tokenizers alone); transformers' tokenizer is loaded when a rank asks for it."""
    code = ("import sys\nfrom xtrain.config import schema\nfrom xtrain.tasks.causal_lm import corpus\n"
            f"cfg = schema.load({str(short_run / 'run.yaml')!r})\n"
            "prepared = corpus.prepare(cfg.data, cfg.model)\n"
            "print('FOUND', not prepared.fresh, 'transformers' in sys.modules)\n"
            "print('LOADED', prepared.tokenizer.eos_token, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "FOUND True False" in out and "LOADED <|endoftext|> True" in out


def test_preparation_in_parallel_gives_the_tokens_of_one_process(tmp_path, cache, monkeypatch):
    write(tmp_path / "c.jsonl", documents(3_000_000, seed=4))  # three chunks or more: a pool of processes
    one = prepare("data=text", f"data.files=[{tmp_path}/c.jsonl]", "data.num_proc=1")
    monkeypatch.setenv("XTRAIN_CACHE_DIR", str(tmp_path / "other_cache"))
    two = prepare("data=text", f"data.files=[{tmp_path}/c.jsonl]", "data.num_proc=2")
    assert one.meta["num_proc"] == 1 and two.meta["num_proc"] == 2 and two.fresh
    assert (one.path / "tokens.bin").read_bytes() == (two.path / "tokens.bin").read_bytes()
    assert one.path.name == two.path.name  # the number of processes is not part of what was prepared


def test_sequence_losses_match_the_full_computation_in_chunks():
    import torch.nn.functional as F

    from xtrain.tasks.causal_lm.task import sequence_losses

    torch.manual_seed(0)
    logits, ids = torch.randn(3, 17, 50), torch.randint(0, 50, (3, 17))
    full = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    expected = full.view(3, 16).sum(dim=1)
    for chunk_elements in (50, 7 * 50, 10**9):  # a position at a time, chunks across sequences, all at once
        sums, counts = sequence_losses(logits, ids, chunk_elements)
        assert torch.allclose(sums, expected, atol=1e-5) and counts.tolist() == [16, 16, 16]
    half, _ = sequence_losses(logits.bfloat16(), ids, 4 * 50)
    assert half.dtype == torch.float32
    assert torch.allclose(half / 16, expected / 16, atol=0.05)
    labels = ids.clone()
    labels[0, :9] = -100  # targets 1..8 of the first sequence are not trained
    sums, counts = sequence_losses(logits, labels, 7 * 50)
    assert counts.tolist() == [8, 16, 16]
    assert torch.allclose(sums[0], full.view(3, 16)[0, 8:].sum(), atol=1e-5)


def bad_jsonl(path: Path) -> Path:
    lines = [json.dumps({"text": doc}) for doc in documents(200_000, seed=5)]
    lines[11] = '{"text": "cut off'
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("case", ["jsonl_line", "json_array_line", "no_column", "not_text", "no_match", "too_little",
                                  "bad_csv"])
def test_bad_input_is_one_line_and_caches_nothing(tmp_path, cache, case):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    if case == "jsonl_line":
        files, expected = bad_jsonl(corpus / "c.jsonl"), ["data.files", "c.jsonl line 12", "not valid JSON"]
    elif case == "json_array_line":
        files = corpus / "c.json"
        files.write_text('[\n {"text": "one"},\n {"text": "two"}\n {"text": "three"}\n]\n')
        expected = ["data.files", "c.json line 4", "not valid JSON"]
    elif case == "no_column":
        files = write(corpus / "c.parquet", list(documents(20_000)), column="body")
        expected = ["data.text_column=text", "c.parquet", "it has id, body"]
    elif case == "not_text":
        files = corpus / "c.jsonl"
        files.write_text("".join(json.dumps({"text": i}) + "\n" for i in range(5)))
        expected = ["data.text_column=text", "c.jsonl record 1", "(int), not text"]
    elif case == "no_match":
        files, expected = corpus / "*.jsonl", ["data.files", "matches no file"]
    elif case == "too_little":
        files = write(corpus / "c.jsonl", ["just a few words"])
        expected = ["data.block_size=128", "too few for a train/val split"]
    else:
        files = corpus / "c.csv"
        files.write_text('text,id\n"one",1\n"two,2\n')
        expected = ["data.files", "c.csv cannot be read as csv"]
    run_dir = tmp_path / "run"
    assert_one_line_error(xtrain_in_process(f"run_dir={run_dir}", "data=text", f"data.files=[{files}]", check=False),
                          *expected)
    assert entries(cache) == [] and not list(cache.glob("prepared/.tmp-*"))  # nothing cached, nothing half-written
    assert not run_dir.exists()


def run_lines(proc) -> str:
    return proc.stdout + proc.stderr


def test_two_processes_with_a_10_s_timeout_train_on_a_corpus_that_takes_longer_to_prepare(tmp_path, cache,
                                                                                         monkeypatch):
    """The driver prepares before any worker starts: no rank waits in a collective meanwhile. Its 8 chunks are
    paced to take 1.6 s each (as a corpus of ~65 MB takes on this CPU, on a fraction of the CPU)."""
    from xtrain.tasks.causal_lm import tokenize

    encode = tokenize.encode

    def slowly(docs):
        time.sleep(1.6)
        return encode(docs)

    monkeypatch.setattr(tokenize, "encode", slowly)  # (the driver prepares in this process: the CLI in-process)
    write(tmp_path / "c.jsonl", documents(8_000_000, seed=6))
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", "data=text", f"data.files=[{tmp_path}/c.jsonl]", "data.num_proc=1",
                      "cluster.num_processes=2", "cluster.timeout_s=10", *TINY)
    [entry] = entries(cache)
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["seconds"] > 10, "the corpus must take longer to prepare than the collective timeout"
    assert read_result(run_dir)["status"] == "completed" and read_result(run_dir)["world_size"] == 2
    out = run_lines(proc)
    assert out.index(PREPARING) < out.index("launching 1 x 2 processes")
    # progress while it prepared: documents, MB of the corpus, throughput and an ETA
    assert re.search(r"data: \d+ documents \| [\d.]+ of [\d.]+ MB \| [\d.]+ MB/s \| \d+ tokens/s \| ETA", out)


def test_two_runs_started_together_prepare_once_and_train_on_the_same_data(tmp_path, cache):
    write(tmp_path / "c.jsonl", documents(6_000_000, seed=7))
    common = ["data=text", f"data.files=[{tmp_path}/c.jsonl]", "data.num_proc=1", *TINY]
    procs = [start_xtrain(f"run_dir={tmp_path / name}", *common) for name in ("a", "b")]
    outs = ["".join(p.communicate(timeout=600)) for p in procs]  # a few KB each: no pipe fills up
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum(out.count(PREPARING) for out in outs) == 1  # one prepared, the other waited on the lock
    assert any("waiting for another process that prepares" in out for out in outs)
    assert len(entries(cache)) == 1
    a, b = read_result(tmp_path / "a"), read_result(tmp_path / "b")
    assert a["first_batch_sums"] == b["first_batch_sums"]
    assert a["initial_val_loss"] == b["initial_val_loss"]


def test_a_preparation_killed_half_way_is_redone(tmp_path, cache):
    docs = list(documents(8_000_000, seed=8))
    write(tmp_path / "c.jsonl", docs)
    common = ["data=text", f"data.files=[{tmp_path}/c.jsonl]", "data.num_proc=1"]
    proc = subprocess.Popen([sys.executable, "-m", "xtrain.prepare", *common], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size > 1 << 20 for p in (cache / "prepared").glob(".tmp-*/tokens.bin")):
        assert proc.poll() is None and time.monotonic() < deadline, "preparation never got half-way"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert entries(cache) == []  # a half-written entry is never taken for a complete one

    run_dir = tmp_path / "run"
    out = run_lines(run_xtrain(f"run_dir={run_dir}", *common, *TINY))
    assert PREPARING in out and read_result(run_dir)["status"] == "completed"
    [entry] = entries(cache)
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["documents"] == len(docs) and (entry / "tokens.bin").stat().st_size == meta["tokens"] * 2
    assert not list((cache / "prepared").glob(".tmp-*"))  # the killed one's leftovers are gone


def test_prepare_ahead_then_the_run_starts_training_without_preparing(tmp_path, cache):
    write(tmp_path / "c.jsonl.gz", documents(2_000_000, seed=9))
    common = ["data=text", f"data.files=[{tmp_path}/c.jsonl.gz]"]
    ahead = xtrain_in_process(*common, check=False, command="xtrain.prepare")
    assert ahead.returncode == 0 and PREPARING in ahead.stderr + ahead.stdout and "prepared:" in ahead.stdout
    run_dir = tmp_path / "run"
    out = run_lines(run_xtrain(f"run_dir={run_dir}", *common, *TINY))
    assert PREPARING not in out and "data: prepared on " in out and "earlier" in out
    assert read_result(run_dir)["status"] == "completed" and len(entries(cache)) == 1
    again = xtrain_in_process(*common, check=False, command="xtrain.prepare")
    assert again.returncode == 0 and "already prepared:" in again.stdout


def test_kill_9_mid_training_on_a_prepared_jsonl_corpus_resumes_bitwise(tmp_path, cache):
    write(tmp_path / "c.jsonl", documents(3_000_000, seed=10))
    common = ["data=text", f"data.files=[{tmp_path}/c.jsonl]", "trainer.max_steps=24", "trainer.save_every=8",
              "trainer.eval_every=8", "trainer.log_every=4", "trainer.warmup_steps=2", "trainer.batch_size=8"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_xtrain(f"run_dir={whole}", *common, *SMALL)
    proc = start_xtrain(f"run_dir={killed}", *common, *PACED, quiet=True)  # (its steps' sleeps change no number)
    kill_after_checkpoint(proc, killed / "checkpoints" / "step_00000008")
    run_xtrain(f"run_dir={killed}", *common, *PACED, "resume=auto")
    assert read_result(killed)["status"] == "completed"
    assert_equal_weights(whole, killed)
    assert logged(killed) == logged(whole)


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_sweep_prepares_once_for_its_points(tmp_path, cache, n_jobs):
    write(tmp_path / "c.jsonl", documents(4_000_000, seed=11))
    sweep_dir = tmp_path / "sweep"
    proc = run_xtrain("-m", f"run_dir={sweep_dir}", f"hydra.launcher.n_jobs={n_jobs}", "data=text",
                      f"data.files=[{tmp_path}/c.jsonl]", "trainer.lr=1e-3,2e-3", *TINY)
    point_logs = "".join(p.read_text() for p in sweep_dir.glob("*/logs/point.log"))
    assert (run_lines(proc) + point_logs).count(PREPARING) == 1
    assert len(entries(cache)) == 1
    results = [read_result(p) for p in sweep_dir.iterdir() if (p / "result.json").exists()]
    assert [r["status"] for r in results] == ["completed", "completed"]
    assert results[0]["first_batch_sums"] == results[1]["first_batch_sums"]


def test_the_train_shuffle_is_accelerates_order_without_a_list_of_the_epoch():
    from accelerate.data_loader import SeedableRandomSampler

    from xtrain.engine.sampler import CHUNK, LeanSeedableRandomSampler

    for n in (7, CHUNK * 3 + 5):
        make = lambda cls: cls(range(n), generator=torch.Generator().manual_seed(5), data_seed=3)  # noqa: E731
        expected, lean = make(SeedableRandomSampler), make(LeanSeedableRandomSampler)
        for epoch in range(2):  # each epoch its own order, and the same for both
            order = list(expected)
            assert list(lean) == order and sorted(order) == list(range(n))
        assert lean.epoch == expected.epoch == 2
