"""Data: a corpus prepared once into a cache of token blocks, then read by every rank.

sources.py (documents, in order, from files, datasets or the bundled corpus) → tokenize.py (token ids, in
parallel) → cache.py (the content-keyed entry: tokens, the split, its record; once, under a lock) →
blocks.py (the train and val sets, a block per read). Instruction and chat examples (`data=sft`) take
chat.py (rendering and the answer mask) and sft.py (their entry, packed or one per item) instead. `prepare` runs outside any training collective: in the
driver before workers start, in a SLURM job before torchrun, or ahead of time (`python -m xtrain.prepare`).
"""

from xtrain.config import DataConfig, DataSource, ModelConfig
from xtrain.data.cache import Prepared
from xtrain.data.sources import check

__all__ = ["Prepared", "check", "prepare"]


def prepare(data: DataConfig, model: ModelConfig):
    """The prepared data of this config (`Prepared`, or `sft.PreparedExamples` for data=sft): from the cache,
    or prepared now, once, whoever else asks at the same time."""
    if data.source is DataSource.sft:
        from xtrain.data import sft

        return sft.prepare(data, model)
    from xtrain.data import cache

    return cache.prepare(data, model)
