"""torchrun whose workers are forks of one process that has already imported what they all import.

`python -m xtrain.launch.agent [torchrun's options] -m MODULE ARGS...`: torchrun's options, rendezvous, log tee and
failure handling (its elastic agent), but each local rank is a process of this one's that calls `MODULE.run(ARGS)`.
A worker started anew spends 3-4 s of CPU importing torch, transformers and Accelerate before its first line;
forked, it starts with them (the modules the worker module names in `PRELOAD`). Where torch is built for an
accelerator (CUDA, ROCm, XPU, MPS), each rank is a fresh interpreter instead (the spawn start method): a process
forked after its parent touched the device, if only to count it, cannot use it, and on a GPU 3 s is nothing. A rank
ends by returning from `run` (or raising): the agent waits for each rank's result, which one that called
`os._exit` first never gives.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from xtrain.core import seams



def as_started_anew() -> None:
    """The signal handlers a new interpreter has: the agent's own (it stops its workers with them) are not the
    worker's. Ignored signals stay ignored, as across exec."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)


def worker(module: str, *args: str) -> None:
    """One local rank, in its fork: `MODULE.run(ARGS)` with `sys.argv` as `python -m MODULE ARGS` would set it."""
    as_started_anew()
    sys.argv = [module, *args]
    importlib.import_module(module).run(list(args))


def start_method() -> str:
    """`fork` where torch is built for the CPU alone, else `spawn` (asked without touching a device)."""
    import torch

    accelerator = getattr(torch, "accelerator", None)  # (torch >= 2.6; before it, CUDA and ROCm builds)
    built = accelerator.current_accelerator() is not None if accelerator else torch.backends.cuda.is_built()
    return "spawn" if built or seams.first("spawn_ranks") else "fork"


def preload(module: str) -> str:
    """Import what this agent needs and, where its ranks are forks of it, what `module`'s ranks all import (its
    `PRELOAD`); the start method."""
    import torch.distributed.launcher.api  # noqa: F401
    import torch.distributed.run  # noqa: F401

    method = start_method()
    if method == "fork":
        for name in getattr(importlib.import_module(module), "PRELOAD", ()):
            importlib.import_module(name)
    return method


def main() -> None:
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(sys.argv[1:])
    if not args.module:
        raise SystemExit("xtrain.launch.agent: runs a module's ranks: -m MODULE ARGS")
    config, _, _ = config_from_args(args)
    config.start_method = preload(args.training_script)
    print(f"xtrain.launch.agent: {args.nproc_per_node} rank(s) of {args.training_script}, "
          f"{'forked' if config.start_method == 'fork' else 'each a fresh interpreter (spawn)'}", flush=True)
    elastic_launch(config=config, entrypoint=worker)(args.training_script, *args.training_script_args)
    # Every rank has ended and its result is in: what is left is the interpreter's teardown of torch and transformers
    # (a second of CPU, measured), which nothing here needs. (A failure raised above still exits as Python does.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
