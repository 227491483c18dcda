"""`task=seq_cls`: a pretrained encoder or decoder fine-tuned through `AutoModelForSequenceClassification` on
labelled records (data/labelled.py): single-label, multi-label or regression, with LoRA if asked. The loss is
per example (so the val loss is exact over the split); `model/` is `save_pretrained` output with the tokenizer, its
config naming the labels."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from xtrain.config.schema import RunConfig
from xtrain.config.task import PROBLEM_TYPES, Problem
from xtrain.core.errors import ConfigError
from xtrain.data import labelled
from xtrain.data.collate import PadToLongest
from xtrain.tasks import lora
from xtrain.tasks import pretrained
from xtrain.tasks import metrics as built_in
from xtrain.tasks.base import TaskData
from xtrain.tasks import targets
from xtrain.tasks.custom import Custom

log = logging.getLogger("xtrain")


class DropReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


class SeqCls(Custom):
    throughput_unit = "examples"
    perplexity = False

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.task = cfg.task
        targets.importable(cfg.task.code_dir)  # (a metric by _target_ may be the user's)
        self.metrics = built_in.for_task(cfg)
        self.problem = {Problem.single_label: built_in.MULTICLASS, Problem.multi_label: built_in.MULTILABEL,
                        Problem.regression: built_in.REGRESSION}[cfg.task.problem]
        self._loss = None
        self.ignore_index = -100
        self.tokenizer = None
        self.label_names = None

    @property
    def num_labels(self) -> int:
        return 1 if self.task.problem is Problem.regression else self.task.num_labels

    def check(self) -> set[str]:
        """On the driver, before anything launches: the records' files, the model's config, and every metric on
        outputs of the shape the model gives. Returns the eval values that come out as arrays."""
        from xtrain.data import sources

        sources.check(self.cfg.data)
        if self.cfg.data.test:
            sources.check(self.cfg.data.test_files())
        pretrained.pretrained_config(self.cfg.model)
        labelled.check_unprepared(self.cfg.data, self.cfg.model, self.task)
        return built_in.check(self.metrics, built_in.stand_in(self.problem, self.num_labels))

    def identity(self) -> dict:
        return {"model": {**pretrained.identity(self.cfg.model), "num_labels": self.num_labels,
                          "problem": self.task.problem.value}}

    def prepare(self) -> labelled.PreparedRecords:
        prepared = labelled.prepare(self.cfg.data, self.cfg.model, self.task)
        self.test_set(prepared)  # (the test records too, before any rank starts)
        return prepared

    def model_kwargs(self) -> dict:
        kwargs = {"num_labels": self.num_labels, "problem_type": PROBLEM_TYPES[self.task.problem]}
        if self.label_names:
            kwargs["id2label"] = dict(enumerate(self.label_names))
            kwargs["label2id"] = {name: i for i, name in enumerate(self.label_names)}
        return kwargs

    def on_meta(self):
        from transformers import AutoConfig, AutoModelForSequenceClassification

        hf_config = AutoConfig.from_pretrained(os.path.expanduser(self.cfg.model.name_or_path), **self.model_kwargs())
        with torch.device("meta"):
            return AutoModelForSequenceClassification.from_config(hf_config)

    def load_pretrained(self, quiet: bool = False):
        """The pretrained model with a classification head; transformers' load report (the head is new, as
        expected) becomes one log line naming what was newly initialized (`quiet`: none)."""
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        report = logging.getLogger("transformers.modeling_utils")
        quiet = DropReport()
        report.addFilter(quiet)
        try:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                os.path.expanduser(self.cfg.model.name_or_path), dtype=torch.float32, output_loading_info=True,
                **self.model_kwargs())
        except (OSError, ValueError) as err:
            raise pretrained.cannot_load(self.cfg.model, err) from None
        finally:
            report.removeFilter(quiet)
        if info.get("missing_keys") and not quiet:
            log.info("model: newly initialized (not in %s): %s", self.cfg.model.name_or_path,
                     ", ".join(sorted(info["missing_keys"])))
        return model

    def data(self) -> TaskData:
        prepared = self.prepare()  # (prepared by the driver: read from the cache)
        self.tokenizer, self.label_names = prepared.tokenizer, prepared.meta["label_names"]
        train_set, val_set = prepared.splits(self.num_labels)
        return TaskData(None, train_set, val_set, unit="examples", test_set=self.test_set(prepared),
                        collate=PadToLongest({"input_ids": self.tokenizer.pad_token_id, "token_type_ids": 0}))

    def test_set(self, prepared):
        """`data.test`'s records (every one a test example, labels mapped as the training data's), or None."""
        if not self.cfg.data.test:
            return None
        test_data = self.cfg.data.test_files()
        tested = labelled.prepare(test_data, self.cfg.model, self.task, prepared.meta["label_names"], test=True)
        return tested.splits(self.num_labels)[1]

    def build(self, accelerator) -> TaskData:
        built = self.data()
        model = self.load_pretrained()
        if model.config.pad_token_id is None:  # a decoder classifies at the last token before the padding
            model.config.pad_token_id = self.tokenizer.pad_token_id
        if self.cfg.model.lora.enabled:
            model = lora.adapt(model, self.cfg.model.lora, task_type="SEQ_CLS")
        built.model = model
        return built

    def loss_fn(self):
        problem = self.task.problem
        if problem is Problem.multi_label:
            return lambda logits, target: F.binary_cross_entropy_with_logits(logits.float(), target, reduction="none")
        if problem is Problem.regression:
            return lambda logits, target: F.mse_loss(logits.float().reshape(-1), target, reduction="none")
        return lambda logits, target: F.cross_entropy(logits.float(), target, reduction="none")

    def export(self, model, state_dict: dict, out: Path) -> None:
        """`out/model`: `save_pretrained` with the tokenizer (loads with AutoModelForSequenceClassification); with
        LoRA the base with the adapter merged in and the trained head, and `out/adapter` in PEFT's format."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if self.cfg.model.lora.enabled:
            lora.export(model, state_dict, self.cfg.model, out, self.tokenizer, load_base=lambda: self.load_pretrained(quiet=True),
                        task_type="SEQ_CLS")
            return
        model.save_pretrained(out / "model", state_dict=state_dict, safe_serialization=True)
        self.tokenizer.save_pretrained(out / "model")

    def samples(self, model, prompts: list[str], max_tokens: int) -> list[str]:
        raise ConfigError("trainer.sample_prompts: answering prompts is for task=causal_lm")
