"""What a `{_target_: ..., **kwargs}` node names: a model, datasets, a loss, metrics, an optimizer, a schedule, callbacks.

Each is imported from the user's modules (`task.code_dir`, the working directory by default), its keywords checked
against its signature before it is called (a typo is one line naming the setting and the nearest real keyword), then
called; any failure is one line that names the key.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from typing import Any

from xtrain.core.errors import ConfigError


def importable(code_dir: str | None) -> None:
    """The user's modules (the directory the command ran from) importable in this process."""
    where = code_dir or os.getcwd()
    if where not in sys.path:
        sys.path.insert(0, where)


def resolve(key: str, path: str) -> Any:
    """The object a `_target_` names; a ConfigError naming the key, the path and the real import error."""
    module_name, _, attr = path.rpartition(".")
    try:
        if not module_name:
            raise ImportError(f"{path!r} is not a dotted path (module.name)")
        found = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
        return found
    except AttributeError:
        raise ConfigError(f"{key}._target_={path}: module {module_name} has no {attr}") from None
    except Exception as err:  # whatever importing the user's module raised
        raise ConfigError(f"{key}._target_={path}: cannot import: {type(err).__name__}: {err}") from None


def keywords(target) -> list[str] | None:
    """The keyword arguments `target` takes, or None where it takes any (`**kwargs`) or has no signature."""
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def takes(target, name: str) -> bool:
    """The callable takes a keyword `name` (explicitly: not only through `**kwargs`)."""
    try:
        return name in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


def check_keywords(key: str, path: str, target, given: dict) -> None:
    """Every keyword of `given` is one `target` takes: else one line naming the setting, the nearest keyword it takes
    and all of them (as a typo in a built-in setting is refused)."""
    names = keywords(target)
    if names is None:
        return
    for name, value in given.items():
        if name in names:
            continue
        near = [n for n in names if name in n] or difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hint = f"; did you mean {key}.{near[0]}?" if near else ""
        takes_text = f"it takes {', '.join(names)}" if names else "it takes no keyword arguments"
        raise ConfigError(f"{key}.{name}={value}: {path} takes no argument {name}{hint} ({takes_text})")


def call(key: str, node: dict, **extra):
    """The callable a `{_target_, **kwargs}` node names, its keywords checked, called with them (and `extra`, what
    xtrain gives it: the parameters, the optimizer); a failure is one line."""
    path = node["_target_"]
    target = resolve(key, path)
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    check_keywords(key, path, target, kwargs)
    try:
        return target(**kwargs, **extra)
    except Exception as err:
        raise ConfigError(f"{key}._target_={path}: calling it failed: {type(err).__name__}: {err}") from None
