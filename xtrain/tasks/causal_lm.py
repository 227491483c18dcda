"""Causal-LM training: a corpus tokenized and packed into blocks (data.py), a transformers model built from
config or loaded pretrained (model.py), next-token loss, and `save_pretrained` with the tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from xtrain import data, model as models
from xtrain.config import RunConfig
from xtrain.tasks.base import TaskData


class CausalLM:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.tokenizer = None

    def build(self, accelerator) -> TaskData:
        cfg = self.cfg
        with accelerator.main_process_first():  # tokenizer training and tokenization happen once, then hit the cache
            corpus = data.load_corpus(cfg.data)
            self.tokenizer = data.tokenizer_for(corpus, cfg.model, cfg.data)
            train_set, val_set = data.pack(corpus, self.tokenizer, cfg.data)
        # every rank together: under ZeRO-3 building the model is a collective (parameters are partitioned as made)
        model = models.build(cfg.model, self.tokenizer, cfg.data.block_size)
        return TaskData(model, train_set, val_set, unit="blocks", unit_note=f" of {cfg.data.block_size} tokens")

    def loss(self, model, batch) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def eval_losses(self, model, batch) -> torch.Tensor:
        """Mean next-token loss of each sequence (every block has the same length)."""
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits.float()
        per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        return per_token.view(ids.shape[0], -1).mean(dim=1)

    def tokens(self, batch) -> int:
        return batch["input_ids"].numel()

    def export(self, model, state_dict: dict, path: Path) -> None:
        """`save_pretrained` (safetensors) and the tokenizer."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a one-shard progress bar, in the middle of the log
        model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
