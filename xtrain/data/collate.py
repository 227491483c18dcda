"""Batches of items of different lengths."""

from __future__ import annotations

import torch


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
