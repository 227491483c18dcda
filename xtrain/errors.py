"""Every error a user sees, and how each becomes one line. Imports nothing of xtrain.

| exception | what happened | exit code |
| --- | --- | --- |
| `ConfigError` | a bad setting, file, model or request; nothing started | 2 |
| `Diverged` | the loss became NaN or infinite | 1 |
| `LaunchFailed` | workers failed (the message is the failing rank's own error) | its `exit_code` |
| `Stopped` | stopped on request at a step boundary, with a checkpoint: resumable, not an error | 128 + signal |
| `Terminated` | a worker ended by SIGTERM (another rank failed, or the run was stopped) | - |
| `SweepFailed` | points of a sweep failed (one line each), or the sweep was interrupted | its `exit_code` |
"""

from __future__ import annotations

import difflib
import re
import sys


class ConfigError(ValueError):
    """A user error in the run config: printed as one line, exit code 2."""


class Diverged(RuntimeError):
    """The loss became NaN or infinite: printed as one line (no traceback helps), exit code 1."""


class LaunchFailed(Exception):
    """Workers failed; the message is the failing rank's own error."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Stopped(Exception):
    """A run stopped at a step boundary on request, with a complete checkpoint: resumable."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # as a shell reports a process ended by that signal


class Terminated(KeyboardInterrupt):
    """SIGTERM to a worker: another rank failed, or the user stopped the run. An interruption, like Ctrl-C:
    `except Exception` in library code does not swallow it, and result.json says `interrupted`."""


class SweepFailed(Exception):
    """Points of a sweep failed (one line each; the others are recorded), or the sweep was interrupted."""

    def __init__(self, lines: list[str], exit_code: int):
        super().__init__("\n".join(lines))
        self.exit_code = exit_code


def positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name}={value}: must be > 0")


def non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{name}={value}: must be >= 0")


def one_line(err: BaseException) -> str:
    """An error as result.json and the terminal show it: xtrain's own errors as they are, others typed."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return text if isinstance(err, (ConfigError, LaunchFailed)) else f"{type(err).__name__}: {text}"


def _override_value(key: str) -> str | None:
    for arg in sys.argv[1:]:
        name, sep, value = arg.lstrip("+~").partition("=")
        if sep and name == key:
            return value
    return None


def explain(err: Exception, settings: list[str]) -> str:
    """One line for a Hydra / OmegaConf composition error: the setting, the bad value, what would work.
    `settings`: every dotted key a user can set (for a close match to a typo)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue

    cause = err.__cause__ or err
    key = getattr(cause, "full_key", None)
    if not key:
        return " ".join(str(err).split())
    value = _override_value(key)
    setting = f"{key}={value}" if value is not None else key
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        close = difflib.get_close_matches(key, settings, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "python -m xtrain --cfg job lists every setting"
        return f"{setting}: no such setting; {hint}"
    if isinstance(cause, MissingMandatoryValue):
        return f"{key}: must be set"
    reason = str(cause).splitlines()[0]
    converted = re.match(r"Value '.*' of type '.*' could not be converted to (\w+)", reason)
    if converted:
        reason = f"not a valid {converted.group(1).lower()}"
    return f"{setting}: {reason}"
