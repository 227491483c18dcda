"""A causal LM's prepared data: token blocks (cache.py) or, for data=sft, chat examples (sft.py)."""

from __future__ import annotations

from xtrain.config.schema import DataConfig, DataSource, ModelConfig


def prepare(data: DataConfig, model: ModelConfig):
    """The prepared data of this config (`cache.Prepared`, or `sft.PreparedExamples` for data=sft): from the
    cache, or prepared now, once, whoever else asks at the same time."""
    if data.source is DataSource.sft:
        from xtrain.data import sft

        return sft.prepare(data, model)
    from xtrain.data import cache

    return cache.prepare(data, model)
