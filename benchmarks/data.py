"""Data at scale: preparation throughput and memory, training memory, start-up, the loader, and the eval share.

    python benchmarks/data.py [--sizes 50,500,2000] [--dir /tmp/xtrain-data-bench] [--scaling-max 500]

For each size (MB of generated JSONL: realistic documents of 200 B to 40 KB, in files of at most 256 MB):
- preparation (`python -m xtrain.prepare`) with `data.num_proc` 1 (sizes up to --scaling-max) and 2: MB/s of
  text, tokens/s, and the peak RSS of the preparing process tree (main + tokenizing processes, sampled 5x/s);
- a 2-process training run on it (100 steps): each rank's peak RSS (result.json's `peak_rss_bytes`);
- the data loader alone (a rank's shuffled DataLoader over the memory map) against training's tokens/s;
- at the largest size: time from the command to the first step, the data already prepared (1 process);
- at 500 MB (or the size nearest): the share of wall time spent in eval at the default trainer settings.
The tokenizer is trained once per corpus (its time is reported apart). Figures are medians where repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from corpus import documents, write  # noqa: E402

FILE_MB = 256


def generate(root: Path, mb: int) -> Path:
    """`mb` MB of JSONL documents in files of at most FILE_MB (kept between runs of this script)."""
    folder = root / f"corpus_{mb}mb"
    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    docs, part = documents(mb * 1_000_000, seed=mb), 0
    while True:
        chunk, size = [], 0
        for doc in docs:
            chunk.append(doc)
            size += len(doc)
            if size >= FILE_MB * 1_000_000:
                break
        if not chunk:
            break
        write(folder / f"part-{part:03d}.jsonl", chunk)
        part += 1
    (folder / "done").touch()
    return folder


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_sampled(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, int, float]:
    """Run `cmd`; its output, the peak RSS of its process tree, and its wall time."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ps, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(ps))
        time.sleep(0.2)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}")
    return subprocess.CompletedProcess(cmd, 0, out), peak, time.perf_counter() - start


def prepare(corpus: Path, cache: Path, num_proc: int) -> dict:
    shutil.rmtree(cache / "prepared", ignore_errors=True)
    env = {**os.environ, "XTRAIN_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "xtrain.prepare", "data=text", f"data.files=[{corpus}]", f"data.num_proc={num_proc}"]
    out, peak, wall = run_sampled(cmd, env)
    [meta_path] = (cache / "prepared").glob("*/meta.json")
    meta = json.loads(meta_path.read_text())
    return {"num_proc": num_proc, "mb_per_s": meta["text_mb"] / meta["seconds"], "tokens_per_s": meta["tokens"] / meta["seconds"],
            "seconds": meta["seconds"], "wall_s": wall, "peak_rss_mb": peak / 1e6, "tokens": meta["tokens"],
            "text_mb": meta["text_mb"]}


def train(corpus: Path, cache: Path, run_dir: Path, *overrides: str) -> dict:
    env = {**os.environ, "XTRAIN_CACHE_DIR": str(cache)}
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "xtrain", f"run_dir={run_dir}", "data=text", f"data.files=[{corpus}]", *overrides]
    run_sampled(cmd, env)
    return json.loads((run_dir / "result.json").read_text())


def loader_tokens_per_s(corpus: Path, cache: Path, batches: int = 2000) -> float:
    """One rank's loader alone: shuffled batches of 16 blocks from the memory map, as the trainer reads them."""
    os.environ["XTRAIN_CACHE_DIR"] = str(cache)
    import torch

    from xtrain.commands import cli
    from xtrain.config import schema
    from xtrain.tasks.causal_lm.task import CausalLM
    from hydra import compose, initialize_config_module

    cli.register_schemas()
    with initialize_config_module("xtrain.conf", version_base="1.3"):
        cfg = schema.from_container(compose("config", overrides=["data=text", f"data.files=[{corpus}]"]))
    train_set, _ = CausalLM(cfg).prepare().splits()
    loader = torch.utils.data.DataLoader(train_set, batch_size=16, shuffle=True, drop_last=True)
    done, start = 0, time.perf_counter()
    while done < batches:  # epochs, as the trainer's loader goes on
        for _ in zip(range(batches - done), loader):
            done += 1
    return batches * 16 * cfg.data.block_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,500,2000")
    parser.add_argument("--dir", default="/tmp/xtrain-data-bench")
    parser.add_argument("--scaling-max", type=int, default=500, help="measure num_proc=1 up to this size (MB)")
    parser.add_argument("--train-only", action="store_true", help="corpora prepared by an earlier run: training figures only")
    args = parser.parse_args()
    root, sizes = Path(args.dir), [int(s) for s in args.sizes.split(",")]
    rows = []
    for mb in sizes:
        t = time.perf_counter()
        corpus = generate(root, mb)
        print(f"{mb} MB corpus in {corpus} ({time.perf_counter() - t:.0f} s to generate)", flush=True)
        cache = root / f"cache_{mb}mb"
        preps, tokenizer_s = [], None
        if not args.train_only:
            shutil.rmtree(cache, ignore_errors=True)
            preps = [prepare(corpus, cache, 2)]  # trains the tokenizer first (its `seconds` leave that out)
            tokenizer_s = preps[0]["wall_s"] - preps[0]["seconds"]
            print(f"  tokenizer training and start-up: {tokenizer_s:.1f} s", flush=True)
        if mb <= args.scaling_max and not args.train_only:
            preps.insert(0, prepare(corpus, cache, 1))
        for p in preps:
            print(f"  prepare num_proc={p['num_proc']}: {p['mb_per_s']:.2f} MB/s, {p['tokens_per_s']:.0f} tokens/s, "
                  f"{p['seconds']:.1f} s ({p['wall_s']:.1f} s command), peak RSS {p['peak_rss_mb']:.0f} MB", flush=True)
        result = train(corpus, cache, root / f"run_{mb}mb", "cluster.num_processes=2", "trainer.max_steps=100",
                       "trainer.eval_every=50")
        loader = loader_tokens_per_s(corpus, cache)
        rss = [b / 1e6 for b in result["peak_rss_bytes"]]
        print(f"  training (2 ranks): peak RSS {', '.join(f'{r:.0f}' for r in rss)} MB, "
              f"{result['tokens_per_s']:.0f} tokens/s; loader alone {loader:.0f} tokens/s "
              f"({loader / (result['tokens_per_s'] / 2):.0f}x a rank's)", flush=True)
        rows.append({"mb": mb, "prepare": preps, "tokenizer_s": tokenizer_s, "train_rss_mb": rss,
                     "train_tokens_per_s": result["tokens_per_s"], "loader_tokens_per_s": loader})
    largest = max(sizes)
    corpus, cache = generate(root, largest), root / f"cache_{largest}mb"
    first = train(corpus, cache, root / "first_step", "trainer.max_steps=2")
    print(f"time to first step, {largest} MB prepared, 1 process: {first['time_to_first_step_s']:.1f} s", flush=True)
    eval_mb = min(sizes, key=lambda s: abs(s - 500))
    corpus, cache = generate(root, eval_mb), root / f"cache_{eval_mb}mb"
    default = train(corpus, cache, root / "eval_share")
    share = default["eval_time_s"] / default["train_time_s"]
    print(f"eval share at default settings, {eval_mb} MB: {default['eval_time_s']:.1f} s of {default['train_time_s']:.1f} s "
          f"training = {100 * share:.1f} %", flush=True)
    growth = rows[-1]["train_rss_mb"][0] / rows[0]["train_rss_mb"][0] - 1
    print(f"rank 0 training RSS growth {rows[0]['mb']} MB -> {rows[-1]['mb']} MB: {100 * growth:+.1f} %")
    for row in rows:
        if len(row["prepare"]) == 2:
            print(f"scaling num_proc 1 -> 2 at {row['mb']} MB: "
                  f"{row['prepare'][1]['mb_per_s'] / row['prepare'][0]['mb_per_s']:.2f}x")
    (root / ("results_train.json" if args.train_only else "results.json")).write_text(json.dumps({"rows": rows, "first_step_s": first["time_to_first_step_s"],
                                                   "eval_share": share}, indent=1))


if __name__ == "__main__":
    main()
