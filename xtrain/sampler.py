"""The train loader's shuffle for corpora of millions of examples: torch's RandomSampler order, without the
Python list of a whole epoch's permutation that it makes (~36 bytes per example, ~140 MB a rank for 4M
blocks); the permutation stays a tensor (8 bytes per example) and is handed out a chunk at a time."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import RandomSampler

CHUNK = 1 << 16


class LeanRandomSampler(RandomSampler):
    """Exactly RandomSampler's indices for the same generator (Accelerate synchronizes that generator across
    ranks, as for any RandomSampler), without replacement."""

    def __iter__(self) -> Iterator[int]:
        assert not self.replacement and self.generator is not None, "for shuffled epochs with a seeded generator"
        n = len(self.data_source)
        for _ in range(self.num_samples // n):
            yield from _chunked(torch.randperm(n, generator=self.generator))
        yield from torch.randperm(n, generator=self.generator)[: self.num_samples % n].tolist()


def _chunked(perm: torch.Tensor) -> Iterator[int]:
    for start in range(0, len(perm), CHUNK):
        yield from perm[start:start + CHUNK].tolist()
