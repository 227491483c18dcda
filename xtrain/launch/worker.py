"""One training process: `run([RUN_DIR])`, started N times per node by the launcher's agent (`xtrain.launch.agent`).

It reads the run dir (never composes config). A failure leaves `logs/errors/rank<R>.json`
with the rank's own error, which the driver shows first.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import signal
import sys
import time
import traceback
from importlib.resources import files
from pathlib import Path

import yaml

from xtrain.core import stopping
from xtrain.core.errors import ONE_LINE, ConfigError, Diverged, Terminated
from xtrain.core.files import keep_private, write_atomic
from xtrain.core.rundir import ERRORS_DIR

# What every rank imports before its first step (torch, transformers' models, Accelerate), imported once by the agent
PRELOAD = ("xtrain.engine.loop", "transformers.modeling_utils")


def configure_logging() -> None:
    """The driver's (Hydra's) logging config, for processes Hydra did not start."""
    logging.config.dictConfig(yaml.safe_load((files("xtrain.conf") / "hydra/job_logging/xtrain.yaml").read_text()))


def on_sigterm(signum, frame):
    raise Terminated("stopped by SIGTERM (another rank failed, or the run was stopped)")


def summarize(err: BaseException, timeout_s: int | None) -> str:
    text = " ".join(str(err).split())
    if timeout_s is not None and ("timed out" in text.lower() or "timeout" in type(err).__name__.lower()):
        return (
            f"a collective timed out after {timeout_s} s (cluster.timeout_s): another rank is stuck or has died "
            f"({type(err).__name__})"
        )
    return text if isinstance(err, ConfigError) else f"{type(err).__name__}: {text}"[:2000]


def write_error(run_dir: Path, rank: int, err: BaseException, timeout_s: int | None) -> None:
    path = run_dir / ERRORS_DIR / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({
        "rank": rank,
        "time": time.time(),
        "config_error": isinstance(err, ConfigError),
        "diverged": isinstance(err, Diverged),
        "one_line": isinstance(err, ONE_LINE),  # its summary says it all: no traceback shown
        "terminated": isinstance(err, Terminated),
        "summary": summarize(err, timeout_s),
        "traceback": "".join(traceback.format_exception(err)),
    }))


def run(argv: list[str]) -> None:
    """Trains the run dir `argv[0]` as this rank; returns when the run has ended and written its results. The fork
    then ends without the interpreter's teardown, where a C++ destructor sometimes aborted after ZeRO ("terminate
    called without an active exception")."""
    run_dir = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    keep_private()
    configure_logging()  # quieter on ranks other than 0
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, on_sigterm)
    stopping.end_with_parent()  # never outlive torchrun (which never outlives the driver)
    timeout_s = None
    try:
        from xtrain.config import schema
        from xtrain.core import rundir
        from xtrain.engine.loop import train

        cfg = schema.load(str(run_dir / rundir.RUN_CONFIG))
        timeout_s = cfg.cluster.timeout_s
        with stopping.on(stopping.IN_WORKERS, escalate=False):  # SIGTERM stays Terminated: torchrun stops ranks with it
            train(run_dir, cfg)
    except BaseException as err:
        write_error(run_dir, rank, err, timeout_s)
        if isinstance(err, ConfigError):  # the driver says it in one line: no traceback from the rank
            sys.stderr.flush()
            os._exit(2)
        raise

