"""`task=custom`: the user's own model, datasets, loss and metrics, by `_target_`.

A dataset item is a dict of tensors (its `target`, `label` or `labels` entry the target, the rest the model's
keyword arguments) or an `(inputs, target)` tuple. The loss is per example, or per position where the targets are
a class id per position (default: cross-entropy), and averaged as torch's own losses average: over the examples, or
over the positions whose target is not the loss's `ignore_index`, of the whole optimizer step; the val loss so over
the whole split. The metrics see the whole split's outputs in the form each takes (tasks/metrics.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

from xtrain.config.schema import RunConfig
from xtrain.config.task import given
from xtrain.core.errors import ConfigError
from xtrain.data.collate import CastFloat64
from xtrain.tasks import metrics as built_in
from xtrain.tasks.base import TaskData
from xtrain.tasks.targets import call, check_keywords, importable, resolve, takes

TARGET_KEYS = ("target", "label", "labels")
MODEL_FILE, MODEL_NODE = "model.safetensors", "model.json"
PROBE_VAL = 256  # val items the driver puts through the metrics before launching


def build_model(cfg: RunConfig) -> torch.nn.Module:
    importable(cfg.task.code_dir)
    model = call("model", cfg.model.node())
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model._target_={cfg.model.target}: returned a {type(model).__name__}, not a "
                          "torch.nn.Module")
    return model


def split_of(batch):
    """(inputs, target) of a collated batch."""
    if isinstance(batch, dict):
        key = next(k for k in TARGET_KEYS if k in batch)
        return {k: v for k, v in batch.items() if k != key}, batch[key]
    return batch[0], batch[1]


def check_item(key: str, item) -> None:
    """A dataset item the loop can use: a dict of tensors with a target, or an (inputs, target) pair."""
    if isinstance(item, dict):
        if not any(k in item for k in TARGET_KEYS):
            raise ConfigError(f"{key}: an item is a dict with keys {', '.join(map(str, item))}: it needs its target "
                              f"under one of {', '.join(TARGET_KEYS)}")
        return
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return
    found = f"a {type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
    raise ConfigError(f"{key}: an item is {found}; give (inputs, target) tuples or dicts of tensors with a target "
                      f"({', '.join(TARGET_KEYS)})")


def build_datasets(cfg: RunConfig) -> tuple:
    """The train and val datasets, and the test dataset where `data.test` names one (else None)."""
    importable(cfg.task.code_dir)
    sets = []
    for split in ("train", "val", "test"):
        node = given(getattr(cfg.data, split))
        if node is None:
            sets.append(None)
            continue
        dataset = call(f"data.{split}", node)
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ConfigError(f"data.{split}._target_={node['_target_']}: returned a "
                              f"{type(dataset).__name__}, not a map-style dataset (__getitem__ and __len__)")
        if len(dataset) == 0:
            raise ConfigError(f"data.{split}._target_={node['_target_']}: the dataset is empty")
        check_item(f"data.{split}", dataset[0])
        sets.append(dataset)
    return tuple(sets)


class Custom:
    throughput_unit = "examples"
    batch_unit = "examples"  # what the effective batch counts
    perplexity = False
    problem: str | None = None  # read off the outputs and targets (tasks/metrics.py)

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        importable(cfg.task.code_dir)  # (a metric by _target_ may be the user's)
        self.metrics = built_in.for_task(cfg)
        self._loss = None

    def directions(self) -> dict[str, str | None]:
        return built_in.directions(self.metrics)

    def check(self) -> set[str]:
        """On the driver, before anything launches: every `_target_` imports and builds, the items have a shape the
        loop can use, and a train batch, a val batch and a test batch go through the model, the loss and every
        metric. Returns the eval values that came out as arrays."""
        train_set, val_set, test_set = build_datasets(self.cfg)
        self.loss_fn()
        self.collate()
        model = build_model(self.cfg)
        batch_size = max(2, self.cfg.trainer.batch_size)
        arrays = set()
        with torch.no_grad():
            self.probe(model, train_set, batch_size, "data.train")
            model.eval()
            for key, dataset in (("data.val", val_set), ("data.test", test_set)):
                if dataset is None:
                    continue
                _, _, outputs, targets = self.probe(model, dataset, max(batch_size, PROBE_VAL), key)
                if self.metrics:
                    arrays |= built_in.check(self.metrics, built_in.Outputs(outputs, targets, self.problem))
        return arrays

    def probe(self, model, dataset, size: int, key: str):
        """The first `size` items of `dataset` through the model and the loss: a failure is one line."""
        batch = self.collate(quiet=True)([dataset[i] for i in range(min(size, len(dataset)))])
        inputs, target = split_of(batch)
        try:
            outputs = self.forward(model, inputs)
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError(f"model._target_={self.cfg.model.target}: its forward failed on a batch of {key} "
                              f"({describe(inputs)}): {type(err).__name__}: {one_line(err)}") from None
        try:
            return self.per_example(model, batch)
        except ConfigError:
            raise
        except Exception as err:
            node = given(self.cfg.task.loss)
            name = f"task.loss._target_={node['_target_']}" if node else "task.loss (cross-entropy)"
            raise ConfigError(f"{name}: failed on outputs of shape {describe(outputs)} and targets of shape "
                              f"{describe(target)}: {type(err).__name__}: {one_line(err)}") from None

    def collate(self, quiet: bool = False):
        """What makes a batch of items: `data.collate_fn` where given (its batches' float64 tensors cast too), else
        torch's default collate."""
        node = given(getattr(self.cfg.data, "collate_fn", None))
        users = resolve("data.collate_fn", node["_target_"]) if node else None
        if users is not None and len(node) > 1:
            users = functools.partial(users, **{k: v for k, v in node.items() if k != "_target_"})
        return CastFloat64(users, quiet=quiet)

    def identity(self) -> dict:
        return {"model": self.cfg.model.node()}

    def prepare(self) -> None:
        """Nothing to prepare: the datasets are the user's."""

    def on_meta(self) -> torch.nn.Module:
        with torch.device("meta"):
            return build_model(self.cfg)

    def data(self) -> TaskData:
        """The datasets (and the collate), without a model."""
        train_set, val_set, test_set = build_datasets(self.cfg)
        return TaskData(None, train_set, val_set, unit="examples", collate=self.collate(), test_set=test_set)

    def build(self, accelerator) -> TaskData:
        built = self.data()
        built.model = build_model(self.cfg)
        return built

    def loss_fn(self):
        if self._loss is None:
            node = given(self.cfg.task.loss)
            if node is None:
                self._loss = lambda outputs, target: F.cross_entropy(outputs.float(), target, reduction="none")
                self.ignore_index = -100
            else:
                importable(self.cfg.task.code_dir)
                target = resolve("task.loss", node["_target_"])
                kwargs = {k: v for k, v in node.items() if k != "_target_"}
                check_keywords("task.loss", node["_target_"], target, kwargs)
                if isinstance(target, type):
                    module = call("task.loss", node)
                    if hasattr(module, "reduction"):
                        module.reduction = "none"  # per example: the val loss is exact over the split
                    self._loss = module
                else:
                    if "reduction" not in kwargs and takes(target, "reduction"):  # torch.nn.functional's losses
                        kwargs["reduction"] = "none"
                    self._loss = (lambda f, kw: lambda o, t: f(o, t, **kw))(target, kwargs)
                self.ignore_index = getattr(self._loss, "ignore_index", kwargs.get("ignore_index", -100))
        return self._loss

    def forward(self, model, inputs) -> torch.Tensor:
        """The model's outputs as a tensor: itself, its `.logits`, a dict's `logits`, or a tuple's first item."""
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        if isinstance(out, Mapping):
            if "logits" not in out:
                raise ConfigError(f"model._target_={self.cfg.model.target}: returned a dict with keys "
                                  f"{', '.join(map(str, out))}; return the outputs as a tensor, or under 'logits'")
            return out["logits"]
        if hasattr(out, "logits"):
            return out.logits
        return out[0] if isinstance(out, (tuple, list)) else out

    def per_position(self, target: torch.Tensor) -> bool:
        """Targets with one class id per position (a sequence's): the loss counts the positions, not the examples."""
        return target.dim() >= 2 and not target.is_floating_point()

    def per_example(self, model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per example of the batch: its summed loss over what counts and how much counts (1, or its positions
        whose target is not the loss's ignore_index), then the outputs and targets."""
        inputs, target = split_of(batch)
        outputs = self.forward(model, inputs)
        losses = self.loss_fn()(outputs, target)
        n = len(target)
        shapes = f"outputs of shape {tuple(outputs.shape)} and targets of shape {tuple(target.shape)}"
        if losses.dim() == 0:
            raise ConfigError("task.loss: returned one value for the batch; return one loss per example "
                              "(reduction='none')")
        if n > 1 and losses.numel() > max(outputs.numel(), target.numel()):
            raise ConfigError(f"task.loss: gave losses of shape {tuple(losses.shape)} for {shapes}: the two broadcast "
                              "against each other; give them one shape (the model returning outputs.squeeze(-1), or "
                              f"targets of shape {tuple(outputs.shape)})")
        if self.per_position(target):
            if losses.numel() != target.numel():
                raise ConfigError(f"task.loss: gave losses of shape {tuple(losses.shape)} for {shapes}; return one "
                                  "loss per position (reduction='none'), so that the positions that count are averaged")
            counts = target != self.ignore_index
            sums = torch.where(counts, losses.reshape(target.shape).float(), 0.0).reshape(n, -1).sum(dim=1)
            return sums, counts.reshape(n, -1).sum(dim=1), outputs, target
        if losses.shape[0] != n:
            raise ConfigError(f"task.loss: gave losses of shape {tuple(losses.shape)} for {shapes}; return one loss "
                              "per example (reduction='none')")
        if losses.dim() > 1:  # e.g. per label: an example's loss is their mean
            losses = losses.reshape(n, -1).mean(dim=1)
        return losses.float(), torch.ones_like(losses, dtype=torch.long), outputs, target

    def weight(self, batch):
        """What the batch's loss is an average over: its examples, or its positions that count."""
        target = split_of(batch)[1]
        if self.per_position(target):
            self.loss_fn()
            return (target != self.ignore_index).sum()
        return len(target)

    def loss(self, model, batch, per) -> torch.Tensor:
        """The batch's summed loss over `per`, the examples (or positions) one micro-batch of the step holds."""
        return self.per_example(model, batch)[0].sum() / per

    def eval_losses(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        losses, counts, _, _ = self.per_example(model, batch)
        return losses, counts

    def eval_outputs(self, model, batch) -> tuple[torch.Tensor, ...]:
        """Per example: its summed loss, what it counts, its outputs (fp32) and its target."""
        losses, counts, outputs, target = self.per_example(model, batch)
        return losses, counts, outputs.detach().float(), target

    def count(self, batch) -> int:
        """Examples the batch trains on (the throughput's unit for this task)."""
        return len(split_of(batch)[1])

    def export(self, model, state_dict: dict, out: Path) -> None:
        """`out/model`: the weights (safetensors) and the model node that builds the module (`xtrain.load_model`)."""
        from safetensors.torch import save_file

        (out / "model").mkdir(parents=True)
        save_file({k: v.detach().clone().contiguous() for k, v in state_dict.items()}, str(out / "model" / MODEL_FILE))
        node = {"model": self.model_node(), "code_dir": self.cfg.task.code_dir}
        (out / "model" / MODEL_NODE).write_text(json.dumps(node, indent=2) + "\n")

    def model_node(self) -> dict:
        """The node that builds the trained module again: `_target_` and its arguments."""
        return self.cfg.model.node()

    def samples(self, model, prompts: list[str], max_tokens: int) -> list[str]:
        raise ConfigError("trainer.sample_prompts: answering prompts is for task=causal_lm")


def describe(inputs) -> str:
    """Tensors' shapes and dtypes, as an error line shows them: `(32, 1) (float32)`."""
    if isinstance(inputs, dict):
        return ", ".join(f"{k}: {describe(v)}" for k, v in inputs.items())
    if torch.is_tensor(inputs):
        return f"{tuple(inputs.shape)} ({str(inputs.dtype).removeprefix('torch.')})"
    return type(inputs).__name__


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]


def load(path: Path) -> torch.nn.Module:
    """A trained model from `<run dir>/model`: built from its node, its weights loaded."""
    from safetensors.torch import load_file

    node = json.loads((path / MODEL_NODE).read_text())
    importable(node.get("code_dir"))
    model = call("model", node["model"])
    model.load_state_dict(load_file(str(path / MODEL_FILE)))
    return model
