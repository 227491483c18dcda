"""`python -m xtrain.prepare <the run's overrides>`: only the data step of that run, ahead of time.

It composes the same config as `python -m xtrain` and prepares its data into the cache (`data.cache_dir`), so
that a later run (or a GPU job after a CPU one) starts training without preparing. Nothing else starts and no
run dir is written. Bad input ends as one line on stderr and exit code 2, with nothing cached.
"""

from __future__ import annotations

import sys

from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from xtrain.commands import cli
from xtrain.config import schema
from xtrain.core.errors import ConfigError
from xtrain.core.files import keep_private


USAGE = """usage: python -m xtrain.prepare [GROUP=OPTION ...] [SETTING=VALUE ...]

Prepares the data of the run these overrides describe (the same as `python -m xtrain`'s) into the cache
(data.cache_dir, or XTRAIN_CACHE_DIR), so that the run starts training without preparing. Nothing trains and
no run dir is written."""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"--help", "-h"} & set(argv):
        print(USAGE)
        return
    keep_private()
    cli.register_schemas()
    try:
        with initialize_config_module("xtrain.conf", version_base="1.3"):
            cfg = schema.from_container(compose("config", overrides=argv))
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        cli._report_refusal(err)
    from xtrain.tasks.registry import task_for
    from xtrain.launch.worker import configure_logging

    configure_logging()
    try:
        prepared = task_for(cfg).prepare()
    except ConfigError as err:
        cli.fail(str(err))
    if prepared is None:
        print(f"nothing to prepare: task={cfg.task.name.value} reads its datasets as they are")
        return
    print(f"{'prepared' if prepared.fresh else 'already prepared'}: {prepared.describe()} in {prepared.path}")


if __name__ == "__main__":
    main()
