"""Causal-LM training: a corpus prepared into token blocks, or instruction and chat examples with their answer
masks (data/); a transformers model built from config or loaded pretrained (model.py), with LoRA adapters if
asked (lora.py); next-token loss over the trained tokens; `save_pretrained` with the tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from xtrain.config.schema import DataSource, ModelSource, RunConfig
from xtrain.data import sources
from xtrain.parallel import strategies
from xtrain.tasks import lora, pretrained
from xtrain.tasks.base import TaskData
from xtrain.tasks.causal_lm import model as models

IGNORE = -100  # the label of a token the loss skips

EVAL_CHUNK_ELEMENTS = 1 << 27  # fp32 logits (512 MB) that exist at once while an eval loss is computed


class CausalLM:
    throughput_unit = "tokens"
    batch_unit = "sequences"  # what the effective batch counts
    perplexity = True
    metrics: list = []
    problem = None

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.tokenizer = None
        # with trainer.compile the loss is compiled too: the fp32 upcast, log-softmax and its backward fused, no fp32
        # copy of the logits kept (the compiled blocks end at the model's output)
        self.summed_loss = torch.compile(summed_loss) if cfg.trainer.compile else summed_loss

    def check(self) -> set[str]:
        """On the driver, before anything launches: the data's files (cheap checks) and a pretrained model's config.
        No eval value is an array."""
        sources.check(self.cfg.data)
        if self.cfg.model.source is ModelSource.pretrained:
            pretrained.pretrained_config(self.cfg.model)
        return set()

    def identity(self) -> dict:
        return {"model": pretrained.identity(self.cfg.model)}

    def prepare(self):
        """The corpus prepared into the cache (or found there): what `build` then reads."""
        if self.cfg.data.source is DataSource.sft:
            from xtrain.tasks.causal_lm import sft

            return sft.prepare(self.cfg.data, self.cfg.model)
        from xtrain.tasks.causal_lm import corpus

        return corpus.prepare(self.cfg.data, self.cfg.model)

    def on_meta(self):
        return models.on_meta(self.cfg.model, self.cfg.data.block_size)

    def data(self) -> TaskData:
        # The driver prepared the data before this worker started (backends/local.py): this reads the cache. A
        # rank that finds it missing prepares it under the cache's lock, while the others wait on the lock, not
        # in a collective.
        cfg = self.cfg
        prepared = self.prepare()
        self.tokenizer = prepared.tokenizer
        train_set, val_set = prepared.splits()
        if cfg.data.source is not DataSource.sft:
            return TaskData(None, train_set, val_set, unit="blocks", unit_note=f" of {cfg.data.block_size} tokens")
        if cfg.data.packing:
            return TaskData(None, train_set, val_set, unit="packed blocks", unit_note=f" of {cfg.data.block_size} tokens")
        from xtrain.data.collate import PadToLongest
        from xtrain.tasks.causal_lm.sft import IGNORE as NOT_TRAINED

        pads = {"input_ids": self.tokenizer.pad_token_id, "labels": NOT_TRAINED}
        return TaskData(None, train_set, val_set, unit="examples", collate=PadToLongest(pads))

    def build(self, accelerator) -> TaskData:
        cfg = self.cfg
        built = self.data()
        # every rank together: under ZeRO-3 building the model is a collective (parameters are partitioned as made)
        model = models.build(cfg.model, self.tokenizer, cfg.data.block_size, shard_later=strategies.of(cfg).builds_on_meta(cfg))
        if cfg.model.lora.enabled:
            model = lora.adapt(model, cfg.model.lora)
        built.model = model
        return built

    def directions(self) -> dict[str, str]:
        return {"val_loss": "minimize", "val_ppl": "minimize"}

    def weight(self, batch):
        """The tokens the batch's loss averages over: every next-token target of a text block; the trained ones
        (answers, not padding) of examples."""
        if "labels" in batch:
            return (batch["labels"][:, 1:] != IGNORE).sum()
        ids = batch["input_ids"]
        return ids.shape[0] * (ids.shape[1] - 1)

    def loss(self, model, batch, per) -> torch.Tensor:
        """The batch's summed next-token loss (in fp32) over `per`, the trained tokens one micro-batch of the step
        holds (transformers' own loss does the same given `num_items_in_batch`)."""
        return self.summed_loss(model(**inputs(batch)).logits, targets(batch)) / per

    def eval_losses(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's summed next-token loss over its trained tokens, and their number."""
        return sequence_losses(model(**inputs(batch)).logits, targets(batch))

    def count(self, batch) -> int:
        """Trained tokens: every token of a text block; the unmasked, unpadded ones of examples."""
        if "labels" in batch:
            return int((batch["labels"] != IGNORE).sum())
        return batch["input_ids"].numel()

    def export(self, model, state_dict: dict, out: Path) -> None:
        """`out/model`: `save_pretrained` (safetensors) and the tokenizer; with LoRA the base with the adapter
        merged in, and `out/adapter` in PEFT's format."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a one-shard progress bar, in the middle of the log
        if self.cfg.model.lora.enabled:
            lora.export(model, state_dict, self.cfg.model, out, self.tokenizer)
            return
        model.save_pretrained(out / "model", state_dict=state_dict, safe_serialization=True)
        self.tokenizer.save_pretrained(out / "model")

    @torch.no_grad()
    def samples(self, model, prompts: list[str], max_tokens: int) -> list[str]:
        """Greedy answers to `prompts` (as user turns, with the chat template where there is one). Every rank
        calls it: a sharded model's forward is a collective."""
        answers = []
        for prompt in prompts:
            if getattr(self.tokenizer, "chat_template", None):
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                         return_tensors="pt", return_dict=True)["input_ids"]
            else:
                ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
            ids = ids.to(next(model.parameters()).device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
            answers.append(self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
        return answers


def inputs(batch: dict) -> dict:
    """The model's inputs: ids, and where the batch has them, restarting positions (packed examples: each
    attends only to itself) or the padding mask. No KV cache: nothing here generates, and a cache's per-layer
    state recompiles each compiled block."""
    extra = {key: batch[key] for key in ("position_ids", "attention_mask") if key in batch}
    return {"input_ids": batch["input_ids"], "use_cache": False, **extra}


def targets(batch: dict) -> torch.Tensor:
    return batch.get("labels", batch["input_ids"])


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross-entropy over the targets (labels other than IGNORE), in fp32."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(), ignore_index=IGNORE, reduction="sum")


def sequence_losses(logits: torch.Tensor, labels: torch.Tensor,
                    chunk_elements: int = EVAL_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed next-token cross-entropy over its targets (labels other than IGNORE), in fp32,
    and the number of targets; from logits in any dtype, a chunk of positions at a time: no fp32 copy of the
    whole batch's logits is made (at batch 16 x 4,096 tokens x a 128k vocabulary one is ~34 GB), and no
    shifted copy either (the last position of each sequence gets no target)."""
    batch, length, vocab = logits.shape
    flat = logits.reshape(batch * length, vocab)  # a view of contiguous logits
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    per_position = torch.empty(batch * length, dtype=torch.float32, device=logits.device)
    step = max(1, chunk_elements // vocab)
    flat_targets = shifted.reshape(-1)
    for start in range(0, batch * length, step):
        end = start + step
        per_position[start:end] = F.cross_entropy(flat[start:end].float(), flat_targets[start:end], reduction="none",
                                                  ignore_index=IGNORE)
    return per_position.view(batch, length).sum(dim=1), (shifted != IGNORE).sum(dim=1)
