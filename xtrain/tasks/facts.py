"""What the strategy code needs of a task's model, read on the meta device: its parameter count, FSDP's block,
ZeRO's bucket size and the LoRA-trainable count."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from importlib import metadata
from pathlib import Path

from xtrain.config.schema import ModelSource, RunConfig, TaskKind
from xtrain.core.files import write_atomic
from xtrain.core.rundir import PREPARED
from xtrain.parallel import fp8, plugins, strategies, tensor_parallel

_FACTS: dict[str, tuple[int, plugins.ModelFacts]] = {}


def model_facts(cfg: RunConfig, task=None, run_dir: Path | None = None) -> tuple[int, plugins.ModelFacts]:
    """Parameter count and plugin facts from the model on the meta device (no memory, seconds for 70B).
    Kept per model for the process (a sweep's points mostly share theirs), in the run dir for its ranks
    (`run_dir`'s prepared.json, where the driver wrote them for these settings) and, for a language model built
    from config, in the data cache: a launch reads them there without importing the model's code (2 s). `task`:
    the run's, where it has one already."""
    key = facts_key(cfg)
    if key not in _FACTS and run_dir is not None:
        recorded = recorded_facts(run_dir, key)
        if recorded is not None:
            _FACTS[key] = recorded
    if key not in _FACTS:
        stored = _stored(cfg, key)
        _FACTS[key] = _read(stored) if stored is not None and stored.exists() else _model_facts(cfg, task)
        if stored is not None and not stored.exists() and not cfg.dry_run:  # (a dry run writes nothing)
            n_params, facts = _FACTS[key]
            with contextlib.suppress(OSError):  # (a cache it may only read, e.g. a team's prepared data)
                stored.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(stored, json.dumps(as_record(n_params, facts, key)))
    return _FACTS[key]


def _stored(cfg: RunConfig, key: str) -> Path | None:
    """Where a model's facts are kept: only for a causal LM built from config (its facts follow from the settings
    alone, not from files or a user's code), under a key of the settings, the libraries that build and count the
    model, and xtrain's own source as installed."""
    if cfg.task.name is not TaskKind.causal_lm or cfg.model.source is not ModelSource.config:
        return None
    from xtrain.data.sources import cache_dir

    package = Path(__file__).resolve().parents[1]
    source = sorted((str(p.relative_to(package)), p.stat().st_size, p.stat().st_mtime_ns) for p in package.rglob("*.py"))
    libraries = [_version(name) for name in ("torch", "transformers", "peft")]
    digest = hashlib.sha256(repr((key, libraries, source)).encode()).hexdigest()[:24]
    return Path(cache_dir(cfg.data)) / "model-facts" / f"{digest}.json"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def facts_key(cfg: RunConfig) -> str:
    """What a model's facts follow from: another model, data, strategy, wrapped block or precision reads them anew."""
    return repr((cfg.task.name, cfg.model, cfg.data, cfg.strategy.name, vars(cfg.strategy).get("wrap_layer"),
                 cfg.precision))


def as_record(n_params: int, facts: plugins.ModelFacts, key: str) -> dict:
    return {"facts_key": key, "parameters": n_params, "facts": dataclasses.asdict(facts)}


def _from_record(stored: dict) -> tuple[int, plugins.ModelFacts]:
    facts = stored["facts"]
    return stored["parameters"], plugins.ModelFacts(**{**facts, "fp8_layers": tuple(facts["fp8_layers"])})


def _read(path: Path) -> tuple[int, plugins.ModelFacts]:
    return _from_record(json.loads(path.read_text()))


def recorded_facts(run_dir: Path, key: str) -> tuple[int, plugins.ModelFacts] | None:
    """The model's facts the driver wrote into the run dir for the settings of `key`; None where it holds none for
    them (a run dir written before, or by hand)."""
    try:
        record = json.loads((Path(run_dir) / PREPARED).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return _from_record(record) if record.get("facts_key") == key else None


def _model_facts(cfg: RunConfig, task=None) -> tuple[int, plugins.ModelFacts]:
    from xtrain.tasks.registry import task_for

    meta = (task or task_for(cfg)).on_meta()
    n_params = sum(p.numel() for p in meta.parameters())
    wrap = strategies.of(cfg).wrap_layer(cfg, meta)
    trainable, quantized = None, 0
    if cfg.model.lora.enabled:
        from xtrain.tasks import lora

        trainable = lora.trainable_parameters(meta, cfg.model.lora)
        quantized = lora.quantized_parameters(meta, cfg.model.lora)
    hidden = getattr(getattr(meta, "config", None), "hidden_size", None)
    if hidden is None:  # a module without a transformers config: ZeRO's buckets sized by its largest weight
        hidden = max((int(p.numel() ** 0.5) for p in meta.parameters()), default=1)
    config = getattr(meta, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    planned = tensor_parallel.tensor_parallel_plan(meta)
    return n_params, plugins.ModelFacts(
        hidden_size=hidden, wrap_layer=wrap, trainable=trainable, quantized=quantized, model_class=type(meta).__name__,
        tp_plan=bool(planned), heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        layers=layers, intermediate=intermediate or (4 * hidden if layers else None),
        vocab=getattr(config, "vocab_size", None),
        tp_split=sum(p.numel() for name, p in meta.named_parameters() if name in planned),
        fp8_layers=fp8.layers(meta, cfg.precision)[0] if fp8.with_torchao(cfg) else (),
    )


def stored_numel(p) -> int:
    """The parameter's element count as the model has it: a ZeRO-3 partition's whole (`ds_numel`; its own numel()
    is 0), a 4-bit weight's unpacked shape (bitsandbytes packs two into a byte)."""
    if hasattr(p, "ds_numel"):
        return p.ds_numel
    quant_state = getattr(p, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        return quant_state.shape.numel()
    return p.numel()
