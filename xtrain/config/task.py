"""The `task` settings, a user's own model and datasets by `_target_` (`task=custom`), and the eval values a task
records, which `trainer.monitor` and a study's objective may name (with their direction)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from xtrain.config.fields import setting
from xtrain.config.lora import LoraConfig
from xtrain.core.errors import ConfigError

TARGET = "_target_"
MAXIMIZED = {"accuracy", "f1_macro", "precision_macro", "recall_macro"}  # built-in metrics better when higher
MINIMIZED = {"loss", "ppl", "mse", "mae"}
DIRECTIONS = ("maximize", "minimize")
METRIC_KEYS = (TARGET, "name", "input", "direction")  # a task.metrics entry's own keys; the rest are its arguments
RESERVED_NAMES = ("loss", "ppl")  # the eval's own values: no metric may take their names


class TaskKind(Enum):
    causal_lm = "causal_lm"
    seq_cls = "seq_cls"
    image_cls = "image_cls"
    custom = "custom"


class Direction(Enum):
    auto = "auto"  # maximize accuracy, f1_macro, precision_macro, recall_macro; minimize loss, ppl, mse, mae
    maximize = "maximize"
    minimize = "minimize"


class Export(Enum):
    last = "last"  # model/ holds the model as training ended
    best = "best"  # model/ holds the model of the eval with the best `trainer.monitor`


class Problem(Enum):
    single_label = "single_label"  # one class per example (an int id or a name)
    multi_label = "multi_label"  # a list of classes per example (ids or names)
    regression = "regression"  # a number per example


PROBLEM_TYPES = {Problem.single_label: "single_label_classification",  # transformers' config.problem_type
                 Problem.multi_label: "multi_label_classification", Problem.regression: "regression"}


def unset() -> dict:
    """A `_target_` node nobody set: `{_target_: null}` (so that `key._target_=...` and `+key.NAME=...` can fill it)."""
    return {TARGET: None}


def given(node: Any) -> dict | None:
    """A `{_target_: ..., **kwargs}` node the user set, else None."""
    return dict(node) if isinstance(node, dict) and node.get(TARGET) else None


def check_target_node(key: str, node: Any) -> None:
    """Arguments with no `_target_` to take them are refused: they would do nothing."""
    if isinstance(node, dict) and not node.get(TARGET) and set(node) - {TARGET}:
        name = sorted(set(node) - {TARGET})[0]
        raise ConfigError(f"{key}.{name}: an argument, but {key}._target_ is not set; give the callable too, e.g. "
                          f"{key}._target_=mymodule.build")



@dataclass
class TaskConfig:
    name: TaskKind = TaskKind.causal_lm
    """What is trained; each option of the `task` group sets it."""
    metrics: List[Any] = field(default_factory=list)
    """`task=custom`, `seq_cls`, `image_cls`: metrics computed over the whole val split at each eval: built-in names
    (accuracy, f1_macro, precision_macro, recall_macro, mse, mae) and/or `{_target_: ...}` entries (a
    torchmetrics.Metric, or a function fn(inputs, targets) -> a number or an array), with `name`, `input` (`preds`:
    class ids or a regression's outputs; `probs`: scores; `logits`: the outputs as they are; torchmetrics'
    classification metrics get `probs` unasked) and `direction` (`maximize` or `minimize`; torchmetrics' own
    `higher_is_better` unasked)."""
    loss: Dict[str, Any] = field(default_factory=unset)
    """`task=custom`: `task.loss._target_=...` (its arguments: `+task.loss.NAME=VALUE`), a loss module or function
    of (outputs, targets), per example or per position (torch's get reduction='none'); unset: cross-entropy."""
    code_dir: Optional[str] = setting(None, free=True)
    """Where the `_target_`s' modules (a model, datasets, a loss, metrics, callbacks, an optimizer, a schedule) are
    imported from on every rank and node (default: the directory the command runs from, recorded in run.yaml where
    the run names any)."""
    num_labels: Optional[int] = None
    """`task=seq_cls` and `image_cls`: the number of classes (label ids 0..num_labels-1, or that many distinct label
    names or class folders); 1 for regression."""
    problem: Problem = Problem.single_label
    """`task=seq_cls`: `single_label` (one class per record), `multi_label` (a list of classes per record) or
    `regression` (a number)."""
    label_column: str = "label"
    """`task=seq_cls`: the records' label column (ints, or names mapped to ids in sorted order)."""
    text_pair_column: Optional[str] = None
    """`task=seq_cls`: a second text column, encoded with the first as a pair (premise, hypothesis)."""
    num_channels: int = 3
    """`task=image_cls`: images are converted to this many channels (1: grayscale, 3: RGB)."""
    image_size: Optional[int] = None
    """`task=image_cls`: images are resized to image_size x image_size pixels (default: kept; they must share one
    size)."""
    augment: List[str] = field(default_factory=list)
    """`task=image_cls`: train-time augmentation, any of `hflip` (a random horizontal flip) and `crop` (a random crop
    of the image padded by an eighth); each draw depends on trainer.seed, the epoch and the image alone."""

    def __post_init__(self) -> None:
        check_target_node("task.loss", self.loss)
        if given(self.loss) and self.name is not TaskKind.custom:
            raise ConfigError(f"task.loss._target_={self.loss[TARGET]}: a loss of your own is for task=custom; "
                              f"task={self.name.value} trains with its own")
        if self.name is TaskKind.image_cls:
            bad = sorted(set(self.augment) - {"hflip", "crop"})
            if bad:
                raise ConfigError(f"task.augment: no augmentation {bad[0]}; choose from hflip, crop")
            if self.num_channels not in (1, 3):
                raise ConfigError(f"task.num_channels={self.num_channels}: must be 1 (grayscale) or 3 (RGB)")
            if self.num_labels is None or self.num_labels < 2:
                got = " is missing" if self.num_labels is None else f"={self.num_labels}"
                raise ConfigError(f"task.num_labels{got}: task=image_cls needs the number of classes (>= 2), e.g. "
                                  "task.num_labels=10")
        if self.name is not TaskKind.seq_cls:
            return
        if self.problem is Problem.regression and self.num_labels not in (None, 1):
            raise ConfigError(f"task.num_labels={self.num_labels}: task.problem=regression predicts one number; "
                              "use task.num_labels=1")
        if self.problem is not Problem.regression and (self.num_labels is None or self.num_labels < 2):
            got = " is missing" if self.num_labels is None else f"={self.num_labels}"
            raise ConfigError(f"task.num_labels{got}: task=seq_cls needs the number of classes (>= 2), e.g. "
                              "task.num_labels=2 (or task.problem=regression)")


@dataclass
class TargetModel:
    """`model._target_=pkg.mod.builder` plus its keyword arguments (`+model.channels=16`): any callable that returns
    an nn.Module."""

    target: str
    kwargs: Dict[str, Any] = field(default_factory=dict)

    @property
    def lora(self) -> LoraConfig:
        return LoraConfig()  # (adapters are for pretrained transformers models)

    def node(self) -> dict:
        """As the config spells it: `{_target_: ..., <kwargs>}`."""
        return {TARGET: self.target, **self.kwargs}


@dataclass
class TargetData:
    """`data.train._target_=...` and `data.val._target_=...` plus their keyword arguments: map-style datasets whose
    items are dicts of tensors or (inputs, target) tuples; `data.test._target_=...` a test split, evaluated once at
    the end on the model `model/` keeps; `data.collate_fn._target_=...` what makes a batch of items."""

    train: Dict[str, Any]
    val: Dict[str, Any]
    test: Dict[str, Any] = field(default_factory=unset)
    collate_fn: Dict[str, Any] = field(default_factory=unset)


def metric_name(spec: Any) -> str:
    """A `task.metrics` entry's name: `val_<name>` in result.json, `val/<name>` in metrics.jsonl."""
    if isinstance(spec, str):
        return spec
    return spec.get("name") or str(spec.get(TARGET, "")).rsplit(".", 1)[-1].lower()


def eval_values(task: "TaskConfig") -> list[str]:
    """What each eval records for this task: `val_loss`, `val_ppl` for language models, `val_<metric>`."""
    if task.name is TaskKind.causal_lm:
        return ["val_loss", "val_ppl"]  # (task.metrics are the other tasks')
    return ["val_loss", *(f"val_{metric_name(spec)}" for spec in task.metrics)]


def block_tokens(task: str, data: Any) -> int | None:
    """Tokens in every sequence a step trains on, where each is a full block: a causal LM on text corpora or packed
    chat examples (run.yaml's `task.name` and `data` node, as plain values). None where there are none to count so:
    padded chat examples vary, classifiers' and a custom task's items are not token blocks."""
    if task != TaskKind.causal_lm.value or not isinstance(data, dict) or "block_size" not in data:
        return None
    if data.get("source") == "sft" and not data.get("packing", True):
        return None
    return data["block_size"]


def known_direction(value_name: str, task: "TaskConfig | None" = None) -> str | None:
    """`maximize` or `minimize` for an eval value whose direction the config tells (`val_accuracy`, `val_loss`, a
    `task.metrics` entry's `direction`), else None (a torchmetrics class's own is known once it is imported:
    tasks/metrics.py)."""
    name = value_name[len("val_"):] if value_name.startswith("val_") else value_name
    for spec in (task.metrics if task is not None else []):
        if isinstance(spec, dict) and metric_name(spec) == name:
            return spec.get("direction") if spec.get("direction") in DIRECTIONS else None
    return "maximize" if name in MAXIMIZED else "minimize" if name in MINIMIZED else None


def target_model(node: Any) -> TargetModel | None:
    if isinstance(node, dict) and TARGET in node:
        kwargs = {k: v for k, v in node.items() if k != TARGET}
        return TargetModel(_target_of("model", node), kwargs)
    return None


def target_data(node: Any) -> TargetData | None:
    if isinstance(node, dict) and any(isinstance(node.get(split), dict) for split in ("train", "val")):
        for split in ("train", "val"):
            _target_of(f"data.{split}", node.get(split) or {})
        for name in ("test", "collate_fn"):
            check_target_node(f"data.{name}", node.get(name))
        unknown = sorted(set(node) - {"train", "val", "test", "collate_fn"})
        if unknown:
            raise ConfigError(f"data.{unknown[0]}: a setting of the built-in data; with data.train/data.val "
                              "datasets by _target_, give it to them (+data.train.<name>=...)")
        return TargetData(dict(node["train"]), dict(node["val"]), dict(node.get("test") or unset()),
                          dict(node.get("collate_fn") or unset()))
    return None


def _target_of(key: str, node: dict) -> str:
    target = node.get(TARGET)
    if not isinstance(target, str) or not target or target == "???":
        raise ConfigError(f"{key}._target_ is missing: give the dotted path of a callable, e.g. "
                          f"{key}._target_=mymodule.build")
    return target


def monitor_direction(trainer, known: str | None) -> str:
    """`maximize` or `minimize`: `trainer.monitor_direction`, or where it is `auto`, the monitored value's direction
    (`known`, as the task knows it: check_monitor has refused a monitor with none)."""
    if trainer.monitor_direction is not Direction.auto:
        return trainer.monitor_direction.value
    assert known is not None, f"no direction for {trainer.monitor}"
    return known


def check_one_number(setting: str, name: str, task: TaskConfig, arrays=frozenset()) -> None:
    """`name` (what `setting` names: `trainer.monitor`, a study's objective) is an eval value the task records as one
    number. `arrays`: the values its metrics' probe gave as arrays (a confusion matrix), which have no best."""
    computed = [value for value in eval_values(task) if value not in arrays]
    if name in arrays:
        raise ConfigError(f"{setting}: {name} is an array at each eval (saved under evals/), not one number, so no "
                          f"eval is better than another by it; choose one of {', '.join(computed)}")
    if name not in computed:
        raise ConfigError(f"{setting}: the task does not compute it; it computes {', '.join(computed)}")


def check_monitor(t, task: TaskConfig, directions: dict, arrays=frozenset()) -> None:
    """`trainer.monitor` (of the trainer settings `t`) names a value the task's evals record as one number, in a
    direction that fits it. `directions`: each eval value's, as the task knows them once its metrics are built (a
    torchmetrics class's `higher_is_better`); `arrays`: the values its probe gave as arrays."""
    check_one_number(f"trainer.monitor={t.monitor}", t.monitor, task, arrays)
    known = directions.get(t.monitor)
    if t.monitor_direction is Direction.auto and known is None:
        raise ConfigError(f"trainer.monitor_direction=auto: whether a higher {t.monitor} is better is not known; set "
                          "trainer.monitor_direction=maximize or minimize (or direction: in its task.metrics entry)")
    if known is not None and t.monitor_direction is not Direction.auto and t.monitor_direction.value != known:
        better = "higher" if known == "maximize" else "lower"
        raise ConfigError(f"trainer.monitor_direction={t.monitor_direction.value}: {t.monitor} is better when {better}; "
                          f"use trainer.monitor_direction={known} (or auto)")
