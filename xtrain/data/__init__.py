"""Data: a corpus prepared once into a cache of token blocks, then read by every rank.

sources.py (documents, in order, from files, datasets or the bundled corpus) → tokenize.py (token ids, in
parallel) → cache.py (the content-keyed entry: tokens, the split, its record; once, under a lock) →
blocks.py (the train and val sets, a block per read). `prepare` runs outside any training collective: in the
driver before workers start, in a SLURM job before torchrun, or ahead of time (`python -m xtrain.prepare`).
"""

from xtrain.data.cache import Prepared, prepare
from xtrain.data.sources import check

__all__ = ["Prepared", "check", "prepare"]
