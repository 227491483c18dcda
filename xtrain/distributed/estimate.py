"""A per-device estimate of model-state memory, for any model (it counts parameters). It follows the ZeRO paper (Rajbhandari et al., 2020, section 3):
with mixed-precision Adam each parameter costs 2 bytes of 16-bit weights, 2 bytes of
16-bit gradients and K = 12 bytes of optimizer state (fp32 master weights, momentum,
variance); with fp32 training it is 4 + 4 + 8 (no master copy). DDP keeps fp32 weights and
gradients under autocast too (4 + 4 + 8 at any precision: the same 16 bytes, held differently), its
gradient buckets being views of the gradients (`gradient_as_bucket_view`), and replicates all of it; ZeRO-1 partitions the optimizer state over the N data-parallel ranks, ZeRO-2 also
the gradients, ZeRO-3 also the weights. FSDP keeps fp32 weights sharded (mixed precision
casts them per layer), so full_shard costs 16 / N bytes per parameter. Activations,
temporary buffers, fragmentation and the CUDA context are not included.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xtrain.config.schema import FsdpSharding, Offload, Precision, RunConfig, Strategy

GB = 1e9  # decimal gigabytes, as in the ZeRO paper's figures


@dataclass(frozen=True)
class Memory:
    """Bytes per device for model states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def bytes_per_param(precision: Precision) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) for Adam."""
    if precision is Precision.fp32:
        return 4, 4, 8
    return 2, 2, 12


QUANTIZED_BYTES = 0.5  # a 4-bit weight (QLoRA's base; its quantization constants, ~0.1 bit each, not counted)


def model_state_memory(n_params: int, cfg: RunConfig, trainable: int | None = None, quantized: int = 0) -> Memory:
    """Model-state bytes per device; with `trainable` (LoRA) only those parameters have gradients and
    optimizer states, the rest weights alone; `quantized` of those weights in 4 bits (QLoRA)."""
    s = cfg.strategy
    n = cfg.cluster.world_size
    w, g, k = bytes_per_param(cfg.precision.name)
    if s.name is Strategy.ddp:  # autocast: fp32 weights and gradients, whatever the precision
        params, grads, opt = 4, 4, 8
    elif s.name is Strategy.zero1:
        params, grads, opt = w, g, k / n
    elif s.name is Strategy.zero2:
        params, grads, opt = w, g / n, k / n
    elif s.name is Strategy.zero3:
        params, grads, opt = w / n, g / n, k / n
    else:  # FSDP keeps fp32 weights and gradients, sharded over its sharding group
        sharding = s.sharding if s.fsdp_version == 1 else FsdpSharding.full_shard
        group = min(n, cfg.cluster.processes_per_node) if sharding is FsdpSharding.hybrid_shard else n
        if sharding is FsdpSharding.no_shard:
            group = 1
        params = 4 if sharding is FsdpSharding.shard_grad_op else 4 / group
        grads, opt = 4 / group, 8 / group
        if s.cpu_offload:
            params = grads = opt = 0
    if s.offload_optimizer is not Offload.none:
        opt = 0
    if s.offload_param is not Offload.none:
        params = 0
    trained = n_params if trainable is None else trainable
    return Memory(params * (n_params - quantized) + QUANTIZED_BYTES * quantized, grads * trained, opt * trained)


# From least to most memory-saving: what to suggest when a plan does not fit.
_ALTERNATIVES = [
    ("strategy=ddp", dict(name=Strategy.ddp)),
    ("strategy=zero1", dict(name=Strategy.zero1)),
    ("strategy=zero2", dict(name=Strategy.zero2)),
    ("strategy=zero3", dict(name=Strategy.zero3)),
    ("strategy=zero3 strategy.offload_optimizer=cpu", dict(name=Strategy.zero3, offload_optimizer=Offload.cpu)),
    (
        "strategy=zero3 strategy.offload_optimizer=cpu strategy.offload_param=cpu",
        dict(name=Strategy.zero3, offload_optimizer=Offload.cpu, offload_param=Offload.cpu),
    ),
]


def first_fit(n_params: int, cfg: RunConfig, device_bytes: float, trainable: int | None = None,
              quantized: int = 0) -> tuple[str, Memory] | None:
    for overrides, fields in _ALTERNATIVES:
        strategy = replace(cfg.strategy, **{"offload_optimizer": Offload.none, "offload_param": Offload.none, **fields})
        memory = model_state_memory(n_params, replace(cfg, strategy=strategy), trainable, quantized)
        if memory.total <= device_bytes:
            return overrides, memory
    return None
