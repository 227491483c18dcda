"""Batches: items of different lengths padded, float64 items cast."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("xtrain")


class PadToLongest:
    """Collate items into a batch padded on the right to its longest `input_ids`: `attention_mask` marks the real
    tokens; each key of `pads` is padded with its value, any other is stacked (a classifier's labels)."""

    def __init__(self, pads: dict[str, int]):
        self.pads = pads

    def __call__(self, items: list[dict]) -> dict:
        longest = max(len(item["input_ids"]) for item in items)
        batch = {"attention_mask": torch.zeros((len(items), longest), dtype=torch.long)}
        for key in items[0]:
            if key not in self.pads:
                batch[key] = torch.stack([item[key] for item in items])
                continue
            batch[key] = torch.full((len(items), longest), self.pads[key], dtype=torch.long)
            for row, item in enumerate(items):
                batch[key][row, :len(item[key])] = item[key]
        for row, item in enumerate(items):
            batch["attention_mask"][row, :len(item["input_ids"])] = 1
        return batch


class CastFloat64:
    """A collate (torch's default, or `collate`), with float64 tensors (numpy's default, Python floats) cast to
    float32, the dtype xtrain trains weights in; said once in the log (`quiet`: not said)."""

    def __init__(self, collate=None, quiet: bool = False):
        self.collate = collate
        self.said = quiet

    def __call__(self, items: list):
        from torch.utils.data import default_collate

        batch = (self.collate or default_collate)(items)
        cast = _cast(batch)
        if cast is not batch and not self.said:
            self.said = True
            log.info("data: the datasets' float64 tensors are cast to float32, the model's dtype")
        return cast


def _cast(batch):
    """`batch` with every float64 tensor in it cast to float32 (the same object where it holds none)."""
    if torch.is_tensor(batch):
        return batch.float() if batch.dtype == torch.float64 else batch
    if isinstance(batch, dict):
        cast = {key: _cast(value) for key, value in batch.items()}
        return batch if all(cast[k] is batch[k] for k in batch) else cast
    if isinstance(batch, (list, tuple)):
        cast = [_cast(value) for value in batch]
        return batch if all(a is b for a, b in zip(cast, batch)) else type(batch)(cast)
    return batch
