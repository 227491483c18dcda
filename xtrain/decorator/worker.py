"""One process of a `run_with_accelerate` call: `run([WORKDIR])`, started per rank by the launcher's agent.

Runs the pickled function with its keyword arguments; rank 0 writes its return value or
its exception back for the caller. Any failing rank leaves `logs/errors/rank<R>.json`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import cloudpickle
import torch

from xtrain.decorator.run_with_accelerate import PAYLOAD, RESULT
from xtrain.launch.worker import write_error

PRELOAD = ("accelerate",)  # imported once by the agent: every rank's function runs under Accelerate


def run(argv: list[str]) -> None:
    workdir = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    # SIGTERM keeps its default action (end now): a rank blocked in a rendezvous or collective cannot
    # run a Python handler, and torchrun would wait 30 s before killing it.
    func, kwargs = cloudpickle.loads((workdir / PAYLOAD).read_bytes())
    try:
        join_cpu_group()
        value = func(**kwargs)
    except BaseException as err:
        write_error(workdir, rank, err, None)
        if rank == 0:
            try:
                outcome = cloudpickle.dumps(("error", err))
            except Exception:  # an exception that does not pickle: the caller gets the error file's text
                outcome = None
            if outcome is not None:
                (workdir / RESULT).write_bytes(outcome)
        raise
    finally:
        # a process group left alive makes the interpreter abort at exit (C++ threads still running)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if rank == 0:
        (workdir / RESULT).write_bytes(cloudpickle.dumps(("ok", value)))


def join_cpu_group() -> None:
    """On CPUs, a `PartialState()` made before the `Accelerator()` (as in many Hugging Face scripts) joins the
    N-process group as the Accelerator does: Accelerate's `Accelerator` reads ACCELERATE_USE_CPU, its
    `PartialState` does not, and would give each rank a lone process. Nothing starts early: a function that
    sets up torch.distributed itself still can."""
    if os.environ.get("ACCELERATE_USE_CPU") != "true":
        return
    from accelerate.state import PartialState

    original = PartialState.__init__

    @functools.wraps(original)
    def on_cpu(self, cpu: bool = False, **kwargs):
        original(self, True, **kwargs)

    PartialState.__init__ = on_cpu
