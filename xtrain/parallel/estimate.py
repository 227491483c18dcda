"""A per-device estimate of model-state memory, for any model (it counts parameters). It follows the ZeRO paper (Rajbhandari et al., 2020, section 3):
with mixed-precision Adam each parameter costs 2 bytes of 16-bit weights, 2 bytes of
16-bit gradients and K = 12 bytes of optimizer state (fp32 master weights, momentum,
variance); with fp32 training it is 4 + 4 + 8 (no master copy). DDP keeps fp32 weights and
gradients under autocast too (4 + 4 + 8 at any precision: the same 16 bytes, held differently), its
gradient buckets being views of the gradients (`gradient_as_bucket_view`), and replicates all of it; ZeRO-1 partitions the optimizer state over the N data-parallel ranks, ZeRO-2 also
the gradients, ZeRO-3 also the weights. FSDP keeps fp32 weights sharded (mixed precision
casts them per layer), so full_shard costs 16 / N bytes per parameter. Another optimizer keeps its own state in place
of Adam's 8 bytes (SGD with momentum 4, without 0: measured for the run's own, engine/optim.py). Activations,
temporary buffers, fragmentation and the CUDA context are not included.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xtrain.config.schema import Offload, Precision, RunConfig, Strategy, TaskKind, strategy_config
from xtrain.parallel import dims, strategies
from xtrain.parallel.base import ADAM_STATE, bytes_per_param  # noqa: F401 (estimate.bytes_per_param: the figures' source)

GB = 1e9  # decimal gigabytes, as in the ZeRO paper's figures


@dataclass(frozen=True)
class Memory:
    """Bytes per device: model states, and activations where they are estimated (None: not for this model)."""

    params: float
    grads: float
    optimizer: float
    activations: float | None = None

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + (self.activations or 0.0)




QUANTIZED_BYTES = 0.5  # a 4-bit weight (QLoRA's base; its quantization constants, ~0.1 bit each, not counted)


def model_state_memory(n_params: int, cfg: RunConfig, trainable: int | None = None, quantized: int = 0,
                       tp_split: int = 0, optimizer_state: float | None = None) -> Memory:
    """Model-state bytes per device; with `trainable` (LoRA) only those parameters have gradients and
    optimizer states, the rest weights alone; `quantized` of those weights in 4 bits (QLoRA). Under a mesh FSDP2
    shards over dp_shard (replicas hold a copy each) and `tp_split` of the parameters (those the tensor-parallel
    plan splits) are split over tp first. `optimizer_state`: the bytes a parameter the run's optimizer keeps (a
    user's, measured: engine/optim.py); None: AdamW's."""
    parallelism = strategies.of(cfg)
    params, grads, opt = parallelism.state_bytes(cfg, ADAM_STATE if optimizer_state is None else optimizer_state)
    n_params = parallelism.local_parameters(cfg, n_params, tp_split)
    trainable = parallelism.local_parameters(cfg, trainable, tp_split)
    trained = n_params if trainable is None else trainable
    return Memory(params * (n_params - quantized) + QUANTIZED_BYTES * quantized, grads * trained, opt * trained)


def activation_memory(cfg: RunConfig, facts) -> float | None:
    """Bytes of activations one micro-batch keeps for backward on a device, for a causal LM whose shapes are known
    (else None), as autograd saves them for a Llama (h hidden, h_kv key/value, i MLP values per token; w bytes a
    value: 2 under mixed precision, 4 in fp32). Per token and layer: the two norms' inputs and normalized values in
    fp32 (4h x 4 bytes) and what the projections read of them (in fp32 the norms' outputs, 2h x 4; under autocast
    a 16-bit copy for each of q, k, v, gate and up, 5h x 2); split over tp, q and the attention output, k and v,
    the output projection's input ((3h + 2h_kv) / tp x w) and the MLP's gate, up, activation and product
    (4i / tp x w). Then the final norm's (3h x 4 in fp32; 2h x 4 + h x 2 under autocast) and the fp32
    log-probabilities (4 bytes per vocabulary entry). Activation checkpointing keeps each layer's input alone
    (h x 4), and one layer's full set while it is recomputed. Not included: what backward holds at once (the
    gradients of activations), temporary buffers, the allocator's slack, the gathered weights of the layer in use."""
    if cfg.task.name is not TaskKind.causal_lm or not facts.layers or not facts.intermediate or not facts.vocab:
        return None
    tp = dims.of(cfg).tp
    h, i, heads = facts.hidden_size, facts.intermediate, facts.heads or 1
    h_kv = h * (facts.kv_heads or heads) / heads
    fp32 = cfg.precision.name is Precision.fp32
    width = 4 if fp32 else 2
    norms = 6 * h * 4 if fp32 else 4 * h * 4 + 5 * h * 2
    layer = norms + ((3 * h + 2 * h_kv) / tp + 4 * i / tp) * width
    parallelism = strategies.of(cfg)
    final = (3 * h * 4 if fp32 else 2 * h * 4 + h * 2) + facts.vocab * 4
    if parallelism.recomputes_activations(cfg):
        per_token = h * 4 * facts.layers + layer + final
    else:
        per_token = parallelism.held_activations(cfg, layer, facts.layers, final)
    return per_token * cfg.trainer.batch_size * cfg.data.block_size


def device_memory(n_params: int, cfg: RunConfig, facts, optimizer_state: float | None = None) -> Memory:
    """Per device: model states (`optimizer_state`: as model_state_memory) and (estimated) activations."""
    states = model_state_memory(n_params, cfg, facts.trainable, facts.quantized, facts.tp_split, optimizer_state)
    return replace(states, activations=activation_memory(cfg, facts))


_OFFLOADS = [
    (Strategy.ddp, Offload.none, Offload.none), (Strategy.zero1, Offload.none, Offload.none),
    (Strategy.zero2, Offload.none, Offload.none), (Strategy.zero3, Offload.none, Offload.none),
    (Strategy.zero3, Offload.cpu, Offload.none), (Strategy.zero3, Offload.cpu, Offload.cpu),
]


def _strategies(cfg: RunConfig) -> list:
    """The strategy settings to try: the run's own first, then every ZeRO stage and offload, and FSDP2 (a pipeline
    run: its own, its stages kept)."""
    s = cfg.strategy
    if s.name is Strategy.fsdp or s.pp > 1:
        return [s]
    users = vars(s).get("deepspeed_config")
    options = [strategy_config(name) if name is Strategy.ddp else
               strategy_config(name, offload_optimizer=opt, offload_param=param, deepspeed_config=users)
               for name, opt, param in _OFFLOADS]
    options.append(strategy_config(Strategy.fsdp))
    return [s] + [o for o in options if o != s]


def _tp_options(cfg: RunConfig, strategy, facts) -> list[int]:
    """Tensor-parallel degrees to try: the run's, then larger ones the model and a node allow."""
    if strategy.name is not Strategy.fsdp or not facts.tp_plan:
        return [strategy.tp]
    options, tp = [strategy.tp], strategy.tp * 2
    world, per_node = cfg.cluster.world_size, cfg.cluster.processes_per_node
    while tp <= per_node:
        divides = all(not n or n % tp == 0 for n in (facts.heads, facts.kv_heads))
        others = int(strategy.dp_replicate) * tp * strategy.pp  # (what dp_shard is the rest of)
        if divides and per_node % tp == 0 and world % others == 0 and world // others >= 2:
            options.append(tp)
        tp *= 2
    return options


def _changed(cfg: RunConfig, candidate: RunConfig) -> list[str]:
    """The overrides that turn `cfg` into `candidate`."""
    a, b = vars(cfg.strategy), vars(candidate.strategy)  # (each strategy's own settings)
    offloads = ("offload_optimizer", "offload_param")
    out = []
    if [a["name"], *(a.get(k, Offload.none) for k in offloads)] != [b["name"], *(b.get(k, Offload.none) for k in offloads)]:
        out.append(f"strategy={b['name'].value}")
        out += [f"strategy.{key}={b[key].value}" for key in offloads if b.get(key, Offload.none) is not Offload.none]
    if b.get("activation_checkpointing", False) != a.get("activation_checkpointing", False):
        out.append("strategy.activation_checkpointing=true")
    if b["tp"] != a["tp"]:
        out.append(f"strategy.tp={b['tp']}")
    if candidate.trainer.batch_size != cfg.trainer.batch_size:
        out.append(f"trainer.batch_size={candidate.trainer.batch_size} trainer.grad_accum={candidate.trainer.grad_accum}")
    return out


def smallest_fit(n_params: int, cfg: RunConfig, facts, device_bytes: float, own_strategy_only: bool = False,
                 optimizer_state: float | None = None) -> tuple[str, Memory] | None:
    """The smallest change under which the plan fits `device_bytes`: the fewest settings changed (another strategy
    or offload, activation checkpointing, more tensor parallelism, a smaller micro-batch with more accumulation:
    the same effective batch; `own_strategy_only`: the micro-batch alone) and of those the one that keeps the most
    memory in use; as overrides and its memory. The run's own strategy where it fits already; None where nothing
    does."""
    found = []
    for strategy in [cfg.strategy] if own_strategy_only else _strategies(cfg):
        fsdp = strategy.name is Strategy.fsdp
        recomputable = fsdp and strategy.pp == 1  # (pipeline stages: not with activation checkpointing)
        for checkpointing in ([strategy.activation_checkpointing, True] if recomputable else
                              [getattr(strategy, "activation_checkpointing", None)]):
            for tp in _tp_options(cfg, strategy, facts):
                batch, halved = cfg.trainer.batch_size, []
                while batch % 2 == 0:
                    halved.append(batch)
                    batch //= 2
                for batch in dict.fromkeys([*halved, batch, 1]):  # (halved while it divides, then a micro-batch of 1)
                    accum = cfg.trainer.grad_accum * cfg.trainer.batch_size // batch
                    moved = replace(strategy, activation_checkpointing=checkpointing, tp=tp) if fsdp else strategy
                    candidate = replace(cfg, strategy=moved,
                                        trainer=replace(cfg.trainer, batch_size=batch, grad_accum=accum))
                    memory = device_memory(n_params, candidate, facts, optimizer_state)
                    if memory.total <= device_bytes:
                        changes = _changed(cfg, candidate)
                        found.append((len(changes), -memory.total, " ".join(changes) or f"strategy={strategy.name.value}",
                                      memory))
    if not found:
        return None
    _, _, overrides, memory = min(found, key=lambda item: item[:2])
    return overrides, memory
