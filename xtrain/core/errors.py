"""Every error a user sees, and how each becomes one line. Imports nothing of xtrain.

| exception | what happened | exit code |
| --- | --- | --- |
| `ConfigError` | a bad setting, file, model or request; nothing started | 2 |
| `Diverged` | the loss became NaN or infinite | 1 |
| `CallbackFailed` | a callback's hook raised | 1 |
| `LaunchFailed` | workers failed (the message is the failing rank's own error) | its `exit_code` |
| `Stopped` | stopped on request at a step boundary, with a checkpoint: resumable, not an error | 128 + signal |
| `Terminated` | a worker ended by SIGTERM (another rank failed, or the run was stopped) | - |
| `SweepFailed` | points of a sweep failed (one line each), or the sweep was interrupted | its `exit_code` |
"""

from __future__ import annotations

import difflib
import math
import re
import sys


class ConfigError(ValueError):
    """A user error in the run config: printed as one line, exit code 2."""


class Diverged(RuntimeError):
    """The loss became NaN or infinite: printed as one line (no traceback helps), exit code 1."""


class CallbackFailed(RuntimeError):
    """A `trainer.callbacks` hook raised: printed as one line (the callback, the hook, its error), exit code 1."""


class WriteFailed(RuntimeError):
    """A file of the run could not be written (the disk full, read-only, no permission): one line naming the path
    and what it needed, exit code 1; what was written before stays."""


ONE_LINE = (Diverged, CallbackFailed, WriteFailed)  # errors whose line says it all: no traceback helps


class LaunchFailed(Exception):
    """Workers failed; the message is the failing rank's own error."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):  # (pickled whole: a Ray task's failure reaches its driver as it was raised)
        return type(self), (str(self), self.exit_code)


class Stopped(Exception):
    """A run stopped at a step boundary on request, with a complete checkpoint: resumable."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # as a shell reports a process ended by that signal

    def __reduce__(self):
        return type(self), (str(self), self.exit_code - 128)


class Terminated(KeyboardInterrupt):
    """SIGTERM to a worker: another rank failed, or the user stopped the run. An interruption, like Ctrl-C:
    `except Exception` in library code does not swallow it, and result.json says `interrupted`."""


class SweepFailed(Exception):
    """Points of a sweep failed (one line each; the others are recorded), or the sweep was interrupted."""

    def __init__(self, lines: list[str], exit_code: int):
        super().__init__("\n".join(lines))
        self.exit_code = exit_code

    def __reduce__(self):
        return type(self), (str(self).split("\n"), self.exit_code)


def positive(name: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={value}: must be {'a finite number ' if not math.isfinite(value) else ''}> 0")


def non_negative(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name}={value}: must be {'a finite number ' if not math.isfinite(value) else ''}>= 0")


def changed_settings(settings, group: str, names) -> list[str]:
    """`group.name=value` for each of `names` that the dataclass `settings` holds at other than its default, as one
    would type it (a setting that does nothing where it was given is refused, not ignored)."""
    import dataclasses
    from enum import Enum

    found = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if f.name not in names or value == default:
            continue
        shown = (value.value if isinstance(value, Enum) else str(value).lower() if isinstance(value, bool)
                 else f"[{','.join(map(str, value))}]" if isinstance(value, list)
                 else "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}" if isinstance(value, dict) else f"{value:g}"
                 if isinstance(value, float) else str(value))
        found.append(f"{group}.{f.name}={shown}")
    return found


def one_line(err: BaseException) -> str:
    """An error as result.json and the terminal show it: xtrain's own errors as they are, others typed."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return text if isinstance(err, (ConfigError, LaunchFailed)) else f"{type(err).__name__}: {text}"


# What people type for a setting, by the last part of its name: the real one's last part
ALIASES = {
    "learning_rate": "lr", "name": "name_or_path", "model_name": "name_or_path", "path": "name_or_path",
    "steps": "max_steps", "num_steps": "max_steps", "train_steps": "max_steps", "iterations": "max_steps",
    "epochs": "max_epochs", "num_epochs": "max_epochs", "n_epochs": "max_epochs", "num_train_epochs": "max_epochs",
    "batch": "batch_size", "bs": "batch_size", "micro_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum", "accumulation_steps": "grad_accum", "warmup": "warmup_steps",
    "layers": "num_layers", "n_layer": "num_layers", "heads": "num_heads", "n_head": "num_heads",
    "gpus": "gpus_per_node", "num_nodes": "nodes", "processes": "num_processes", "nproc_per_node": "num_processes",
}


def closest(name: str, settings: list[str]) -> str | None:
    """The real setting a mistyped dotted name most likely meant: its group first (`trainr` -> `trainer`), then its
    last part within that group (a usual alias, the start of a longer name, or the nearest spelling)."""
    parts = name.split(".")
    heads = sorted({s.split(".")[0] for s in settings})
    head = parts[0] if parts[0] in heads else next(iter(difflib.get_close_matches(parts[0], heads, n=1, cutoff=0.6)), None)
    if head is None:
        return None
    if len(parts) == 1:
        return head if head in settings else None
    leaves = {s[len(head) + 1:]: s for s in settings if s.startswith(head + ".")}
    rest = ".".join(parts[1:])
    aliased = ".".join([*parts[1:-1], ALIASES.get(parts[-1], parts[-1])])
    for candidate in (rest, aliased):
        if candidate in leaves:
            return leaves[candidate]
    longer = [leaf for leaf in leaves if leaf.startswith(rest)]
    if len(longer) == 1:
        return leaves[longer[0]]
    close = difflib.get_close_matches(rest, list(leaves), n=1, cutoff=0.6)
    return leaves[close[0]] if close else None


BY_TARGET = ("model._target_", "data.train._target_", "data.val._target_", "data.test._target_")


OPTION_NOUNS = {"data": "data source"}  # what an option of a group is called in a sentence


def unknown_setting(name: str, value: str | None, settings: dict[str, str], others=None) -> str:
    """The one line for a setting that does not exist, with the one that most likely was meant. `settings`: every
    dotted setting → the options of its group it belongs to (`strategy=fsdp`; empty: every option's); `others`:
    (name, value) → the line for another tool's name of a setting, or None (config/habits.py's `refusal`)."""
    given = f"{name}{'' if value is None else '=' + value}"
    parts = name.split(".")
    owner = next((settings[key] for key in (".".join(parts[:n]) for n in range(len(parts), 1, -1))
                  if settings.get(key)), None)
    if owner:  # a setting of another option of its group
        use = f"add {owner}" if "|" not in owner else "use one of those"
        return f"{given}: no such setting with this {OPTION_NOUNS.get(parts[0], parts[0])}: it is a setting of {owner}; {use}, or drop it"
    habit = others(name, value) if others else None
    if habit:  # another tool's name for one of xtrain's settings
        return habit
    if name in BY_TARGET:  # a model or datasets of the user's, given without the task that takes them
        return f"{given}: a model and datasets by _target_ are trained by task=custom; add task=custom"
    close = closest(name, settings)
    hint = f"did you mean {close}?" if close else "python -m xtrain --cfg job lists every setting"
    return f"{given}: no such setting; {hint}"


def override_of(key: str) -> tuple[str, str | None]:
    """The command line's override of `key`, or of a setting below it: its name and value (the last one given, which
    Hydra applies)."""
    for arg in reversed(sys.argv[1:]):
        name, sep, value = arg.lstrip("+~").partition("=")
        if sep and (name == key or name.startswith(key + ".")):
            return name, value
    return key, None


def new_key_of_mapping(key: str, name: str, value: str | None, present: set[str]) -> str:
    """The one line for `key`, a new key of a mapping that takes the user's own (cluster.resources,
    trainer.optimizer), given without a plus (as `name=value`: the key itself, or the mapping in braces); `present`:
    the mapping's keys already there (set without one)."""
    import yaml

    mapping = key.rpartition(".")[0]
    try:
        given = yaml.safe_load(value) if name == mapping else None
    except yaml.YAMLError:
        given = None
    pairs = given.items() if isinstance(given, dict) and given else [(key.rpartition(".")[2], value or "VALUE")]
    fix = " ".join(f"{'' if k in present else '+'}{mapping}.{k}={v}" for k, v in pairs)
    return f"{name}{'' if value is None else '=' + value}: {mapping} takes keys of your own, each added with a plus: {fix}"


def explain(err: Exception, settings: dict[str, str], others=None) -> str:
    """One line for a Hydra / OmegaConf composition error: the setting, the bad value, what would work.
    `settings`: every dotted key a user can set (for the one a typo meant), and `others`, as `unknown_setting` takes
    them."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue

    cause = err.__cause__ or err
    key = getattr(cause, "full_key", None)
    if not key:
        text = " ".join(str(err).split())
        function = re.search(r"Unknown function '(\w+)' Available: ([\w,]+)", text)
        override = re.search(r"Error parsing override '([^']+)'", text)
        hydras = re.search(r"Sweeping over Hydra's configuration is not supported : '([^']+)'", text)
        if hydras:  # a study's space given as hydra.sweeper.params.X=<a sweep>
            name, _, value = hydras.group(1).partition("=")
            return (f"{hydras.group(1)}: Hydra reads a sweep here as a sweep of its own settings; quote the value "
                    f"(\"{name}='{value}'\") or give it as {name.lstrip('+').removeprefix('hydra.sweeper.params.')}="
                    f"{value}")
        if override and "missing EQUAL" in text:
            return (f"{override.group(1)}: no value; give {override.group(1)}=VALUE (python -m xtrain --cfg job lists "
                    "every setting and its value)")
        if function and override:  # a sweep's grammar: the function meant, in one line
            close = closest(function.group(1), function.group(2).split(","))
            hint = f"did you mean {close}?" if close else f"use one of {function.group(2).replace(',', ', ')}"
            return f"{override.group(1)}: no function {function.group(1)} in Hydra's sweep grammar; {hint}"
        return text
    name, value = override_of(key)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and "Dict[" in str(cause.ref_type):
        given = override_of(key) if value is not None else override_of(key.rpartition(".")[0])
        return new_key_of_mapping(key, *given, set(cause.parent_node or ()))
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and key.startswith("hydra.") and cause.parent_node:
        has = [k for k in cause.parent_node if not str(k).startswith("_")]  # (a plugin's settings: the sweeper's)
        return f"{name}{'' if value is None else '=' + value}: no such setting; {key.rpartition('.')[0]} has {', '.join(map(str, has))}"
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return unknown_setting(name, value, settings, others)
    if isinstance(cause, MissingMandatoryValue):
        return f"{key}: must be set"
    reason = str(cause).splitlines()[0]
    converted = re.match(r"Value '.*' of type '.*' could not be converted to (\w+)", reason)
    if converted:
        reason = f"not a valid {converted.group(1).lower()}"
    elif re.match(r"Value '.*' is not a valid bool", reason):
        reason = "not a valid bool; use true or false"
    elif "is not a ListConfig, list or tuple" in reason:
        reason = f"not a list; give one in brackets, e.g. {name}=[{value}]"
    elif re.match(r"Cannot assign \w+ to Dict\[|Cannot merge DictConfig with ListConfig", reason):
        reason = f"not a mapping; add its keys with a plus, e.g. +{name}.KEY=VALUE"
    return f"{name}{'' if value is None else '=' + value}: {reason}"
