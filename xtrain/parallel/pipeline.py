"""Pipeline parallelism: the model's layers in `strategy.pp` consecutive stages, one per group of ranks, trained by
one of torch.distributed.pipelining's schedules; each stage replicated (DDP) or sharded (FSDP2, HSDP) over the
data-parallel ranks that hold it.

The mesh is pp x dp_replicate x dp_shard x tp (pipeline stages outermost): rank r holds stage r // (dp x tp)
(interleaved: the stages looped over the pp ranks) and data-parallel index r // tp % dp, whose batches it trains on
as every other rank of its pipeline and its tensor-parallel group does. What the rest of xtrain asks of a strategy, `Pipelined` answers around the strategy whose
stages it replicates or shards (`inner`): a stage is prepared by that strategy's own means (DDP over the stage's
data-parallel group, FSDP2's `fully_shard` over its sub-mesh) instead of Accelerate's, which has no pipelines;
stages.py holds what runs on a rank (the split, the schedule, the step, the evals, the stage files).

A stage keeps its parameters under the whole model's names (`stages.Pipe.part`: the model with the other stages'
layers removed), so its checkpoint files (`pipeline_rank<R>_model.safetensors`, `pipeline_rank<R>_optimizer.bin`,
written by each stage's first data-parallel rank) are keyed as the whole model's: a run with another pp, or none,
reads the whole model from them. Tied embeddings (the head's weight is the first stage's) are two copies, one on
the first stage and one on the last, whose gradients are summed before each step.
"""

from __future__ import annotations

from xtrain.config.schema import DataSource, Precision, RunConfig
from xtrain.core.errors import ConfigError
from xtrain.parallel import dims
from xtrain.parallel.base import PIPELINE_FORM, ModelFacts, Parallelism
from xtrain.parallel.fsdp import check_mesh
from xtrain.parallel.stages import DECODERS, Pipe, microbatches, pipe_of, stage_layers, stages


def bubble(cfg: RunConfig, n_micro: int) -> float:
    """The idle fraction of a step: (pp - 1) / (micro-batches + pp - 1), for GPipe and 1F1B alike."""
    pp = cfg.strategy.pp
    return (pp - 1) / (n_micro + pp - 1)


def check(cfg: RunConfig, facts: ModelFacts) -> None:
    """What a pipeline cannot be for this world, model and run, one ConfigError each, before anything starts."""
    s, c, t = cfg.strategy, cfg.cluster, cfg.trainer
    world = c.world_size
    processes = f"{world} processes ({c.nodes} node(s) x cluster.num_processes={c.processes_per_node})"
    if world % s.pp:
        raise ConfigError(f"strategy.pp={s.pp}: does not divide the {processes}; use a strategy.pp that divides "
                          f"{world}, or cluster.num_processes={s.pp // c.nodes or 1} and more")
    mesh = dims.of(cfg)
    others = s.pp * int(s.dp_replicate) * s.tp  # (what dp_shard is the rest of)
    if world % others:
        raise ConfigError(f"strategy.pp={s.pp} x strategy.dp_replicate={s.dp_replicate} x strategy.tp={s.tp}: does "
                          f"not divide the {processes}; choose sizes whose product divides {world}")
    if mesh.dp_shard < 2 and s.name.value == "fsdp":
        raise ConfigError(f"strategy.pp={s.pp} on {processes} leaves dp_shard={mesh.dp_shard}: FSDP2 needs at least 2 "
                          f"ranks to shard each stage over; use strategy=ddp strategy.pp={s.pp} (each stage "
                          f"replicated) or cluster.num_processes={2 * others // c.nodes or 1}")
    if s.tp > 1:
        check_mesh(cfg, facts)  # (the tensor-parallel plan, the heads, tp within a node)
    if facts.model_class not in DECODERS:
        raise ConfigError(f"strategy.pp={s.pp}: {facts.model_class or 'this model'} is not a decoder the pipeline "
                          f"splitter knows (it splits {', '.join(sorted(DECODERS))}); use strategy.pp=1")
    n, layers = stages(cfg), facts.layers or 0
    if s.pp_stage_layers is None and layers % n:
        raise ConfigError(f"strategy.pp={s.pp}: {facts.model_class}'s {layers} layers do not split evenly into {n} "
                          f"stages; give each stage's layers (strategy.pp_stage_layers=[...], {n} numbers summing "
                          f"to {layers}) or a strategy.pp dividing {layers}")
    if s.pp_stage_layers is not None and sum(s.pp_stage_layers) != layers:
        raise ConfigError(f"strategy.pp_stage_layers={list(s.pp_stage_layers)}: sums to {sum(s.pp_stage_layers)}, and "
                          f"{facts.model_class} has {layers} layers; give {n} numbers summing to {layers}")
    n_micro, per_rank = microbatches(cfg), t.batch_size * t.grad_accum
    if per_rank % n_micro:
        raise ConfigError(f"strategy.pp_microbatches={n_micro}: does not divide a data-parallel rank's step of "
                          f"trainer.batch_size={t.batch_size} x trainer.grad_accum={t.grad_accum} = {per_rank} "
                          f"sequences; use a number dividing {per_rank}")
    if n_micro < s.pp:
        raise ConfigError(f"strategy.pp={s.pp} with {n_micro} micro-batch(es) a step (trainer.grad_accum, or "
                          f"strategy.pp_microbatches): fewer than the stages, so {bubble(cfg, n_micro):.0%} of each "
                          f"step is idle (the bubble); use at least {s.pp} micro-batches (trainer.grad_accum="
                          f"{s.pp} with trainer.batch_size={max(1, per_rank // s.pp)})")
    if s.pp_schedule == "interleaved_1f1b" and n_micro % s.pp:
        raise ConfigError(f"strategy.pp_schedule=interleaved_1f1b: its {n_micro} micro-batches a step must be a "
                          f"multiple of strategy.pp={s.pp}; use trainer.grad_accum (or strategy.pp_microbatches) = "
                          f"{s.pp * max(1, n_micro // s.pp)}")
    unsupported = [
        ("model.lora.enabled=true", cfg.model.lora.enabled),
        ("trainer.compile=true", t.compile),
        (f"precision={cfg.precision.name.value}", cfg.precision.name not in (Precision.fp32, Precision.bf16)),
        ("strategy.cpu_offload=true", getattr(s, "cpu_offload", False)),
        ("strategy.activation_checkpointing=true", getattr(s, "activation_checkpointing", False)),
        ("trainer.sample_prompts", bool(t.sample_prompts)),
        (f"data.source={cfg.data.source.value}", cfg.data.source is DataSource.sft),
    ]
    for setting, on in unsupported:
        if on:
            raise ConfigError(f"strategy.pp={s.pp}: with {setting} pipeline stages are not supported here; use "
                              f"strategy.pp=1, or leave {setting.split('=')[0]} unset")


class Pipelined(Parallelism):
    """Pipeline stages around another strategy (`inner`: DDP or FSDP2) that replicates or shards each stage."""

    compiles_in_prepare = False
    settings_title = "pipeline"

    def __init__(self, inner: Parallelism):
        self.inner = inner
        self.name = f"PP x {inner.name}"
        self.owns_precision = inner.owns_precision

    def accelerate_types(self, world: int) -> set[str]:
        return {"MULTI_CPU", "MULTI_GPU"}

    def refusal(self, cfg: RunConfig, cuda: bool) -> str | None:
        return self.inner.refusal(cfg, cuda)

    def check_machine(self, cfg: RunConfig) -> None:
        self.inner.check_machine(cfg)

    def check(self, cfg: RunConfig, facts: ModelFacts) -> None:
        check(cfg, facts)

    def wrap_layer(self, cfg: RunConfig, meta_model) -> str:
        return self.inner.wrap_layer(cfg, meta_model)

    def settings(self, cfg: RunConfig, facts: ModelFacts) -> dict:
        n_micro = microbatches(cfg)
        return {"stages": stages(cfg), "schedule": cfg.strategy.pp_schedule,
                "stage_layers": stage_layers(cfg, facts.layers or 0), "microbatches": n_micro,
                "bubble": round(bubble(cfg, n_micro), 4), "stage_sharding": self.inner.name}

    def launch_config(self, cfg: RunConfig, facts, files: dict, cuda: bool) -> dict:
        return {"distributed_type": "MULTI_GPU" if cuda else "MULTI_CPU", "use_cpu": not cuda}

    def trains_in_process(self, world: int) -> bool:
        return False

    def async_save_refusal(self, cfg: RunConfig) -> str | None:
        return None

    def staged_per_node(self, cfg: RunConfig, weights: float, optimizer: float) -> float:
        """Each stage's first data-parallel rank stages its stage whole."""
        return (weights + optimizer) * dims.of(cfg).dp_shard

    def steps_fused(self, cfg: RunConfig) -> bool:
        return self.inner.steps_fused(cfg)

    def builds_on_meta(self, cfg: RunConfig) -> bool:
        return False  # (every rank builds the whole model, the same weights, and keeps its stages)

    def state_bytes(self, cfg: RunConfig, state: float) -> tuple[float, float, float]:
        return self.inner.state_bytes(cfg, state)

    def local_parameters(self, cfg: RunConfig, count: int | None, tp_split: int) -> float | None:
        """The heaviest stage's share: its layers' part of the parameters (the embeddings and head counted with the
        layers, an estimate)."""
        if count is None:
            return None
        count = self.inner.local_parameters(cfg, count, tp_split)
        n = stages(cfg)
        layers = cfg.strategy.pp_stage_layers
        share = max(sum(layers[i] for i in range(r, n, cfg.strategy.pp)) for r in range(cfg.strategy.pp)) / sum(
            layers) if layers else 1 / cfg.strategy.pp
        return count * share

    def held_activations(self, cfg: RunConfig, per_layer: float, layers: int, final: float) -> float:
        """A stage's layers' activations for the micro-batches in flight on it (GPipe: every one of the step's;
        1F1B: up to pp, on the first stage), per sequence of trainer.batch_size."""
        n_micro, s = microbatches(cfg), cfg.strategy
        micro = cfg.trainer.batch_size * cfg.trainer.grad_accum / n_micro / cfg.trainer.batch_size
        in_flight = n_micro if s.pp_schedule == "gpipe" else min(n_micro, s.pp)
        held = stage_layers(cfg, layers)
        heaviest = max(sum(held[i] for i in range(r, len(held), s.pp)) for r in range(s.pp))
        return (per_layer * heaviest * in_flight + final) * micro

    def checkpoint_form(self, cfg: RunConfig) -> str:
        return PIPELINE_FORM

    def prepare_model(self, cfg: RunConfig, accelerator, model):
        return Pipe(cfg, accelerator, model).part

    def prepare(self, accelerator, model, optimizer, train_loader, val_loader, scheduler):
        return pipe_of(model).prepare(accelerator, model, optimizer, train_loader, val_loader, scheduler)

    def prepare_loader(self, accelerator, model, loader):
        return pipe_of(model).loader(accelerator, loader)

    def train_step(self, accelerator, c, micro: list, per, max_grad_norm: float):
        return pipe_of(c.model).train_step(c, micro, per, max_grad_norm)

    def eval_losses(self, accelerator, task, model, batch):
        return pipe_of(model).eval_losses(accelerator, task, batch)

    def whole_state_dict(self, accelerator, model):
        return pipe_of(model).whole_state_dict()

    def whole_model(self, accelerator, model):
        return pipe_of(model).skeleton

    def whole_parameters(self, model, counted: int) -> int:
        return sum(p.numel() for p in pipe_of(model).skeleton.parameters())


def wrap(inner: Parallelism, strategy) -> Parallelism:
    """`inner` in `strategy.pp` pipeline stages (itself where there is one stage)."""
    return Pipelined(inner) if strategy.pp > 1 else inner
