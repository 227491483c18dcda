"""What a backend is: where a run's processes run. `local` (this machine) and `slurm` (a SLURM allocation) are
modules that provide these functions; `registry.backend_for` returns one as a `Backend`. Each takes configs that
`registry.resolve_auto` made concrete and run dirs that launch/preflight.py wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

from xtrain.config.point import Point
from xtrain.config.schema import RunConfig


@runtime_checkable
class Backend(Protocol):
    def resolve(self, cfg: RunConfig) -> RunConfig:
        """Its automatic settings made concrete (SLURM: what a node of the partition has)."""

    def check(self, cfg: RunConfig) -> None:
        """What only this backend can check (a SLURM partition's nodes), before `preflight.preflight`."""

    def describe(self, cfg: RunConfig, script: bool = True) -> str:
        """A dry run: every check the real run makes, then the plan (and a SLURM job's script)."""

    def run(self, cfg: RunConfig) -> dict:
        """One run (the CLI's): check, write the run dir, run it; its result."""

    def scripts(self, points: list[Point], sweep_dir: Path, **options) -> list[str]:
        """A sweep's job scripts, as a dry run shows them (none on this machine)."""

    def check_points(self, points: list[Point], **options) -> None:
        """A sweep's options (`hydra.launcher.*`) against its points, before anything starts."""

    def run_points(self, points, sweep_dir: Path, on_end: Callable[[Point], None], **options) -> bool:
        """A sweep's written points (a list, or a source asked for the next one as a slot frees: None, none now),
        `on_end(point)` as each ends; False where they were left running (not waited for)."""
