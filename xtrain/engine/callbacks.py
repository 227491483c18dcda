"""`trainer.callbacks`: objects of the user's, by `_target_`, whose hooks the loop calls. The hooks are named as
Lightning's, and each gets the run's `State` (what a hook may read, and `request_stop`):

| hook | when |
| --- | --- |
| `on_train_start(state)` | after the model, data and optimizer are built (and restored), before the first eval |
| `on_train_batch_end(state, loss)` | after each optimizer step, with the step's loss (every rank's mean) |
| `on_validation_end(state, metrics)` | after each eval, with its values (`{"val_loss": ..., "val_<metric>": ...}`) |
| `on_save_checkpoint(state, path)` | after each checkpoint is saved, with its directory |
| `on_train_end(state)` | when training ends: completed, or stopped early |
| `on_exception(state, error)` | when the run fails (the exception) or is interrupted (a stop signal: `KeyboardInterrupt`) |

A hook runs on the main process, or on every rank where the callback sets `every_rank = True`. `state.request_stop`
ends the run at this step boundary: every rank agrees (the main process's request), saves the step's checkpoint and
exports the model, and the run is `completed` with `callback_stop` in result.json. An exception in a hook ends the run
`failed`, in one line that names the callback and the hook (one in `on_exception` is logged: the run's own error
stands). Before anything launches, a method named like a hook (`on_*`) that is not one, and a hook that cannot take
its arguments, are refused in one line.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from xtrain.config.schema import RunConfig
from xtrain.core.errors import CallbackFailed, ConfigError

log = logging.getLogger("xtrain")

# each hook and what it is given after the state
HOOKS = {"on_train_start": (), "on_train_batch_end": ("loss",), "on_validation_end": ("metrics",),
         "on_save_checkpoint": ("path",), "on_train_end": (), "on_exception": ("error",)}
CALLBACK_STOP = "a callback"  # the `signal` of a run's stop record when a callback asked for it


@dataclass
class State:
    """What a hook sees of the run."""

    run_dir: Path
    max_steps: int
    world_size: int
    is_main_process: bool
    model: torch.nn.Module  # the model being trained (unwrapped: as the user built it)
    step: int = 0
    result: dict = field(default_factory=dict)  # result.json as it stands (val_<name>, best_val_<name>, ...)
    stop_reason: str | None = None

    def request_stop(self, reason: str = "") -> None:
        """End the run at this step boundary (with a checkpoint and the export), as an early stop does."""
        self.stop_reason = reason or "asked"


def build(cfg: RunConfig, main: bool) -> list[tuple[str, object]]:
    """The callbacks this rank runs: (how an error names it, the object)."""
    from xtrain.tasks.targets import call, importable

    importable(cfg.task.code_dir)
    built = []
    for i, node in enumerate(cfg.trainer.callbacks):
        built_by(f"trainer.callbacks[{i}]", node["_target_"])  # (a function that makes who knows what: not called)
        callback = call(f"trainer.callbacks[{i}]", dict(node))
        check_hooks(f"trainer.callbacks[{i}]._target_={node['_target_']}", callback)
        if main or getattr(callback, "every_rank", False):
            built.append((f"trainer.callbacks[{i}] ({node['_target_']})", callback))
    return built


def built_by(key: str, path: str) -> type:
    """The class `_target_` builds: itself, or a function's annotated return type. A function without one would
    have to be called to be checked, and is refused (a dry run refuses what the run refuses, and calls nothing)."""
    import typing

    from xtrain.tasks.targets import resolve

    target = resolve(key, path)
    if isinstance(target, type):
        return target
    try:
        returns = typing.get_type_hints(target).get("return")
    except Exception:  # (an annotation that does not resolve, a builtin without any)
        returns = None
    if isinstance(returns, type):
        return returns
    raise ConfigError(f"{key}._target_={path}: a function, whose result cannot be checked without calling it; give "
                      "a class with hooks (or annotate the function's return type with one)")


def check_hooks(name: str, callback) -> None:
    """The callback (an object, or a class before it is built) has a hook; each method named like one (`on_*`) is
    one (a Lightning name such as `on_validation_epoch_end` would never be called); each hook takes what it is
    given."""
    methods = [m for m in dir(callback) if m.startswith("on_") and callable(getattr(callback, m, None))]
    for method in methods:
        if method not in HOOKS:
            near = difflib.get_close_matches(method, list(HOOKS), n=1, cutoff=0.5)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ConfigError(f"{name}: {method} is not a hook xtrain calls, so it would never run; {hint}"
                              f"(the hooks: {', '.join(HOOKS)})")
    if not methods:
        raise ConfigError(f"{name}: has none of the hooks {', '.join(HOOKS)}")
    for method in methods:
        given = HOOKS[method]
        unbound = isinstance(callback, type) and not isinstance(inspect.getattr_static(callback, method), staticmethod)
        try:
            signature = inspect.signature(getattr(callback, method))
        except ValueError:  # no signature to read (a builtin): called as it is
            continue
        lightnings(name, method, [p for p in signature.parameters if p != "self"])
        try:
            signature.bind(*(["self"] if unbound else []), "state", *given)
        except TypeError:
            raise ConfigError(f"{name}: {method} cannot be called as {method}({', '.join(('state', *given))}), as "
                              "xtrain calls it") from None


def lightnings(name: str, method: str, parameters: list[str]) -> None:
    """A hook written for Lightning (`on_validation_end(self, trainer, pl_module)`) would be called with xtrain's
    state and values in those places, and fail inside: refused, saying what xtrain passes."""
    if parameters[:1] == ["trainer"] or "pl_module" in parameters:
        given = ", ".join(("state", *HOOKS[method]))
        raise ConfigError(f"{name}: {method}({', '.join(parameters)}) takes Lightning's arguments; xtrain calls "
                          f"{method}({given}) (state: run_dir, step, max_steps, world_size, model, result, "
                          "request_stop())")


def check(cfg: RunConfig, dry_run: bool = False) -> None:
    """On the driver, before anything launches: every callback imports, builds and has hooks it can take. A dry run
    builds none (a callback is code that runs): its keywords and hooks are checked on its class (a function's
    annotated return type; a function without one is refused in both, never called)."""
    if not dry_run:
        build(cfg, main=True)
        return
    from xtrain.tasks.targets import check_keywords, importable, resolve

    importable(cfg.task.code_dir)
    for i, node in enumerate(cfg.trainer.callbacks):
        key, path = f"trainer.callbacks[{i}]", node["_target_"]
        target = resolve(key, path)
        check_keywords(key, path, target, {k: v for k, v in node.items() if k != "_target_"})
        check_hooks(f"{key}._target_={path}", built_by(key, path))


class Callbacks:
    def __init__(self, cfg: RunConfig, accelerator, model, run_dir: Path):
        self.items = build(cfg, accelerator.is_main_process)
        self.any = bool(cfg.trainer.callbacks)  # on some rank: the stop is agreed on every rank
        self.accelerator = accelerator
        self.state = State(run_dir, cfg.trainer.max_steps, accelerator.num_processes, accelerator.is_main_process,
                           accelerator.unwrap_model(model))

    def call(self, hook: str, step: int, result: dict | None, *args) -> None:
        self.state.step = step
        if result is not None:
            self.state.result = result
        for name, callback in self.items:
            function = getattr(callback, hook, None)
            if function is None:
                continue
            try:
                function(self.state, *args)
            except Exception as err:
                text = " ".join(str(err).split())[:300]
                raise CallbackFailed(f"{name}.{hook} raised {type(err).__name__}: {text}") from err

    def exception(self, step: int, result: dict, error: BaseException) -> None:
        """Each callback's `on_exception`: the run failed with `error`, or was interrupted. The run's own error stands:
        a hook that raises here is logged."""
        try:
            self.call("on_exception", step, result, error)
        except CallbackFailed as err:
            log.error("%s", err)

    def stop_asked(self) -> str | None:
        """The main process's callbacks' stop request, the same on every rank (a broadcast where there are callbacks
        and several ranks)."""
        if not self.any:
            return None
        asked = self.state.stop_reason
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            flag = broadcast(torch.tensor([float(asked is not None)], device=self.accelerator.device), from_process=0)
            asked = (asked or "asked on the main process") if flag.item() else None
        return asked
