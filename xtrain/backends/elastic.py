"""A run on fewer nodes than it asked for (`cluster.min_nodes`, on SLURM and Ray): the effective batch kept by
grad_accum, run.yaml written again with the nodes it trains on and a history line saying so."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from xtrain.config.schema import RunConfig
from xtrain.core import rundir


def on_nodes(cfg: RunConfig, nodes: int) -> RunConfig:
    """The run on `nodes` of the `cluster.min_nodes`-`cluster.nodes` it asked for: grad_accum keeps its effective
    batch (a ConfigError where no whole grad_accum does)."""
    from xtrain.config import schema
    from xtrain.engine import resume

    if nodes == cfg.cluster.nodes:
        return cfg
    fewer = replace(cfg, cluster=replace(cfg.cluster, nodes=nodes))
    return resume.keep_effective_batch(fewer, schema.to_container(cfg), f"cluster.min_nodes={cfg.cluster.min_nodes}: "
                                       "the run trains")


def check_fewer(cfg: RunConfig) -> None:
    """Each number of nodes the run may continue on keeps its effective batch (a ConfigError where one cannot)."""
    for nodes in range(cfg.cluster.min_nodes or cfg.cluster.nodes, cfg.cluster.nodes):
        on_nodes(cfg, nodes)


def run_yaml_on(path: Path, given: RunConfig, line: str) -> str:
    """run.yaml's text for `given` (a run moved to other nodes): its history, then `line`, then the config."""
    from xtrain.config import schema

    return "".join(f"{moved}\n" for moved in [*rundir.history(path), line]) + schema.to_yaml(given)
