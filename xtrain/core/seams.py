"""The one hook through which the test suite runs what this machine's hardware could not (its seams, in
`tests/seams/`): the GPU-only strategies and precisions on a CPU, and a few of its own timings.

`XTRAIN_SEAMS` names seam files, separated by commas; each is loaded once, at the first question, and its `SEAM`
object answers the hooks it defines by their method names. Without the variable nothing is loaded and every hook
answers None: a user's run never takes a seam's path. The hooks, and where they are asked:

| hook | asked by | answers |
| --- | --- | --- |
| `runs_on_cpu(what, cfg)` | launch/hardware.py, engine/optim.py | `what` ("fsdp", "zero", "fp16", "fp8") runs on this CPU |
| `before_accelerator(cfg, kwargs, setup)` | engine/accelerator.py | changes the plugins and `setup` (cpu, backend) |
| `after_accelerator(cfg, accelerator)` | engine/accelerator.py | changes the Accelerator |
| `peak_tflops()` | engine/speed.py | a dense peak for a device the table lacks |
| `linger_s()` | launch/supervisor.py | how long ranks may outlive the first one to end |
| `spawn_ranks()` | launch/agent.py | ranks start by spawn, as on an accelerator's build of torch |
| `before_checkpoint_write(step)` | engine/saving.py | (called) an asynchronous save's files are about to be written |
"""

from __future__ import annotations

import importlib.util
import os

ENV = "XTRAIN_SEAMS"
_loaded: dict[str, object] = {}


def installed() -> list:
    """The seams the environment names, in its order."""
    seams = []
    for path in filter(None, os.environ.get(ENV, "").split(",")):
        if path not in _loaded:
            spec = importlib.util.spec_from_file_location(f"xtrain_seam_{len(_loaded)}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _loaded[path] = module.SEAM
        seams.append(_loaded[path])
    return seams


def first(hook: str, *args):
    """The first answer (not None) of a seam that defines `hook`, else None."""
    for seam in installed():
        if hasattr(seam, hook) and (answer := getattr(seam, hook)(*args)) is not None:
            return answer
    return None


def each(hook: str, *args) -> None:
    """`hook` called on every seam that defines it."""
    for seam in installed():
        if hasattr(seam, hook):
            getattr(seam, hook)(*args)
