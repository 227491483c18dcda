"""Each strategy's Parallelism, by the strategy's name: the one place a name becomes its behaviour."""

from __future__ import annotations

from xtrain.config.schema import RunConfig, Strategy
from xtrain.config.strategy import StrategyConfig
from xtrain.parallel.base import Parallelism
from xtrain.parallel.ddp import Ddp
from xtrain.parallel.fsdp import Fsdp
from xtrain.parallel.pipeline import wrap
from xtrain.parallel.zero import STAGE, Zero

BY_NAME: dict[Strategy, Parallelism] = {Strategy.ddp: Ddp(), Strategy.fsdp: Fsdp(),
                                        **{name: Zero(stage) for name, stage in STAGE.items()}}


def of(run: RunConfig | StrategyConfig) -> Parallelism:
    """The Parallelism of a run (or of its strategy settings): its strategy's, in pipeline stages where pp > 1."""
    strategy = run.strategy if isinstance(run, RunConfig) else run
    return wrap(BY_NAME[strategy.name], strategy)
