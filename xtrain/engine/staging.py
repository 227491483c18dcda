"""A checkpoint's files written after the step that made them: what Accelerate's `save_state` writes, staged.

Inside `deferred()`, each file `save_state` would write is staged instead: its tensors copied off the training
tensors into host memory (pinned where they live on a GPU, the same buffers reused save after save), anything else
serialized at once, and the write kept for later (`Staged.write`, on a thread of the saver's). What Accelerate puts
in a checkpoint (which objects, their names, the RNG states of this moment) stays Accelerate's; only when the bytes
reach the disk changes. A sharded state (torch's distributed checkpoint, FSDP2's form) goes through its own
`async_save`, which stages the same way, over a process group of its own (its collectives run off the training
thread).
"""

from __future__ import annotations

import contextlib
import io
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

LEAVES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


@dataclass
class Buffers:
    """Host copies of the training tensors' storages, kept from one save to the next (a save reuses the buffer its
    storage had last time when the size matches: pinning memory is slow, allocating it again needless)."""

    held: dict[tuple, torch.UntypedStorage] = field(default_factory=dict)

    def copy(self, key: tuple, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        kept = self.held.get(key)
        if kept is None or kept.nbytes() != storage.nbytes():
            pinned = storage.device.type == "cuda"
            kept = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()
            self.held[key] = kept
        kept.copy_(storage, non_blocking=storage.device.type == "cuda")
        return kept

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.held.values())


def _tensor_tree(obj) -> bool:
    """Containers of tensors and plain values only (a state dict, an optimizer's state): copied tensor by tensor."""
    if torch.is_tensor(obj):
        return type(obj) in (torch.Tensor, torch.nn.Parameter)  # (a subclass is serialized whole)
    if isinstance(obj, (dict, OrderedDict)):
        return all(isinstance(k, LEAVES) and _tensor_tree(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_tensor_tree(v) for v in obj)
    return isinstance(obj, LEAVES) or type(obj) is np.ndarray and obj.dtype != object


class _Copier:
    """One file's tensors copied to host storages; tensors that shared a storage share its copy (tied weights stay
    tied, views stay views), so the file written later is the one written now."""

    def __init__(self, buffers: Buffers, name: str):
        self.buffers, self.name, self.copies, self.count = buffers, name, {}, 0

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.device, storage.nbytes())
        if key not in self.copies:
            self.copies[key] = self.buffers.copy((self.name, self.count), storage)
            self.count += 1
        return torch.empty(0, dtype=t.dtype).set_(self.copies[key], t.storage_offset(), t.size(), t.stride())

    def tree(self, obj):
        if torch.is_tensor(obj):
            return self.tensor(obj.detach())
        if isinstance(obj, OrderedDict):
            return OrderedDict((k, self.tree(v)) for k, v in obj.items())
        if isinstance(obj, dict):
            return {k: self.tree(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.tree(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self.tree(v) for v in obj)
        if isinstance(obj, np.ndarray):  # (numpy's RNG state)
            return obj.copy()
        return obj


@dataclass
class Staged:
    """A checkpoint's writes, staged: `write()` (this rank's files, then the sharded states' own writes) runs later."""

    writes: list[Callable[[], None]] = field(default_factory=list)
    futures: list = field(default_factory=list)  # torch's distributed checkpoint's async saves of this rank
    on_device: bool = False  # a copy from a GPU is in flight (synchronized before the step goes on)

    def write(self) -> None:
        for write in self.writes:
            write()
        for future in self.futures:
            future.result()


@contextlib.contextmanager
def deferred(buffers: Buffers, sharded_group: Callable[[int], object] | None = None):
    """Around `accelerator.save_state`: the files it writes are staged into the `Staged` this yields.
    `sharded_group(i)`: where Accelerate writes sharded states (FSDP), the group the i-th one's async save runs its
    collectives over: gloo, the saver's own, one a state (they run at once, each on its own thread: on one group
    their collectives would interleave differently on each rank); asked for where every rank saves one, so every
    rank makes it together."""
    import accelerate.utils.other as accelerate_other
    from safetensors.torch import save_file

    staged = Staged()
    real_save = torch.save
    names: dict[str, int] = {}

    def copier(path) -> _Copier:
        name = str(path)
        names[name] = names.get(name, 0) + 1
        return _Copier(buffers, f"{name}#{names[name]}")

    def note_device(obj) -> None:
        staged.on_device |= any(t.is_cuda for t in _tensors(obj))

    def torch_save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, bytes)) and not hasattr(f, "__fspath__"):
            return real_save(obj, f, *args, **kwargs)  # (into memory: not a file of the checkpoint)
        if _tensor_tree(obj):
            note_device(obj)
            copy = copier(f).tree(obj)
            staged.writes.append(lambda: real_save(copy, f, *args, **kwargs))
        else:  # anything else (a sampler, numpy's RNG state): its bytes, as they are now
            data = io.BytesIO()
            real_save(obj, data, *args, **kwargs)
            staged.writes.append(lambda: _write_bytes(f, data.getvalue()))

    def safe_save_file(tensors, filename, metadata=None):
        note_device(tensors)
        copy = copier(filename).tree(tensors)
        staged.writes.append(lambda: save_file(copy, filename, metadata=metadata))

    def dcp_save(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, process_group=None, **_):
        group = process_group if process_group is not None else sharded_group(len(staged.futures))
        staged.futures.append(dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                             planner=planner, process_group=group))

    patches = [(torch, "save", torch_save), (accelerate_other, "safe_save_file", safe_save_file)]
    if sharded_group is not None:
        import torch.distributed.checkpoint as dcp  # (Accelerate's FSDP saves import it as they run: the patched module)

        patches.append((dcp, "save", dcp_save))
    kept = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield staged
    finally:
        for module, name, value in kept:
            setattr(module, name, value)
    if staged.on_device:
        torch.cuda.synchronize()  # the copies to pinned memory are done before the tensors change


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _write_bytes(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
