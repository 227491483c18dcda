"""A study's search space, written as Hydra's sweep overrides (hydra-optuna-sweeper's syntax):

| override | Optuna distribution |
| --- | --- |
| `choice(a, b, c)` | categorical |
| `range(start, stop[, step])` | int (or float) steps from `start`, `stop` excluded (Hydra's meaning) |
| `interval(low, high)` | float, uniform |
| `tag(log, interval(low, high))` | float, log-uniform |
| `tag(int, interval(low, high))` | int, uniform (`tag(int, log, ...)`: log-uniform) |
| a plain value | fixed: the same in every trial |

hydra-optuna-sweeper's own parser is not reused: its package pins optuna<3, and Optuna 3 removed the
distribution classes it builds. The corners of a space (`corners`) are the trials that check it
before any runs: every choice, and the ends of every range.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from xtrain.core.errors import ConfigError, closest

MAX_CORNERS = 32  # beyond that, each dimension's ends with the others at their lows


@dataclass
class Space:
    distributions: dict = field(default_factory=dict)  # setting -> optuna distribution
    fixed: list[str] = field(default_factory=list)  # overrides every trial gets


def parse(overrides: list[str], known: set[str] | None = None) -> Space:
    """The space of these overrides; `known`: the run config's settings, to refuse one that names none."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    space = Space()
    for text in overrides:
        try:
            override = OverridesParser.create().parse_override(text)
        except HydraException as err:
            raise ConfigError(f"hydra.sweeper.params: {text!r} does not parse ({str(err).splitlines()[0]}); "
                              "write e.g. trainer.lr=tag(log,interval(1e-5,1e-2)) or trainer.batch_size=choice(8,16)") from None
        key = override.get_key_element()
        name = key.lstrip("+~")
        users_own = key.startswith("+") or name.endswith("._target_") or name.startswith(("data.train.", "data.val."))
        if known is not None and not users_own and not (name in known or any(name.startswith(k + ".") for k in known
                                                                              if "." in k)):
            close = closest(name, sorted(known))
            hint = f"did you mean {close}?" if close else "e.g. trainer.lr, trainer.batch_size, model.num_layers"
            raise ConfigError(f"hydra.sweeper.params: {key} names no setting of xtrain's run config; {hint}")
        if override.is_sweep_override():
            space.distributions[key] = distribution(text, override)
        else:
            space.fixed.append(text)
    return space


def distribution(text: str, override):
    """`override`, parsed from `text` (what its refusals quote)."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep, Transformer
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    tags = getattr(value, "tags", set())
    try:
        if isinstance(value, ChoiceSweep) or (isinstance(value, RangeSweep) and value.shuffle):
            return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
        if isinstance(value, RangeSweep):
            if (value.stop - value.start) * value.step < 0:
                raise ValueError("the range is empty (a study's range runs from start to stop, stop included)")
            if all(isinstance(v, int) for v in (value.start, value.stop, value.step)):
                return IntDistribution(value.start, value.stop, step=value.step)
            return FloatDistribution(value.start, value.stop, step=value.step)
        if isinstance(value, IntervalSweep):
            if "int" in tags or (isinstance(value.start, int) and isinstance(value.end, int)):
                return IntDistribution(int(value.start), int(value.end), log="log" in tags)
            return FloatDistribution(value.start, value.end, log="log" in tags)
    except ValueError as err:
        raise ConfigError(f"hydra.sweeper.params: {text}: {err}") from None
    raise ConfigError(f"hydra.sweeper.params: {text}: a study samples "
                      "choice(), range() and interval(), optionally tag(log, ...); not this sweep")


def as_override(key: str, value) -> str:
    return f"{key}={value}"


def ends(dist) -> list:
    from optuna.distributions import CategoricalDistribution

    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    return [dist.low, dist.high] if dist.low != dist.high else [dist.low]


def corners(space: Space) -> list[list[str]]:
    """Overrides of the space's corners: every combination of every dimension's ends, or where that is
    more than MAX_CORNERS, each dimension's ends with the other dimensions at their first end."""
    keys = list(space.distributions)
    options = [ends(space.distributions[k]) for k in keys]
    combos = list(itertools.islice(itertools.product(*options), MAX_CORNERS + 1))
    if len(combos) > MAX_CORNERS:
        base = [o[0] for o in options]
        combos = [tuple(base[:i] + [v] + base[i + 1:]) for i, o in enumerate(options) for v in o]
        combos = list(dict.fromkeys(combos))
    return [[as_override(k, v) for k, v in zip(keys, combo)] for combo in combos]
