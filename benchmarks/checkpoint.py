"""What verified checkpoints cost: a save's digests and flushes against the save itself, and a resume's check.

    python benchmarks/checkpoint.py [--repeats 3] [--hidden 768 --layers 8]

A GPT-2 of ~60 M parameters (hidden 768, 8 layers, vocabulary 16384) with AdamW's state, one process on the CPU:
Accelerate's `save_state` into a fresh directory (what every save writes), then xtrain's `record_files` over it (each
file's size and digest, every file and directory flushed to disk), then `failure` (what a resume checks, with a cold
cache of answers). Medians of `--repeats`; the ratios are what the checks add to a save and to a resume.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()

    import torch
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel

    from xtrain.engine import checkpoint

    model = GPT2LMHeadModel(GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=12, vocab_size=16384,
                                       n_positions=1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, 16384, (1, 16)), labels=torch.randint(0, 16384, (1, 16))).loss.backward()
    optimizer.step()  # (AdamW's moments exist from its first step)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    n_params = sum(p.numel() for p in model.parameters())

    saves, records, checks, sizes = [], [], [], []
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.repeats):
            path = Path(root) / f"step_{i}"
            began = time.perf_counter()
            accelerator.save_state(str(path))
            saves.append(time.perf_counter() - began)
            began = time.perf_counter()
            files = checkpoint.record_files(path)
            records.append(time.perf_counter() - began)
            sizes.append(sum(f["bytes"] for f in files.values()))
            (path / "xtrain_state.json").write_text(__import__("json").dumps({"step": i, "files": files}))
            checkpoint._checked.clear()
            began = time.perf_counter()
            assert checkpoint.failure(path) is None
            checks.append(time.perf_counter() - began)

    save, record, check = (statistics.median(x) for x in (saves, records, checks))
    print(f"model {n_params / 1e6:.1f} M parameters, checkpoint {sizes[0] / 1e9:.2f} GB, {args.repeats} repeats")
    print(f"save_state        {save:6.2f} s")
    print(f"record_files      {record:6.2f} s  ({record / save:.2f}x the save; {sizes[0] / record / 1e9:.2f} GB/s)")
    print(f"check on resume   {check:6.2f} s  ({sizes[0] / check / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
