"""One rank's pipeline stages as they run: the whole model split into this rank's stages (`Pipe.part`, under the
whole model's names), each stage's forward replicated (DDP) or sharded (FSDP2) over its data-parallel ranks, torch's
schedule over them, the step, the evals passed stage to stage, and the stage files of a checkpoint (pipeline.py:
what a pipeline is to the rest of xtrain)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from xtrain.config.schema import RunConfig
from xtrain.config.strategy import PP_SCHEDULES
from xtrain.parallel import dims

MODEL_FILE, OPTIMIZER_FILE = "pipeline_rank{}_model.safetensors", "pipeline_rank{}_optimizer.bin"

# the decoders the splitter knows, by their class: where their parts are (the base model's attribute, its
# embeddings, its layer list, its final norm) and how a layer is called
GPT2 = SimpleNamespace(base="transformer", embeddings=("wte", "wpe", "drop"), layers="h", norm="ln_f", rotary=None)
LLAMA = SimpleNamespace(base="model", embeddings=("embed_tokens",), layers="layers", norm="norm", rotary="rotary_emb")
DECODERS = {"GPT2LMHeadModel": GPT2, "LlamaForCausalLM": LLAMA, "MistralForCausalLM": LLAMA,
            "Qwen2ForCausalLM": LLAMA, "Qwen3ForCausalLM": LLAMA}


def stages(cfg: RunConfig) -> int:
    s = cfg.strategy
    return s.pp * (s.pp_virtual_stages if s.pp_schedule == "interleaved_1f1b" else 1)


def microbatches(cfg: RunConfig) -> int:
    return cfg.strategy.pp_microbatches or cfg.trainer.grad_accum


def stage_layers(cfg: RunConfig, layers: int) -> list[int]:
    """Layers per stage, first to last: `strategy.pp_stage_layers`, else an even split."""
    n = stages(cfg)
    return list(cfg.strategy.pp_stage_layers or [layers // n] * n)


def owned_stages(cfg: RunConfig, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds: its own, or (interleaved) every pp-th from it."""
    return list(range(pp_rank, stages(cfg), cfg.strategy.pp))


def pipe_of(part):
    """The rank's `stages.Pipe` of the model part it holds."""
    return part.__dict__["xtrain_pipe"]


@dataclass
class _Logits:
    """The last stage's output where a task's loss asks its model for `.logits`."""

    logits: object

    def __call__(self, **_):
        return self


def stage_module(layout, base, head, layers: list, first: bool, last: bool, config):
    """One stage as an nn.Module: the first embeds the token ids, each runs its layers (a Llama's rotary embedding
    and causal mask made on every stage, as the whole model makes them once), the last normalizes and projects to
    logits. Its submodules are the model's own (`Pipe.part` keeps them under the whole model's names)."""
    import torch
    from transformers.masking_utils import create_causal_mask

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if first:
                self.embeddings = torch.nn.ModuleList(getattr(base, name) for name in layout.embeddings)
            self.layers = torch.nn.ModuleList(layers)
            if last:
                self.norm, self.head = getattr(base, layout.norm), head
            self.rotary = getattr(base, layout.rotary) if layout.rotary else None

        def forward(self, x):
            if first:
                h = self.embeddings[0](x)
            else:
                h = x
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            if first and layout is GPT2:
                h = self.embeddings[2](h + self.embeddings[1](positions))
            mask = create_causal_mask(config=config, inputs_embeds=h, attention_mask=None, cache=None,
                                      position_ids=positions)
            extra = {"position_embeddings": self.rotary(h, position_ids=positions)} if self.rotary is not None else {}
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_ids=positions, use_cache=False, **extra)
            if last:
                return self.head(self.norm(h))
            return h

    return Stage()


class Pipe:
    """One rank's part of the pipeline: its stages (`part`: the model with only their layers, under the whole
    model's names; `modules`: each stage's forward, replicated or sharded over the stage's data-parallel ranks), the
    schedule, and the groups it talks over."""

    def __init__(self, cfg: RunConfig, accelerator, model):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg, s = cfg, cfg.strategy
        mesh_dims = dims.of(cfg)
        self.pp, self.dp, self.tp = s.pp, mesh_dims.data_parallel, mesh_dims.tp
        inner = self.dp * self.tp  # (the ranks of one stage)
        rank = accelerator.process_index
        self.pp_rank, self.dp_rank, self.tp_rank = rank // inner, rank % inner // self.tp, rank % self.tp
        self.device = accelerator.device
        self.mesh = init_device_mesh(self.device.type, (self.pp, mesh_dims.dp_replicate, mesh_dims.dp_shard, self.tp),
                                     mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        self.pp_group = self.mesh.get_group("pp")
        self.first_rank = lambda pp_rank: pp_rank * inner + rank % inner  # (this rank's place in another stage)
        self.tie_group = None
        layout = DECODERS[type(model).__name__]
        base = getattr(model, layout.base)
        tied = self._tied(model, layout)
        for place in range(inner):  # (every rank makes every group, in one order)
            group = dist.new_group([place, (self.pp - 1) * inner + place]) if tied else None
            if place == rank % inner and self.pp_rank in (0, self.pp - 1):
                self.tie_group = group
        self.n_stages = stages(cfg)
        self.owned = owned_stages(cfg, self.pp_rank)
        counts = stage_layers(cfg, len(getattr(base, layout.layers)))
        starts = [sum(counts[:i]) for i in range(self.n_stages)]
        all_layers = getattr(base, layout.layers)
        self.skeleton = _skeleton(model)
        modules = []
        for stage in self.owned:
            layers = [all_layers[i] for i in range(starts[stage], starts[stage] + counts[stage])]
            modules.append(stage_module(layout, base, model.lm_head, layers, stage == 0, stage == self.n_stages - 1,
                                         model.config))
        kept = {str(i): all_layers[i] for stage in self.owned for i in range(starts[stage], starts[stage] + counts[stage])}
        setattr(base, layout.layers, torch.nn.ModuleDict(kept))  # (a ModuleDict by index: the whole model's names)
        if 0 not in self.owned:
            for name in layout.embeddings:
                setattr(base, name, None)
        if self.n_stages - 1 not in self.owned:
            setattr(base, layout.norm, None)
            model.lm_head = None
        # the tied weight's two names: the first stage's, the last stage's
        self.tied = (f"{layout.base}.{layout.embeddings[0]}.weight", "lm_head.weight") if tied else ()
        self.tied_name = self.tied[1] if tied and self.n_stages - 1 in self.owned else (
            self.tied[0] if tied and 0 in self.owned else None)
        model.to(self.device)
        if self.tp > 1:  # (the plan's modules that this rank holds, split over the stage's tp ranks)
            from transformers.distributed.tensor_parallel import apply_tensor_parallelism

            from xtrain.parallel.tensor_parallel import tensor_parallel_plan

            model = apply_tensor_parallelism(model, self.mesh["tp"], tensor_parallel_plan(model))
        self.part = model
        self.modules = [self._distribute(m) for m in modules]
        model.__dict__["xtrain_pipe"] = self

    @staticmethod
    def _tied(model, layout) -> bool:
        embedding = getattr(getattr(model, layout.base), layout.embeddings[0]).weight
        return model.lm_head.weight is embedding

    def _distribute(self, module):
        """The stage replicated over its data-parallel ranks (DDP: the same weights on each), or sharded over them
        (FSDP2: each layer, then the stage)."""
        if self.cfg.strategy.name.value == "fsdp":
            from torch.distributed.fsdp import fully_shard

            mesh = self.mesh["dp_replicate", "dp_shard"] if dims.of(self.cfg).dp_replicate > 1 else self.mesh["dp_shard"]
            for layer in module.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=self.cfg.strategy.reshard_after_forward)
            return fully_shard(module, mesh=mesh, reshard_after_forward=self.cfg.strategy.reshard_after_forward)
        if self.dp > 1:  # (replicas start equal; their gradients are averaged once a step: _average_replicas)
            import torch.distributed as dist

            group = self.mesh["dp_replicate"].get_group()
            for p in module.parameters():
                dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)
        return module

    # -- preparing ---------------------------------------------------------------------------------------------
    def prepare(self, accelerator, model, optimizer, train_loader, val_loader, scheduler):
        """The loaders dealt over the data-parallel ranks (each pipeline's ranks the same batches), the schedule
        built, the scheduler and loaders put where Accelerate's checkpoints keep them, and this rank's stage files
        written and read with Accelerate's (its save and load hooks)."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules

        self.optimizer = optimizer
        train_loader, val_loader = self.loader(accelerator, train_loader), self.loader(accelerator, val_loader)
        accelerator._schedulers.append(scheduler)
        self.stages = [PipelineStage(m, stage, self.n_stages, self.device, group=self.pp_group)
                       for m, stage in zip(self.modules, self.owned)]
        schedule = getattr(schedules, PP_SCHEDULES[self.cfg.strategy.pp_schedule])
        self.n_micro = microbatches(self.cfg)
        self.losses: list = []
        self.loss_scale = 1.0
        loss = lambda logits, target: self.task.loss(_Logits(logits), {"input_ids": target}, self.loss_scale)
        self.schedule = schedule(self.stages if len(self.stages) > 1 or schedule is schedules.ScheduleInterleaved1F1B
                                 else self.stages[0], n_microbatches=self.n_micro, loss_fn=loss, scale_grads=False)
        accelerator.register_save_state_pre_hook(lambda models, weights, out: self.save(out))
        accelerator.register_load_state_pre_hook(lambda models, path: self.load(path))
        self.autocast = accelerator.autocast
        return model, optimizer, train_loader, val_loader, scheduler

    def loader(self, accelerator, loader):
        from accelerate.data_loader import prepare_data_loader

        a = accelerator
        prepared = prepare_data_loader(
            loader, self.device, num_processes=self.dp, process_index=self.dp_rank, split_batches=a.split_batches,
            put_on_device=True, rng_types=a.rng_types.copy(), dispatch_batches=a.dispatch_batches,
            even_batches=a.even_batches, use_seedable_sampler=a.use_seedable_sampler,
            data_seed=a.dataloader_config.data_seed, non_blocking=a.non_blocking)
        accelerator._dataloaders.append(prepared)
        return prepared

    # -- training ------------------------------------------------------------------------------------------------
    def train_step(self, c, micro: list, per, max_grad_norm: float):
        """One optimizer step through the schedule: the step's micro-batches (this data-parallel rank's) as one
        batch the schedule splits into `n_micro`; each one's loss is its summed loss over the step's total weight (as
        `update.optimizer_step` weights it), so the gradients add up to the step's, then averaged over the
        data-parallel ranks by DDP or FSDP2. The tied embedding's two copies get their summed gradient, the gradient
        norm is the whole model's, and the loss (the last stage's) reaches every stage."""
        import torch
        import torch.distributed as dist

        self.task = c.task
        ids = torch.cat([b["input_ids"] for b in micro]).to(self.device)
        self.loss_scale = per * len(micro)
        losses: list = []
        first, last = 0 in self.owned, self.n_stages - 1 in self.owned
        with self.autocast():
            if first:
                self.schedule.step(ids, target=ids if last else None, losses=losses)
            else:
                self.schedule.step(target=ids if last else None, losses=losses)
        loss_sum = torch.stack(losses).sum() * len(micro) if last else torch.zeros((), device=self.device)
        dist.broadcast(loss_sum, self.first_rank(self.pp - 1), group=self.pp_group)
        self._average_replicas()
        self._tie_gradients()
        if max_grad_norm > 0:
            self._clip(max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        c.scheduler.step()
        # (the ranks of a pipeline, and of a tp group, share their batches: the loop multiplies by the world)
        count = sum(c.task.count(b) for b in micro) * self.dp / (self.pp * self.dp * self.tp)
        return loss_sum, count

    def _average_replicas(self) -> None:
        """DDP's replicas of a stage: their gradients averaged, once a step, after every micro-batch's backward (DDP's
        own reducer cannot follow a schedule's interleaved micro-batches); FSDP2 reduces its own."""
        if self.cfg.strategy.name.value == "fsdp" or self.dp == 1:
            return
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.part.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.mesh["dp_replicate"].get_group())
        flat /= self.dp
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)

    def _tie_gradients(self) -> None:
        if self.tie_group is None:
            return
        import torch.distributed as dist

        p = dict(self.part.named_parameters())[self.tied_name]
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(grad, group=self.tie_group)

    def _clip(self, max_norm: float) -> None:
        """The whole model's gradient norm (each stage's, the tied head's copy left out, summed over the stages) and
        every gradient scaled to it, a mesh at a time (FSDP2's shards, and its shards of TP's splits)."""
        import torch
        import torch.distributed as dist

        by_mesh: dict = {}
        for name, p in self.part.named_parameters():
            if p.grad is not None:
                counted = not (name == "lm_head.weight" and self.tie_group is not None)
                by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append((p, counted))
        squared = torch.zeros((), dtype=torch.float64, device=self.device)
        for params in by_mesh.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p, counted in params if counted], 2.0)
            squared += (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double() ** 2
        dist.all_reduce(squared, group=self.pp_group)
        total = squared.sqrt().float()
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_([p for p, _ in params], max_norm, total)

    # -- evaluating ----------------------------------------------------------------------------------------------
    def eval_losses(self, accelerator, task, batch):
        """A val batch through the stages in order (forward only, hidden states passed on point to point), the last
        stage's per-sequence losses sent to the pipeline's other ranks, then gathered over the data-parallel ranks
        (each pipeline's once, without the samples the sampler pads in)."""
        import torch
        import torch.distributed as dist
        from accelerate.utils import recursively_apply

        ids = batch["input_ids"].to(self.device)
        rank_of = lambda stage: self.first_rank(stage % self.pp)
        me = self.first_rank(self.pp_rank)
        h, hidden = None, self.part.config.hidden_size
        with self.autocast():
            for stage in range(self.n_stages):
                if stage in self.owned:
                    h = self.modules[self.owned.index(stage)](ids if stage == 0 else h)
                if stage == self.n_stages - 1 or rank_of(stage) == rank_of(stage + 1):
                    continue
                if rank_of(stage) == me:
                    dist.send(h.float().contiguous(), rank_of(stage + 1))
                elif rank_of(stage + 1) == me:
                    h = torch.empty(*ids.shape, hidden, device=self.device)
                    dist.recv(h, rank_of(stage))
        if self.n_stages - 1 in self.owned:
            sums, counts = task.eval_losses(_Logits(h), batch)
            sums, counts = sums.float(), counts.long()
        else:
            sums = torch.empty(ids.shape[0], device=self.device)
            counts = torch.empty(ids.shape[0], dtype=torch.long, device=self.device)
        dist.broadcast(sums, rank_of(self.n_stages - 1), group=self.pp_group)
        dist.broadcast(counts, rank_of(self.n_stages - 1), group=self.pp_group)
        state = accelerator.gradient_state
        remainder = state.remainder if state.end_of_dataloader else 0

        def first_pipeline(tensor):  # (the first stage's ranks, one per data-parallel index: tp index 0)
            every = accelerator.gather(tensor.contiguous())
            kept = every.reshape(accelerator.num_processes, -1, *tensor.shape[1:])[: self.dp * self.tp: self.tp]
            kept = kept.flatten(0, 1)
            return kept[:remainder] if remainder > 0 else kept

        return recursively_apply(first_pipeline, (sums, counts), test_type=torch.is_tensor)

    # -- checkpoints and export ----------------------------------------------------------------------------------
    def _full(self) -> tuple[dict, dict]:
        """This rank's stages' weights and optimizer state, whole (gathered over the stage's shards), by name."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        whole = StateDictOptions(full_state_dict=True)
        model = get_model_state_dict(self.part, options=whole)
        optimizer = get_optimizer_state_dict(self.part, self.optimizer, options=whole)
        return model, optimizer

    def save(self, out) -> None:
        """This rank's stage files, written by the stage's first data-parallel rank (every rank gathers)."""
        import torch
        from accelerate.utils import other as accelerate_other

        model, optimizer = self._full()
        if self.dp_rank == 0 and self.tp_rank == 0:
            from pathlib import Path

            accelerate_other.safe_save_file({k: v.contiguous() for k, v in model.items()},
                                            str(Path(out) / MODEL_FILE.format(self.pp_rank)), metadata={"format": "pt"})
            torch.save(optimizer, Path(out) / OPTIMIZER_FILE.format(self.pp_rank))

    def load(self, path) -> None:
        """This rank's stages' weights and optimizer state from a pipeline checkpoint of any pp (by name)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        model, optimizer = read(path)
        whole = StateDictOptions(full_state_dict=True)
        own = self.part.state_dict()
        set_model_state_dict(self.part, {k: model[_source(k, model, self.tied)] for k in own}, options=whole)
        groups = get_optimizer_state_dict(self.part, self.optimizer, options=whole)["param_groups"]
        state = {name: optimizer["state"][_source(name, optimizer["state"], self.tied)]
                 for group in groups for name in group["params"]}
        saved = optimizer["param_groups"]
        set_optimizer_state_dict(self.part, self.optimizer, {
            "state": state, "param_groups": [{**saved[i], "params": g["params"]} for i, g in enumerate(groups)]},
            options=whole)

    def whole_state_dict(self) -> dict | None:
        """The whole model's weights on the main process (None elsewhere): each stage's, gathered."""
        import torch.distributed as dist

        model, _ = self._full()
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        first = self.dp_rank == 0 and self.tp_rank == 0
        dist.gather_object({k: v.cpu() for k, v in model.items()} if first else {}, parts, dst=0)
        if parts is None:
            return None
        whole = {}
        for part in parts:
            whole.update(part)
        if self.tied:  # (stored once, as the whole model's own export stores it)
            del whole[self.tied[1]]
        return whole


def _source(name: str, saved: dict, tied: tuple) -> str:
    """Where `name`'s value is in a checkpoint: under its own name, or (a tied weight) under its other one."""
    if name in saved or name not in tied:
        return name
    return tied[1 - tied.index(name)]


def _skeleton(model):
    """The whole model without storage (meta): what `save_pretrained` exports the gathered weights as."""
    import torch

    with torch.device("meta"):
        return type(model)._from_config(model.config)


def read(path) -> tuple[dict, dict]:
    """A pipeline checkpoint's whole model and optimizer state by name (every rank's files merged)."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    model, state, groups = {}, {}, None
    for f in sorted(Path(path).glob(MODEL_FILE.format("*"))):
        model.update(load_file(f))
    for f in sorted(Path(path).glob(OPTIMIZER_FILE.format("*"))):
        saved = torch.load(f, map_location="cpu", weights_only=True)
        state.update(saved["state"])
        groups = groups or saved["param_groups"]
    return model, {"state": state, "param_groups": groups}


def written(path) -> bool:
    from pathlib import Path

    return (Path(path) / MODEL_FILE.format(0)).is_file()
