"""The train and val sets of a prepared cache entry: fixed-size token blocks read from the token file.

Each block is one positioned read (`os.pread`) of the file, served by the kernel's page cache: a rank holds
only the blocks it is reading, so its memory does not grow with the corpus. (A memory map would not do:
the kernel maps ~64 KB of cached file around every page fault into the process, so after N random 256-byte
reads a rank's resident memory held ~N x 64 KB of the file: +150 MB after 1,600 blocks of a 260 MB file.)
"""

from __future__ import annotations

import os
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
        self._fd = None

    def __len__(self) -> int:
        return self.size

    def block_id(self, i: int) -> int:
        if i < 0 or i >= self.size:
            raise IndexError(i)
        if self.skip is None:
            return int(self.ids[i])
        return i + int(np.searchsorted(self.skip, i, side="right"))

    def __getitem__(self, i: int) -> dict:
        if self._fd is None:  # opened on first use, in the process that reads
            self._fd = os.open(self.path, os.O_RDONLY)
        size = self.block * self.dtype.itemsize
        raw = os.pread(self._fd, size, self.block_id(i) * size)
        return {"input_ids": torch.from_numpy(np.frombuffer(raw, dtype=self.dtype).astype(np.int64))}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None}

    def __del__(self, close=os.close) -> None:  # `close` bound now: at interpreter exit `os` may be gone
        if getattr(self, "_fd", None) is not None:
            close(self._fd)
