"""Metrics over a whole validation split: built-in ones by name, a torchmetrics.Metric or a plain function by
`_target_`. Each is computed once per eval from every rank's predictions and targets, gathered without the
samples a distributed sampler pads in: the value does not depend on the number of processes. No metric syncs
across ranks by itself."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from xtrain.config.task import MAXIMIZED, metric_name as name_of  # noqa: F401 (the metrics better when higher)
from xtrain.core.errors import ConfigError


def _counts(preds: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per class present in either (per label, for multi-label decisions of shape (examples, labels)), its true
    positives, false positives and false negatives."""
    preds, targets = preds.long(), targets.long()
    if preds.dim() == 2:
        hit, true = preds.bool(), targets.bool()
        return (hit & true).sum(0).double(), (hit & ~true).sum(0).double(), (~hit & true).sum(0).double()
    classes = torch.unique(torch.cat([preds, targets]))
    hit = preds[:, None] == classes[None, :]
    true = targets[:, None] == classes[None, :]
    tp = (hit & true).sum(0).double()
    return tp, (hit & ~true).sum(0).double(), (~hit & true).sum(0).double()


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    return float(torch.where(den > 0, num / den.clamp(min=1), torch.zeros_like(num)).mean())


def accuracy(preds: torch.Tensor, targets: torch.Tensor) -> float:
    """The share of examples predicted right (multi-label: every label right, as scikit-learn's subset accuracy)."""
    right = preds.long() == targets.long()
    return float((right.all(dim=1) if right.dim() == 2 else right).double().mean())


def f1_macro(preds: torch.Tensor, targets: torch.Tensor) -> float:
    tp, fp, fn = _counts(preds, targets)
    return _ratio(2 * tp, 2 * tp + fp + fn)


def precision_macro(preds: torch.Tensor, targets: torch.Tensor) -> float:
    tp, fp, _ = _counts(preds, targets)
    return _ratio(tp, tp + fp)


def recall_macro(preds: torch.Tensor, targets: torch.Tensor) -> float:
    tp, _, fn = _counts(preds, targets)
    return _ratio(tp, tp + fn)


def mse(preds: torch.Tensor, targets: torch.Tensor) -> float:
    return float(((preds.double() - targets.double()) ** 2).mean())


def mae(preds: torch.Tensor, targets: torch.Tensor) -> float:
    return float((preds.double() - targets.double()).abs().mean())


BUILT_IN: dict[str, Callable] = {f.__name__: f for f in (accuracy, f1_macro, precision_macro, recall_macro, mse, mae)}


@dataclass
class Metric:
    name: str
    compute: Callable[[torch.Tensor, torch.Tensor], float]


def resolve(key: str, path: str) -> Any:
    """The object a `_target_` names; a ConfigError naming the key, the path and the real import error."""
    module_name, _, attr = path.rpartition(".")
    try:
        if not module_name:
            raise ImportError(f"{path!r} is not a dotted path (module.name)")
        found = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
        return found
    except AttributeError:
        raise ConfigError(f"{key}._target_={path}: module {module_name} has no {attr}") from None
    except Exception as err:  # whatever importing the user's module raised
        raise ConfigError(f"{key}._target_={path}: cannot import: {type(err).__name__}: {err}") from None


def build(specs: list) -> list[Metric]:
    """`task.metrics` entries: built-in names, or {_target_, [name], **kwargs}."""
    built = []
    for i, spec in enumerate(specs):
        if isinstance(spec, str):
            if spec not in BUILT_IN:
                raise ConfigError(f"task.metrics: no built-in metric {spec}; choose from {', '.join(BUILT_IN)}, "
                                  "or give {_target_: ...}")
            built.append(Metric(spec, BUILT_IN[spec]))
            continue
        if not isinstance(spec, dict) or "_target_" not in spec:
            raise ConfigError(f"task.metrics[{i}]={spec}: a built-in name or {{_target_: ...}}")
        kwargs = {k: v for k, v in spec.items() if k not in ("_target_", "name")}
        found = resolve(f"task.metrics[{i}]", spec["_target_"])
        name = name_of(spec)
        if isinstance(found, type):
            built.append(Metric(name, _torchmetric(found(**kwargs))))
        elif callable(found):
            built.append(Metric(name, (lambda f, kw: lambda p, t: float(f(p, t, **kw)))(found, kwargs)))
        else:
            raise ConfigError(f"task.metrics[{i}]._target_={spec['_target_']}: neither a metric class nor a function")
    names = [m.name for m in built]
    if len(set(names)) < len(names):
        raise ConfigError(f"task.metrics: two metrics are named {next(n for n in names if names.count(n) > 1)}; "
                          "give one a name: {_target_: ..., name: ...}")
    return built


def _torchmetric(metric) -> Callable:
    """A torchmetrics.Metric (or any object with update/compute/reset) over the gathered split, in one update."""
    if not (hasattr(metric, "update") and hasattr(metric, "compute")):
        raise ConfigError(f"task.metrics: {type(metric).__name__} has no update/compute (a torchmetrics.Metric)")
    if hasattr(metric, "sync_on_compute"):
        metric.sync_on_compute = False  # the inputs are every rank's already

    def compute(preds: torch.Tensor, targets: torch.Tensor) -> float:
        metric.reset()
        metric.update(preds, targets)
        return float(metric.compute())

    return compute
