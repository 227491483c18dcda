"""`task=custom`: the user's own model, datasets, loss and metrics, by `_target_`.

A dataset item is a dict of tensors (its `target`, `label` or `labels` entry the target, the rest the model's
keyword arguments) or an `(inputs, target)` tuple. The loss is per example (default: cross-entropy), so the val
loss is exact over the split; the metrics see the whole split's predictions: the class with the highest output,
or the output itself where there is one per example (regression).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from xtrain.config.schema import RunConfig
from xtrain.core.errors import ConfigError
from xtrain.tasks import metrics as built_in
from xtrain.tasks.base import TaskData

TARGET_KEYS = ("target", "label", "labels")
MODEL_FILE, MODEL_NODE = "model.safetensors", "model.json"


def importable(code_dir: str | None) -> None:
    """The user's modules (the directory the command ran from) importable in this process."""
    where = code_dir or os.getcwd()
    if where not in sys.path:
        sys.path.insert(0, where)


def call(key: str, node: dict, **extra):
    """The callable a `{_target_, **kwargs}` node names, called with its arguments; a failure is one line."""
    target = built_in.resolve(key, node["_target_"])
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    try:
        return target(**kwargs, **extra)
    except Exception as err:
        raise ConfigError(f"{key}._target_={node['_target_']}: calling it failed: {type(err).__name__}: {err}") from None


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
    importable(cfg.task.code_dir)
    sets = []
    for split in ("train", "val"):
        dataset = call(f"data.{split}", getattr(cfg.data, split))
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ConfigError(f"data.{split}._target_={getattr(cfg.data, split)['_target_']}: returned a "
                              f"{type(dataset).__name__}, not a map-style dataset (__getitem__ and __len__)")
        if len(dataset) == 0:
            raise ConfigError(f"data.{split}._target_={getattr(cfg.data, split)['_target_']}: the dataset is empty")
        check_item(f"data.{split}", dataset[0])
        sets.append(dataset)
    return tuple(sets)


class Custom:
    throughput_unit = "examples"
    batch_unit = "examples"  # what the effective batch counts
    perplexity = False

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.metrics = built_in.build(list(cfg.task.metrics))
        self._loss = None

    def check(self) -> None:
        """On the driver, before anything launches: every `_target_` imports and builds, the items have a shape the
        loop can use, the loss does."""
        build_datasets(self.cfg)
        self.loss_fn()

    def identity(self) -> dict:
        return {"model": self.cfg.model.node()}

    def prepare(self) -> None:
        """Nothing to prepare: the datasets are the user's."""

    def on_meta(self) -> torch.nn.Module:
        with torch.device("meta"):
            return build_model(self.cfg)

    def build(self, accelerator) -> TaskData:
        train_set, val_set = build_datasets(self.cfg)
        return TaskData(build_model(self.cfg), train_set, val_set, unit="examples")

    def loss_fn(self):
        if self._loss is None:
            node = self.cfg.task.loss
            if node is None:
                self._loss = lambda outputs, target: F.cross_entropy(outputs.float(), target, reduction="none")
            else:
                importable(self.cfg.task.code_dir)
                target = built_in.resolve("task.loss", node["_target_"])
                kwargs = {k: v for k, v in node.items() if k != "_target_"}
                if isinstance(target, type):
                    module = target(**kwargs)
                    if hasattr(module, "reduction"):
                        module.reduction = "none"  # per example: the val loss is exact over the split
                    self._loss = module
                else:
                    self._loss = (lambda f, kw: lambda o, t: f(o, t, **kw))(target, kwargs)
        return self._loss

    def forward(self, model, inputs):
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        if hasattr(out, "logits"):
            return out.logits
        return out[0] if isinstance(out, (tuple, list)) else out

    def per_example(self, model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, target = split_of(batch)
        outputs = self.forward(model, inputs)
        losses = self.loss_fn()(outputs, target)
        if losses.dim() == 0:
            raise ConfigError("task.loss: returned one value for the batch; return one loss per example "
                              "(reduction='none')")
        if losses.dim() > 1:  # e.g. per label: an example's loss is their mean
            losses = losses.reshape(len(target), -1).mean(dim=1)
        return losses.float(), outputs, target

    def loss(self, model, batch) -> torch.Tensor:
        return self.per_example(model, batch)[0].mean()

    def eval_losses(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        losses, _, _ = self.per_example(model, batch)
        return losses, torch.ones_like(losses)

    def eval_outputs(self, model, batch) -> tuple[torch.Tensor, ...]:
        """Per example: its loss, its weight (1), its prediction and its target."""
        losses, outputs, target = self.per_example(model, batch)
        return losses, torch.ones_like(losses), self.predict(outputs), target

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        return predictions(outputs)

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


def predictions(outputs: torch.Tensor) -> torch.Tensor:
    """The predicted class (the highest output) where there are several per example; else the output."""
    if outputs.dim() == 2 and outputs.shape[1] > 1:
        return outputs.argmax(dim=1)
    return outputs.reshape(len(outputs)).float()


def load(path: Path) -> torch.nn.Module:
    """A trained model from `<run dir>/model`: built from its node, its weights loaded."""
    from safetensors.torch import load_file

    node = json.loads((path / MODEL_NODE).read_text())
    importable(node.get("code_dir"))
    model = call("model", node["model"])
    model.load_state_dict(load_file(str(path / MODEL_FILE)))
    return model
