"""Metrics over a whole validation split: built-in ones by name, a torchmetrics.Metric or a plain function by
`_target_`. Each is computed once per eval from every rank's outputs and targets, gathered without the samples a
distributed sampler pads in: the value does not depend on the number of processes. No metric syncs across ranks by
itself.

Each metric gets the form of the outputs it needs (`Outputs`): class ids (`preds`: the argmax over two or more
outputs, a single logit thresholded at 0, each label's logit thresholded at 0), scores (`probs`: the softmax, a
single logit's sigmoid) or the outputs as they are (`logits`); a regression's `preds` are its outputs. The problem
(multiclass, binary, multilabel, regression) is the task's where it declares one, else read off the outputs' and
targets' shapes and values. Every eval value has a direction where one is known (`direction`): built-ins,
torchmetrics' `higher_is_better`, or the entry's `direction:`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from xtrain.config.task import DIRECTIONS, METRIC_KEYS, RESERVED_NAMES, metric_name as name_of
from xtrain.core.errors import ConfigError
from xtrain.tasks.targets import check_keywords, resolve

PREDS, PROBS, LOGITS = "preds", "probs", "logits"
INPUTS = (PREDS, PROBS, LOGITS)
MULTICLASS, BINARY, MULTILABEL, REGRESSION = "multiclass", "binary", "multilabel", "regression"
CLASSIFICATION = (MULTICLASS, BINARY, MULTILABEL)
OTHER = "other"  # outputs of another shape (one per position, say): only `input: logits` metrics take them


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


@dataclass
class Metric:
    name: str
    compute: Callable[[Any, torch.Tensor], Any]  # (the outputs in `input`'s form, targets) -> a number or an array
    input: str = PREDS  # the form of the outputs it takes
    direction: str | None = None  # maximize | minimize; None: not known (no best is recorded)
    fits: str | None = None  # the problems it measures: "classification", "regression", or any (None)
    per_class: bool = False  # a two-class model's scores as (N, 2), not the positive class's (torchmetrics' Multiclass*)
    label: str = ""  # how an error names it


_BUILT_IN = {accuracy: ("maximize", "classification"), f1_macro: ("maximize", "classification"),
             precision_macro: ("maximize", "classification"), recall_macro: ("maximize", "classification"),
             mse: ("minimize", "regression"), mae: ("minimize", "regression")}
BUILT_IN: dict[str, Callable] = {f.__name__: f for f in _BUILT_IN}
CLASS_METRICS = [name for name, f in BUILT_IN.items() if _BUILT_IN[f][1] == "classification"]
NUMBER_METRICS = [name for name, f in BUILT_IN.items() if _BUILT_IN[f][1] == "regression"]


def build(specs: list) -> list[Metric]:
    """`task.metrics` entries: built-in names, or {_target_, [name], [input], [direction], **kwargs}."""
    built = []
    for i, spec in enumerate(specs):
        if isinstance(spec, str):
            if spec not in BUILT_IN:
                raise ConfigError(f"task.metrics: no built-in metric {spec}; choose from {', '.join(BUILT_IN)}, "
                                  "or give {_target_: ...}")
            direction, fits = _BUILT_IN[BUILT_IN[spec]]
            built.append(Metric(spec, BUILT_IN[spec], PREDS, direction, fits, label=spec))
            continue
        if not isinstance(spec, dict) or "_target_" not in spec:
            raise ConfigError(f"task.metrics[{i}]={spec}: a built-in name or {{_target_: ...}}")
        built.append(_by_target(i, spec))
    names = [m.name for m in built]
    for name in names:
        if name in RESERVED_NAMES:
            raise ConfigError(f"task.metrics: a metric is named {name}, the eval's own val_{name}; give it another "
                              "name: {_target_: ..., name: ...}")
    if len(set(names)) < len(names):
        raise ConfigError(f"task.metrics: two metrics are named {next(n for n in names if names.count(n) > 1)}; "
                          "give one a name: {_target_: ..., name: ...}")
    return built


def _by_target(i: int, spec: dict) -> Metric:
    key, path = f"task.metrics[{i}]", spec["_target_"]
    asked_input, asked_direction = spec.get("input"), spec.get("direction")
    if asked_input is not None and asked_input not in INPUTS:
        raise ConfigError(f"{key}.input={asked_input}: choose {', '.join(INPUTS)} (class ids or the prediction, scores, "
                          "the outputs as they are)")
    if asked_direction is not None and asked_direction not in DIRECTIONS:
        raise ConfigError(f"{key}.direction={asked_direction}: choose {' or '.join(DIRECTIONS)}")
    kwargs = {k: v for k, v in spec.items() if k not in METRIC_KEYS}
    found = resolve(key, path)
    check_keywords(key, path, found, kwargs)
    name = name_of(spec)
    if isinstance(found, type):
        try:
            instance = found(**kwargs)
        except Exception as err:
            raise ConfigError(f"{key}._target_={path}: calling it failed: {type(err).__name__}: {err}") from None
        module = type(instance).__module__
        classifies = module.startswith("torchmetrics.classification")
        regresses = module.startswith("torchmetrics.regression")
        better = getattr(instance, "higher_is_better", None)
        known = None if better is None else "maximize" if better else "minimize"
        if known and asked_direction and asked_direction != known:
            raise ConfigError(f"{key}.direction={asked_direction}: {type(instance).__name__} is better when "
                              f"{'higher' if better else 'lower'} (its higher_is_better); use direction: {known}")
        return Metric(name, _torchmetric(instance), asked_input or (PROBS if classifies else PREDS),
                      asked_direction or known, "classification" if classifies else "regression" if regresses else None,
                      per_class=hasattr(instance, "num_classes"), label=path)
    if callable(found):
        function = (lambda f, kw: lambda p, t: f(p, t, **kw))(found, kwargs)
        return Metric(name, function, asked_input or PREDS, asked_direction,
                      "classification" if asked_input == PROBS else None, label=path)
    raise ConfigError(f"{key}._target_={path}: neither a metric class nor a function")


def _torchmetric(metric) -> Callable:
    """A torchmetrics.Metric (or any object with update/compute/reset) over the gathered split, in one update."""
    if not (hasattr(metric, "update") and hasattr(metric, "compute")):
        raise ConfigError(f"task.metrics: {type(metric).__name__} has no update/compute (a torchmetrics.Metric)")
    never_syncs(metric)

    def compute(inputs: torch.Tensor, targets: torch.Tensor):
        metric.reset()
        metric.update(inputs, targets)
        return metric.compute()

    return compute


def never_syncs(metric) -> None:
    """A torchmetrics.Metric (and every metric inside it: a collection's, a wrapper's) that computes on its own
    states: the inputs are every rank's already, and a sync would add the other ranks' copies of them again (every
    count doubled on 2 processes). torchmetrics copies `sync_on_compute` into `_to_sync` when it is built and after
    each `forward`, and reads only the copy when it computes: both are set."""
    parts = metric.modules() if isinstance(metric, torch.nn.Module) else [metric]
    for part in parts:
        if hasattr(part, "sync_on_compute"):
            part.sync_on_compute = False
            part._to_sync = False


def directions(metrics: list[Metric]) -> dict[str, str | None]:
    """Each eval value (`val_loss`, `val_<name>`) and its direction (None where it is not known)."""
    return {"val_loss": "minimize", **{f"val_{m.name}": m.direction for m in metrics}}


def for_task(cfg) -> list[Metric]:
    """A run config's `task.metrics`, built."""
    return build(list(cfg.task.metrics))


def check(metrics: list[Metric], outputs: "Outputs") -> set[str]:
    """Before anything launches: every metric on a probe's outputs (a ConfigError naming the first that cannot take
    them); the eval values that came out as arrays (`val_<name>`: they have no best, and no monitor may name them)."""
    values = compute_all(metrics, outputs)
    return {f"val_{name}" for name, value in values.items() if not is_scalar(value)}


def stand_in(problem: str, num_labels: int) -> "Outputs":
    """Outputs and targets of the shapes a task declares (its problem and number of labels), every class present in
    the targets: what the driver puts through the metrics where it builds no model before launch."""
    g = torch.Generator().manual_seed(0)
    n = max(64, 4 * num_labels)
    if problem == REGRESSION:
        return Outputs(torch.randn(n, generator=g), torch.randn(n, generator=g), problem)
    if problem == MULTILABEL:  # label j alternates in runs of 1 + j % 4 examples: both values in every column
        runs = torch.arange(n)[:, None] // (1 + torch.arange(num_labels)[None, :] % 4)
        return Outputs(torch.randn(n, num_labels, generator=g), (runs % 2).float(), problem)
    return Outputs(torch.randn(n, num_labels, generator=g), torch.arange(n) % num_labels, problem)


def zero_one(targets: torch.Tensor) -> bool:
    return bool(((targets == 0) | (targets == 1)).all())


def problem_of(outputs: torch.Tensor, targets: torch.Tensor) -> str:
    """The problem the outputs and targets pose, from their shapes and the targets' values."""
    n = len(targets)
    if outputs.dim() == 2 and outputs.shape[1] >= 2 and targets.dim() == 1:
        return MULTICLASS
    if outputs.numel() == n and outputs.shape[0] == n and targets.dim() == 1:  # one output per example
        return BINARY if zero_one(targets) else REGRESSION
    if outputs.dim() == 2 and outputs.shape == targets.shape:
        return MULTILABEL if zero_one(targets) else REGRESSION
    return OTHER


class Outputs:
    """An eval's gathered outputs (fp32, one row per example) and targets, in each form a metric may take."""

    def __init__(self, outputs: torch.Tensor, targets: torch.Tensor, problem: str | None = None):
        self.raw = outputs.float()
        if self.raw.dim() == 2 and self.raw.shape[1] == 1 and targets.dim() == 1:
            self.raw = self.raw[:, 0]  # one logit (or number) per example
        self.targets = targets
        self.problem = problem or problem_of(self.raw, targets)

    def shape_text(self) -> str:
        return f"outputs of shape {tuple(self.raw.shape)} and targets of shape {tuple(self.targets.shape)}"

    def form(self, metric: Metric) -> tuple[torch.Tensor, torch.Tensor]:
        """(the outputs as `metric` takes them, the targets), or a ConfigError where it does not fit the problem."""
        self._check(metric)
        targets = self.targets.long() if self.problem in CLASSIFICATION else self.targets
        if metric.input == LOGITS:
            return self.raw, self.targets
        if metric.input == PROBS:
            return self.probs(metric.per_class), targets
        return self.preds(), targets

    def preds(self) -> torch.Tensor:
        if self.problem == MULTICLASS:
            return self.raw.argmax(dim=1)
        if self.problem in (BINARY, MULTILABEL):
            return (self.raw > 0).long()
        return self.raw

    def probs(self, per_class: bool) -> torch.Tensor:
        if self.problem == MULTICLASS:
            probs = self.raw.softmax(dim=1)
            return probs[:, 1] if probs.shape[1] == 2 and not per_class else probs
        probs = self.raw.sigmoid()
        return torch.stack([1 - probs, probs], dim=1) if per_class and self.problem == BINARY else probs

    def _check(self, metric: Metric) -> None:
        name = f"task.metrics: {metric.name}"
        if self.problem == OTHER and metric.input != LOGITS:
            raise ConfigError(f"{name}: the eval gives {self.shape_text()}: a metric takes one prediction per example "
                              "(a class, a number, or labels); give the metric input: logits to take the outputs "
                              "as they are")
        if metric.fits == "classification" and self.problem == REGRESSION:
            raise ConfigError(f"{name} measures classes, but the eval gives {self.shape_text()} with targets other "
                              f"than class ids (a regression); use {' or '.join(NUMBER_METRICS)}")
        if metric.fits == "regression" and self.problem == MULTICLASS:
            raise ConfigError(f"{name} measures numbers, but the eval gives {self.shape_text()}: "
                              f"{self.raw.shape[1]} outputs per class id (a classification); use "
                              f"{', '.join(CLASS_METRICS)}")
        if metric.input == PROBS and self.problem == REGRESSION:
            raise ConfigError(f"{name} takes scores (input: probs), but the eval gives {self.shape_text()} (a "
                              "regression); give it input: preds")


def compute_all(metrics: list[Metric], outputs: Outputs) -> dict[str, Any]:
    """Each metric's value: a float, or (a confusion matrix, a curve) a nested list. A metric that cannot take
    its inputs is a ConfigError naming it, what it was given and what would work."""
    values = {}
    for metric in metrics:
        inputs, targets = outputs.form(metric)
        try:
            value = metric.compute(inputs, targets)
        except ConfigError:
            raise
        except Exception as err:
            text = " ".join(str(err).split())[:300]
            raise ConfigError(
                f"task.metrics: {metric.label or metric.name} failed on {metric.input} of shape {tuple(inputs.shape)} "
                f"({str(inputs.dtype).removeprefix('torch.')}) and targets of shape {tuple(targets.shape)} "
                f"({str(targets.dtype).removeprefix('torch.')}): {type(err).__name__}: {text}; give the entry the "
                f"input it takes (input: {', '.join(INPUTS)}) or the settings it needs"
            ) from None
        values[metric.name] = as_value(value)
    return values


def as_value(value) -> float | list:
    """A metric's result: a float where it is one number, else its values as nested lists."""
    if isinstance(value, (tuple, list)):
        parts = [as_value(v) for v in value]
        return parts[0] if len(parts) == 1 and isinstance(parts[0], float) else parts
    if isinstance(value, (int, float)) or getattr(value, "ndim", None) == 0:  # (numpy's scalars too)
        return float(value)
    tensor = torch.as_tensor(value)
    if tensor.numel() == 1:
        return float(tensor)
    return tensor.tolist()


def is_scalar(value) -> bool:
    return isinstance(value, float)


def better(direction: str | None, value: float, best: float | None, min_delta: float = 0.0) -> bool:
    """`value` improves on `best` in `direction` by more than `min_delta` (a NaN never does; a first finite value
    always does)."""
    if direction is None or not math.isfinite(value):
        return False
    if best is None or not math.isfinite(best):
        return True
    gain = value - best if direction == "maximize" else best - value
    return gain > min_delta
