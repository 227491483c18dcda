"""A config-built model for FSDP2 that never exists whole on a rank, or one built straight on its GPU, yet either
starts from the very weights the eager build (`from_config` on the CPU) gives for the same seed.

`build` runs the model's own constructor and initialization with every large tensor on the meta device: each
in-place write to one (an init's `normal_`, `zero_`) is recorded, and a random one also notes the generator's
state and draws the same numbers into a scratch tensor, so the global generator ends where the eager build
leaves it. `shard` then applies FSDP2 on the meta model (Accelerate's own wrapping), gives every rank storage
for its shards only, and fills each shard from its parameter's replayed writes: one full parameter exists at
a time. `materialize` instead gives the whole model storage on one device (a GPU: DDP) and fills it the same
way. Small tensors (norms, biases, buffers such as RoPE's frequencies) are made and initialized as usual.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xtrain.parallel import compiling

MIN_NUMEL = 1 << 16  # tensors this large or larger are built on meta; the rest (at most 256 KB each) as usual
RANDOM_WRITES = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_",
                 "log_normal_"}
_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Recorder


@dataclass
class Write:
    op: object  # an aten in-place op
    view: tuple  # (size, stride, storage offset) of what it wrote, in its tensor's storage
    args: tuple
    kwargs: dict
    rng_state: torch.Tensor | None  # the CPU generator's state before a random write


@dataclass
class Recorder(TorchDispatchMode):
    writes: dict = field(default_factory=dict)  # storage of a meta tensor -> its Writes, in order
    made: list = field(default_factory=list)  # the meta tensors (their storages stay alive: keys stay unique)
    scratch: dict = field(default_factory=dict)  # dtype -> one buffer, reused (see `_scratch`)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op.overloadpacket.__name__
        if name in ("empty", "empty_strided") and kwargs.get("device") in (None, torch.device("cpu")):
            if _numel(args[0]) >= MIN_NUMEL:
                made = op(*args, **{**kwargs, "device": torch.device("meta")})
                self.writes[_key(made)] = []
                self.made.append(made)
                return made
        target = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].is_meta else None
        if target is None or _key(target) not in self.writes or not name.endswith("_"):
            return op(*args, **kwargs)
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args[1:], *kwargs.values())):
            raise RuntimeError(f"meta_init: {name} reads another tensor built without storage; cannot replay it")
        if kwargs.get("generator") is not None:
            raise RuntimeError(f"meta_init: {name} draws from a generator of its own; cannot replay it")
        state = None
        if name in RANDOM_WRITES:
            state = torch.get_rng_state()
            op(self._scratch(_numel(target.size()), target.dtype).view(target.size()), *args[1:], **kwargs)  # same draws
        view = (tuple(target.size()), tuple(target.stride()), target.storage_offset())
        self.writes[_key(target)].append(Write(op, view, tuple(args[1:]), dict(kwargs), state))
        return target

    def _scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`numel` elements of one buffer that grows as needed. A tensor per parameter, freed after use, would
        leave host memory held: glibc raises its mmap threshold after the first large free, and later ones come
        from a heap it does not give back (measured: 1.2 GB kept for a 303 M-parameter model)."""
        buffer = self.scratch.get(dtype)
        if buffer is None or buffer.numel() < numel:
            self.scratch[dtype] = buffer = None
            self.scratch[dtype] = buffer = torch.empty(numel, dtype=dtype)
        return buffer[:numel]

    def value(self, tensor: torch.Tensor) -> torch.Tensor:
        """The full value the eager build gives this meta tensor (the generator's state is left as it was), in
        a buffer the next call reuses."""
        state = torch.get_rng_state()
        storage = self._scratch(tensor.untyped_storage().nbytes() // tensor.element_size(), tensor.dtype)
        try:
            for w in self.writes[_key(tensor)]:
                if w.rng_state is not None:
                    torch.set_rng_state(w.rng_state)
                w.op(storage.as_strided(*w.view), *w.args, **w.kwargs)
        finally:
            torch.set_rng_state(state)
        return storage.as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())


def _numel(size) -> int:
    n = 1
    for d in size:
        n *= d
    return n


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _inner(t: torch.Tensor) -> torch.Tensor:
    """The tensor a torchao fp8 weight wraps (for its fp8 all-gather under FSDP2), else `t`. (Held by itself:
    `to_empty` swaps a wrapper's contents.)"""
    return getattr(t, "_tensor", t)


def _is_meta(t: torch.Tensor) -> bool:
    return _inner(_local(t)).is_meta


def build(make):
    """`make()` (a model's constructor) with its large tensors on meta, their writes recorded."""
    recorder = Recorder()
    with recorder:
        model = make()
    recorder.scratch.clear()
    unrecorded = [name for name, b in model.named_buffers() if b.is_meta]
    if unrecorded:
        raise RuntimeError(f"meta_init: buffers {unrecorded} were computed from tensors without storage")
    _built[model] = recorder
    return model


def is_lazy(model) -> bool:
    return model in _built


def shard(accelerator, model):
    """FSDP2 on the meta model, as Accelerate applies it (activation checkpointing, then `fully_shard` per
    wrap layer), then each rank's shards filled with the eager build's values. Accelerate's `prepare` later
    finds the model sharded and leaves it so; it must not apply activation checkpointing a second time."""
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    recorder = _built.pop(model)
    plugin = accelerator.state.fsdp_plugin
    originals = {name: _inner(p) for name, p in model.named_parameters() if _is_meta(p)}
    plugin.set_auto_wrap_policy(model)
    if plugin.activation_checkpointing:
        model = fsdp2_apply_ac(accelerator, model)
        plugin.activation_checkpointing = False  # applied: `prepare` would wrap each block again
    if accelerator.state.dynamo_plugin.backend.value != "NO":  # compiled after checkpointing, as `prepare` does
        compiling.compile_blocks(model)
    plugin.cpu_ram_efficient_loading = False  # (it would broadcast rank 0's weights: there are none yet)
    model = fsdp2_prepare_model(accelerator, model)
    kept = {name: t.detach().clone() for name, t in _tensors(model) if not _is_meta(t)}
    from torch.distributed.fsdp import CPUOffloadPolicy

    device = torch.device("cpu") if isinstance(plugin.cpu_offload, CPUOffloadPolicy) else accelerator.device
    model.to_empty(device=device)  # storage for the shards; what was already real is put back below
    with torch.no_grad():
        for name, t in _tensors(model):
            if name in kept:
                _local(t).copy_(_local(kept[name]))
            elif name.replace(_CHECKPOINT_PREFIX, "") in originals:  # (activation checkpointing's wrapper)
                _local(t).copy_(_own_part(recorder.value(originals[name.replace(_CHECKPOINT_PREFIX, "")]), t))
            else:
                raise RuntimeError(f"meta_init: {name} has no recorded value")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def materialize(model, device: torch.device):
    """The meta-built model on `device` (a GPU), each large tensor filled there from its replayed writes through
    one host buffer: the eager build's weights, without the whole model ever on the host."""
    recorder = _built.pop(model)

    def every():  # (tied weights under each of their names: to_empty unties them, `tie_weights` ties them again)
        return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]

    originals = {name: _inner(t) for name, t in every() if _is_meta(t)}
    kept = {name: t.detach().clone() for name, t in every() if not _is_meta(t)}
    model.to_empty(device=device)  # storage there for every tensor; what was already real is put back below
    with torch.no_grad():
        for name, t in every():
            t.copy_(kept[name] if name in kept else recorder.value(originals[name]))
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def _own_part(full: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` where `t` is a DTensor: FSDP2 shards as `torch.chunk` does (a view, no copy)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return full
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            full = full.chunk(t.device_mesh.size(mesh_dim), dim=placement.dim)[t.device_mesh.get_local_rank(mesh_dim)]
    return full


def _tensors(model):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
