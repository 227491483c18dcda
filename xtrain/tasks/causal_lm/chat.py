"""Instruction and chat examples → token ids and a loss mask, rendered with the model's own chat template.

Every record becomes a list of messages (`to_messages`): chat `messages` as they are (ShareGPT's
`conversations` of `{from, value}` mapped to roles), `prompt`/`completion` as a user turn and an assistant
turn, Alpaca's `instruction`/`input`/`output` likewise. The conversation is rendered whole with the chat
template, and each assistant turn's characters are found by rendering the conversation prefix by prefix: the
text the template adds for turn i is `render(turns[:i+1])` minus `render(turns[:i], add_generation_prompt)`.
A token is trained when it starts inside such a span. A template whose renderings are not prefixes of one
another is refused (the mask could not be trusted), and so is an example set with no trained token at all.
"""

from __future__ import annotations

import os

import numpy as np

from xtrain.config.schema import ExampleFormat, TrainOn
from xtrain.core.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool"}
SHAPES = {  # shape -> the columns that make it (any of the first group)
    ExampleFormat.messages: (("messages", "conversations"),),
    ExampleFormat.prompt_completion: (("prompt",), ("completion",)),
    ExampleFormat.alpaca: (("instruction",), ("output",)),
}
SHAPES_TEXT = "messages (a messages or conversations column), prompt_completion (prompt, completion), " \
              "alpaca (instruction, output, optional input)"


def detect(columns: list[str], requested: ExampleFormat, where: str) -> ExampleFormat:
    """The shape of examples with these columns: the one requested, or the first that fits."""
    fits = [shape for shape, groups in SHAPES.items() if all(any(c in columns for c in group) for group in groups)]
    if requested is not ExampleFormat.auto:
        if requested not in fits:
            raise ConfigError(f"data.format={requested.value}: {where} has columns {', '.join(columns)}, not the "
                              f"shape's; shapes: {SHAPES_TEXT}")
        return requested
    if not fits:
        raise ConfigError(f"data.format=auto: {where} has columns {', '.join(columns)}, in none of the shapes "
                          f"{SHAPES_TEXT}; rename its columns or set data.format")
    return fits[0]


def to_messages(record: dict, shape: ExampleFormat, where: str) -> list[dict]:
    """The record as `[{role, content}, ...]`."""
    if shape is ExampleFormat.prompt_completion:
        return [{"role": "user", "content": _text(record, "prompt", where)},
                {"role": "assistant", "content": _text(record, "completion", where)}]
    if shape is ExampleFormat.alpaca:
        extra = record.get("input") or ""
        question = _text(record, "instruction", where) + (f"\n\n{extra}" if extra else "")
        return [{"role": "user", "content": question}, {"role": "assistant", "content": _text(record, "output", where)}]
    turns = record.get("messages") if record.get("messages") is not None else record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"data.files: {where}: its messages are {turns!r:.60}, not a list of turns; "
                          "give [{\"role\": ..., \"content\": ...}, ...]")
    messages = []
    for turn in turns:
        if isinstance(turn, dict) and "role" in turn and isinstance(turn.get("content"), str):
            messages.append({"role": turn["role"], "content": turn["content"]})
        elif isinstance(turn, dict) and "from" in turn and isinstance(turn.get("value"), str):
            messages.append({"role": SHAREGPT_ROLES.get(turn["from"], turn["from"]), "content": turn["value"]})
        else:
            raise ConfigError(f"data.files: {where}: the turn {turn!r:.80} has no role and text content; "
                              "give {\"role\": ..., \"content\": \"...\"}")
    return messages


def _text(record: dict, column: str, where: str) -> str:
    value = record.get(column)
    if not isinstance(value, str):
        raise ConfigError(f"data.files: {where}: its {column} is {value!r:.40} ({type(value).__name__}), not text")
    return value


def template_of(tokenizer, chat_template: str | None, model_name: str) -> str:
    """The chat template to render with: `data.chat_template` (text or a file), else the tokenizer's own."""
    if chat_template:
        path = os.path.expanduser(chat_template)
        return open(path).read() if os.path.isfile(path) else chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"model.name_or_path={model_name}: its tokenizer has no chat template; set "
                          "data.chat_template to a Jinja template (or a file holding one), or use a chat model")
    return tokenizer.chat_template


class Renderer:
    """Messages → (token ids, trained-token mask) with one tokenizer and template."""

    def __init__(self, tokenizer, template: str, train_on: TrainOn):
        self.tokenizer, self.template, self.train_on = tokenizer, template, train_on

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def check_roles(self, messages: list[dict], where: str) -> None:
        for message in messages:
            role = message["role"]
            if role not in ROLES and f"'{role}'" not in self.template and f'"{role}"' not in self.template:
                raise ConfigError(f"data.files: {where}: role {role!r} is not one the chat template knows; "
                                  f"use {', '.join(ROLES)}")

    def answer_spans(self, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
        """The characters of `text` (the whole rendering) that the assistant turns added."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], generation_prompt=True) if i else ""
            after = self.render(messages[: i + 1])
            if not (after.startswith(before) and text.startswith(after)):
                raise ConfigError(
                    f"data.chat_template: {where}: the template's rendering of the first {i + 1} turns is not a "
                    "prefix of the whole conversation's, so the answers cannot be told from the rest; give "
                    "data.chat_template a template that renders turns in order, or data.train_on=all"
                )
            spans.append((len(before), len(after)))
        return spans

    def encode(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        self.check_roles(messages, where)
        try:
            text = self.render(messages)
        except Exception as err:  # jinja2's TemplateError, or a template's own raise_exception
            raise ConfigError(f"data.chat_template: {where}: the chat template refuses it ({str(err)[:160]})") from None
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoding["input_ids"], dtype=np.int64)
        if self.train_on is TrainOn.all:
            return ids, np.ones(len(ids), dtype=np.uint8)
        starts = np.asarray([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for begin, end in self.answer_spans(messages, text, where):
            mask[(starts >= begin) & (starts < end)] = 1
        return ids, mask
