"""Peak memory preparing a plain-text corpus: one `.txt` file of 20 MB to 2 GB, as paragraphs or as one line.

    python benchmarks/text_memory.py [--sizes 20,200,2000] [--shapes paragraphs,one_line] [--dir /tmp/xtrain-text-bench]

A `.txt` file is one document. For each size and shape, `python -m xtrain.prepare data=text data.files=[FILE]`
(`data.num_proc=2`, the default 2,048-token BPE trained on its bounded sample, block 128) runs from a cold cache; the
figure is the peak RSS of its process tree (main + tokenizing processes, sampled 5x/s), with MB/s of text.
`paragraphs`: realistic documents (200 B to 40 KB each) joined by blank lines; `one_line`: the same text with no
newline at all.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from corpus import documents  # noqa: E402
from data import prepare  # noqa: E402


def generate(root: Path, mb: int, shape: str) -> Path:
    """`mb` MB of text as one file (kept between runs of this script)."""
    path = root / f"{shape}_{mb}mb.txt"
    if path.exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for doc in documents(mb * 1_000_000, seed=mb):
            f.write(doc.replace("\n", " ") + " " if shape == "one_line" else doc + "\n\n")
    tmp.rename(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20,200,2000")
    parser.add_argument("--shapes", default="paragraphs,one_line")
    parser.add_argument("--dir", default="/tmp/xtrain-text-bench")
    args = parser.parse_args()
    root = Path(args.dir)
    rows = []
    for shape in args.shapes.split(","):
        for mb in map(int, args.sizes.split(",")):
            corpus = generate(root, mb, shape)
            cache = root / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            figures = prepare(corpus, cache, 2)
            rows.append({"shape": shape, "mb": mb, **figures})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| `.txt` | shape | peak RSS preparing | MB/s | tokens |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mb']} MB | {r['shape']} | {r['peak_rss_mb']:.0f} MB | {r['mb_per_s']:.2f} | {r['tokens']:,} |")


if __name__ == "__main__":
    main()
