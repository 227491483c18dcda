"""The train loader's micro-batches over epochs, and its shuffle for corpora of millions of examples.

`accelerator.prepare` rebuilds a shuffled loader's sampler as Accelerate's `SeedableRandomSampler` (xtrain asks for
it: every epoch's order is a function of `trainer.seed` and the epoch, the same on every rank and after a resume).
Its draw is torch's `RandomSampler.__iter__`, which makes a Python list of the whole epoch's permutation: ~36 bytes
per example, ~150 MB a rank for 4M blocks. `lean` swaps in a subclass that draws the same permutation and keeps it
a tensor (8 bytes per example), handed out a chunk at a time. Checkpoints pickle it as they pickle Accelerate's.

An epoch is the first `examples // effective batch` whole optimizer steps of that permutation, the same at any number
of processes that keeps the effective batch: micro-batch i of rank r is the permutation's batch i x processes + r, so
a run resumed at another world size continues at the same example (`micro_batches` skips steps x grad_accum of its
own micro-batches) and no step spans two epochs.
"""

from __future__ import annotations

from typing import Iterator

import torch
from accelerate.data_loader import SeedableRandomSampler

CHUNK = 1 << 16


class LeanSeedableRandomSampler(SeedableRandomSampler):
    """Exactly SeedableRandomSampler's indices (seeded by `initial_seed + epoch`), without replacement."""

    def __iter__(self) -> Iterator[int]:
        assert not self.replacement and self.generator is not None, "a prepared shuffled loader's sampler"
        self.generator.manual_seed(self.epoch + self.initial_seed)
        n = len(self.data_source)
        for _ in range(self.num_samples // n):
            perm = torch.randperm(n, generator=self.generator)
            for start in range(0, n, CHUNK):
                yield from perm[start:start + CHUNK].tolist()
        yield from torch.randperm(n, generator=self.generator)[: self.num_samples % n].tolist()
        self.set_epoch(self.epoch + 1)


def lean(loader, effective_batch: int) -> None:
    """Give a prepared train loader (Accelerate's DataLoaderShard) the lean form of its seedable sampler, its epoch
    whole steps of `effective_batch` examples (where the data holds one; else whole rounds of the ranks' batches)."""
    sampler = loader.get_sampler()
    assert type(sampler) is SeedableRandomSampler, type(sampler)
    n = len(sampler.data_source)
    per_round = loader.total_batch_size  # (per-rank batch x ranks that take their own)
    epoch = n // effective_batch * effective_batch or n // per_round * per_round
    replacement = LeanSeedableRandomSampler(sampler.data_source, num_samples=epoch,
                                            generator=sampler.generator, data_seed=sampler.initial_seed)
    replacement.epoch = sampler.epoch
    loader.set_sampler(replacement)


def epochs(step: int, grad_accum: int, loader) -> float:
    """The epochs trained after `step` optimizer steps (1.5: half-way through the second), as the log, metrics.jsonl
    and result.json give them: the same at any world size that keeps the effective batch."""
    return round(step * grad_accum / len(loader), 4)


def steps_per_epoch(grad_accum: int, loader) -> int:
    return len(loader) // grad_accum


def micro_batches(accelerator, loader, start: int):
    """Endless micro-batches over epochs, starting at micro-batch `start` (resume skips, never replays)."""
    epoch, offset = divmod(start, len(loader))
    while True:
        epoch_loader = accelerator.skip_first_batches(loader, offset) if offset else loader
        epoch_loader.set_epoch(epoch)
        if hasattr(loader.dataset, "set_epoch"):  # a dataset whose items depend on the epoch (augmentation)
            loader.dataset.set_epoch(epoch)
        yield from epoch_loader
        epoch, offset = epoch + 1, 0
