"""What a setting is beyond its type and default, said on its own field:

- `setting(..., free=True)`: a resume may change it (when things happen, where the run runs, how it is watched),
  and a group whose every setting is so is marked `@all_free`; anything else changes what trains;
- `setting(..., only=(...))`: read by those options of its group alone (given, not its default, with another
  option, it is refused: a setting that does nothing where it was given is never ignored).
"""

from __future__ import annotations

import dataclasses
from typing import Any

FREE, ONLY = "free", "only"


def setting(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, free: bool = False,
            only: tuple[str, ...] = ()) -> Any:
    metadata = {**({FREE: True} if free else {}), **({ONLY: only} if only else {})}
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata)


def all_free(cls):
    """Every setting of the group a resume may change."""
    cls.__all_free__ = True
    return cls


def not_read_by(settings, option: str) -> list[str]:
    """The settings of `settings`' dataclass that `option` does not read."""
    return [f.name for f in dataclasses.fields(settings) if f.metadata.get(ONLY) and option not in f.metadata[ONLY]]


def free_settings(schema, prefix: str = "") -> list[str]:
    """Every dotted setting a resume may change: a name, or a group's prefix ending in "." where all of it is."""
    if getattr(schema, "__all_free__", False):
        return [prefix]
    names = []
    for f in dataclasses.fields(schema):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            names += free_settings(type(sub), f"{prefix}{f.name}.")
        elif f.metadata.get(FREE):
            names.append(f"{prefix}{f.name}")
    return names
