"""Causal-LM training: a corpus prepared into token blocks (data/), a transformers model built from config or
loaded pretrained (model.py), next-token loss, and `save_pretrained` with the tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from xtrain import data, model as models, plugins
from xtrain.config import RunConfig
from xtrain.tasks.base import TaskData

EVAL_CHUNK_ELEMENTS = 1 << 27  # fp32 logits (512 MB) that exist at once while an eval loss is computed


class CausalLM:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.tokenizer = None

    def build(self, accelerator) -> TaskData:
        cfg = self.cfg
        # The driver prepared the data before this worker started (backends/local.py): this reads the cache. A
        # rank that finds it missing prepares it under the cache's lock, while the others wait on the lock, not
        # in a collective.
        prepared = data.prepare(cfg.data, cfg.model)
        self.tokenizer = prepared.tokenizer
        train_set, val_set = prepared.splits()
        # every rank together: under ZeRO-3 building the model is a collective (parameters are partitioned as made)
        model = models.build(cfg.model, self.tokenizer, cfg.data.block_size, shard_later=plugins.builds_on_meta(cfg))
        return TaskData(model, train_set, val_set, unit="blocks", unit_note=f" of {cfg.data.block_size} tokens")

    def loss(self, model, batch) -> torch.Tensor:
        # no KV cache: nothing here generates, and a cache's per-layer state recompiles each compiled block
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss

    def eval_losses(self, model, batch) -> torch.Tensor:
        """Mean next-token loss of each sequence (every block has the same length)."""
        ids = batch["input_ids"]
        logits = model(input_ids=ids, use_cache=False).logits
        return sequence_losses(logits, ids)

    def tokens(self, batch) -> int:
        return batch["input_ids"].numel()

    def export(self, model, state_dict: dict, path: Path) -> None:
        """`save_pretrained` (safetensors) and the tokenizer."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a one-shard progress bar, in the middle of the log
        model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        self.tokenizer.save_pretrained(path)


def sequence_losses(logits: torch.Tensor, ids: torch.Tensor, chunk_elements: int = EVAL_CHUNK_ELEMENTS) -> torch.Tensor:
    """Each sequence's mean next-token cross-entropy, in fp32, from logits in any dtype, a chunk of positions at
    a time: no fp32 copy of the whole batch's logits is made (at batch 16 x 4,096 tokens x a 128k vocabulary
    one is ~34 GB), and no shifted copy either (the last position of each sequence gets no target)."""
    batch, length, vocab = logits.shape
    flat = logits.reshape(batch * length, vocab)  # a view of contiguous logits
    targets = F.pad(ids[:, 1:], (0, 1), value=-100).reshape(-1)
    per_position = torch.empty(batch * length, dtype=torch.float32, device=logits.device)
    step = max(1, chunk_elements // vocab)
    for start in range(0, batch * length, step):
        end = start + step
        per_position[start:end] = F.cross_entropy(flat[start:end].float(), targets[start:end], reduction="none")
    return per_position.view(batch, length).sum(dim=1) / (length - 1)
