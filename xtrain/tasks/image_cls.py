"""`task=image_cls`: an image classifier (a ResNet or ViT from a transformers config, or any `_target_`) on labelled
images prepared once (data/images.py). The builder gets `num_labels`, `num_channels` and `image_size` where its
signature takes them and the model node does not set them. A transformers model is exported with `save_pretrained`
(it loads with `AutoModelForImageClassification`), any other module as safetensors plus its node (custom.py)."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from xtrain.config.schema import RunConfig
from xtrain.core.errors import ConfigError
from xtrain.data import images
from xtrain.tasks import metrics, targets
from xtrain.tasks.base import TaskData
from xtrain.tasks.custom import Custom


def resnet(num_labels: int, num_channels: int = 3, **settings) -> torch.nn.Module:
    """`ResNetForImageClassification` from a `ResNetConfig` (random init); `settings` are the config's."""
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(num_labels=num_labels, num_channels=num_channels,
                                                     **{"layer_type": "basic", **settings}))


def vit(num_labels: int, num_channels: int = 3, image_size: int = 224, **settings) -> torch.nn.Module:
    """`ViTForImageClassification` from a `ViTConfig` (random init); `settings` are the config's."""
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(num_labels=num_labels, num_channels=num_channels, image_size=image_size,
                                               **settings))


class ImageCls(Custom):
    throughput_unit = "examples"
    perplexity = False
    problem = metrics.MULTICLASS

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.label_names = None
        self.node = cfg.model.node()

    def model_node(self) -> dict:
        return self.node

    def check(self) -> set[str]:
        """On the driver, before anything launches: the sources exist, the builder makes a module, and every metric
        takes outputs of the shape it gives. Returns the eval values that come out as arrays."""
        images.sources(self.cfg.data)
        if self.cfg.data.test:
            images.sources(self.cfg.data.test_files())
        self.on_meta()
        return metrics.check(self.metrics, metrics.stand_in(self.problem, self.cfg.task.num_labels))

    def identity(self) -> dict:
        return {"model": {**self.cfg.model.node(), "num_labels": self.cfg.task.num_labels}}

    def prepare(self) -> images.PreparedImages:
        prepared = images.prepare(self.cfg.data, self.cfg.task)
        self.test_set(prepared)  # (the test images too, before any rank starts)
        return prepared

    def build_model(self, image_size: int | None = None) -> torch.nn.Module:
        """The model; `image_size` (the prepared images' side) is offered where `task.image_size` is not set."""
        targets.importable(self.cfg.task.code_dir)
        node = self.cfg.model.node()
        task = self.cfg.task
        offered = {"num_labels": task.num_labels, "num_channels": task.num_channels,
                   "image_size": task.image_size or image_size}
        target = targets.resolve("model", node["_target_"])
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):  # a builtin without a signature: offer nothing
            params = {}
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        extra = {k: v for k, v in offered.items() if v is not None and k not in node and (k in params or takes_any)}
        self.node = {**node, **extra}  # what builds it again (xtrain.load_model)
        model = targets.call("model", node, **extra)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model._target_={node['_target_']}: returned a {type(model).__name__}, not a "
                              "torch.nn.Module")
        return model

    def on_meta(self) -> torch.nn.Module:
        with torch.device("meta"):
            return self.build_model()

    def data(self) -> TaskData:
        prepared = self.prepare()  # (prepared by the driver: read from the cache)
        self.label_names, self.size = prepared.meta["label_names"], prepared.meta["size"][0]
        train_set, val_set = prepared.splits(self.cfg.task.augment, self.cfg.trainer.seed)
        return TaskData(None, train_set, val_set, unit="images", test_set=self.test_set(prepared))

    def test_set(self, prepared):
        """`data.test`'s images (every one a test example, classes mapped as the training data's), or None."""
        if not self.cfg.data.test:
            return None
        test_data = self.cfg.data.test_files()
        tested = images.prepare(test_data, self.cfg.task, prepared.meta["label_names"], test=True)
        return tested.splits([], self.cfg.trainer.seed)[1]

    def build(self, accelerator) -> TaskData:
        built = self.data()
        model = self.build_model(image_size=self.size)
        if self.label_names and hasattr(getattr(model, "config", None), "id2label"):
            model.config.id2label = dict(enumerate(self.label_names))
            model.config.label2id = {name: i for i, name in enumerate(self.label_names)}
        built.model = model
        return built

    def export(self, model, state_dict: dict, out: Path) -> None:
        if hasattr(model, "save_pretrained"):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            model.save_pretrained(out / "model", state_dict=state_dict, safe_serialization=True)
            return
        super().export(model, state_dict, out)
