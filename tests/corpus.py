"""Generated corpora of realistic documents (tests and benchmarks/data.py): spans of CPython's own documentation,
from a few hundred bytes to tens of KB each, written in any of the formats `data=text` reads."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path
from typing import Iterator


def documents(n_chars: int, seed: int = 0) -> Iterator[str]:
    """Documents of about 200 to 40,000 characters (log-uniform), `n_chars` in all."""
    from pydoc_data.topics import topics

    base = "\n\n".join(topics[key] for key in sorted(topics))
    rng, total = random.Random(seed), 0
    while total < n_chars:
        size = min(n_chars - total, int(math.exp(rng.uniform(math.log(200), math.log(40_000)))))
        start = rng.randrange(len(base) - size)
        yield base[start:start + size]
        total += size


def write(path: Path, docs: list[str] | Iterator[str], column: str = "text") -> Path:
    """`docs` as the format `path`'s extension names (.jsonl, .json, .jsonl.gz, .json.gz, .parquet, .csv, .txt)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        with (gzip.open(path, "wt") if name.endswith(".gz") else open(path, "w")) as f:
            for i, doc in enumerate(docs):
                f.write(json.dumps({"id": i, column: doc}) + "\n")
    elif name.endswith((".json", ".json.gz")):
        with (gzip.open(path, "wt") if name.endswith(".gz") else open(path, "w")) as f:
            json.dump([{"id": i, column: doc} for i, doc in enumerate(docs)], f)
    elif name.endswith((".parquet", ".csv")):
        import pandas as pd

        frame = pd.DataFrame({"id": range(len(docs)), column: list(docs)})
        frame.to_parquet(path) if name.endswith(".parquet") else frame.to_csv(path, index=False)
    else:
        path.write_text("".join(docs))
    return path
