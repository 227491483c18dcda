"""The train and val sets of a prepared cache entry: fixed-size token blocks read from a memory map.

A rank touches only the blocks it reads: its memory does not grow with the corpus.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


class Blocks(Dataset):
    """`{"input_ids": LongTensor[block_size]}` for each block of one split (`train` or `val`)."""

    def __init__(self, tokens: Path, val_blocks: Path, meta: dict, split: str):
        self.path, self.dtype, self.block = tokens, np.dtype(meta["dtype"]), meta["block_size"]
        val = np.load(val_blocks)
        if split == "val":
            self.ids, self.skip, self.size = val, None, len(val)
        else:  # train position i is block i + (the held-out blocks before it): val - arange is sorted
            self.ids, self.skip, self.size = None, val - np.arange(len(val)), meta["blocks"] - len(val)
        self._tokens = None

    def __len__(self) -> int:
        return self.size

    def block_id(self, i: int) -> int:
        if i < 0 or i >= self.size:
            raise IndexError(i)
        if self.skip is None:
            return int(self.ids[i])
        return i + int(np.searchsorted(self.skip, i, side="right"))

    def __getitem__(self, i: int) -> dict:
        if self._tokens is None:  # opened on first use, in the process that reads
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = self.block_id(i) * self.block
        return {"input_ids": torch.from_numpy(self._tokens[start:start + self.block].astype(np.int64))}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}
