"""`run_with_accelerate`: run any function under N processes, as `accelerate launch` would run a script.

    @run_with_accelerate(num_processes=2, mixed_precision="bf16")
    def train(lr: float, steps: int) -> float:
        ...                                  # plain Accelerate code
    loss = train(lr=3e-4, steps=100)         # rank 0's return value (or exception) comes back

The arguments are `accelerate launch`'s, parsed and translated by Accelerate's own code into
the environment its `Accelerator()` reads. Workers are started by the same supervisor as the
CLI's (torchrun; failures stop every rank; Ctrl-C stops the tree). The function and its
keyword arguments travel with cloudpickle, so functions from a script's `__main__` or a
notebook work. On a machine without CUDA, `cpu=True` is implied: otherwise Accelerate
would let every rank train alone.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from xtrain.core import machine

MARK = "__xtrain_run_with_accelerate__"
INSIDE = "XTRAIN_FUNCTION_WORKER"
PAYLOAD, RESULT = "function.pkl", "result.pkl"


def _launch_args(launch_args: dict, cuda: bool):
    """Accelerate's own parser and validation for the given `accelerate launch` arguments."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    parser = launch_command_parser()
    known = {a.dest for a in parser._actions}
    unknown = [k for k in launch_args if k not in known]
    if unknown:
        hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, known, n=1)) else k
                 for k in unknown]
        raise RuntimeError(f"run_with_accelerate: not an `accelerate launch` argument: {', '.join(hints)}")
    argv: list[str] = []
    for key, value in launch_args.items():
        flag = f"--{key}"
        if value is True:
            argv.append(flag)
        elif value not in (False, None):
            argv += [flag, str(value)]
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = parser.parse_args([*argv, "xtrain_function"])
    except SystemExit:
        message = captured.getvalue().strip().splitlines()[-1:] or ["invalid arguments"]
        raise RuntimeError(f"run_with_accelerate: {message[0]}") from None
    if not cuda:
        refuse_without_cuda(args, launch_args)
        args.cpu = True  # without it a CUDA-less multi-process launch trains N separate models
    return _validate_launch_command(args)


def refuse_without_cuda(args, launch_args: dict) -> None:
    """What Accelerate would silently run differently on a machine without CUDA: refused, as by the CLI."""
    for flag, what in (("use_fsdp", "FSDP"), ("use_deepspeed", "DeepSpeed")):
        if getattr(args, flag):
            raise RuntimeError(f"run_with_accelerate({flag}=True): {what} needs CUDA GPUs and this machine has none")
    if args.mixed_precision in ("fp16", "fp8"):
        raise RuntimeError(
            f"run_with_accelerate(mixed_precision={args.mixed_precision!r}): needs a CUDA GPU (on this CPU Accelerate "
            "would silently train in another precision); use mixed_precision='bf16' or 'no'"
        )
    if args.gpu_ids not in (None, "all"):
        raise RuntimeError(
            f"run_with_accelerate(gpu_ids={args.gpu_ids!r}): this machine has no CUDA GPU; leave gpu_ids out"
        )
    if launch_args.get("cpu") is False and (args.num_processes or 1) > 1:
        raise RuntimeError(
            "run_with_accelerate(cpu=False): this machine has no CUDA GPU, so every rank would train alone; "
            "leave cpu out (or cpu=True) for data-parallel training on the CPU"
        )


def _accelerate_env(args, defaults, mp_from_config, port: int) -> dict:
    """The ACCELERATE_* / FSDP_* variables `accelerate launch` would give the workers."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args.main_process_port = port
    if args.use_deepspeed:  # as accelerate.commands.launch.launch_command dispatches
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        if mp_from_config:
            fields.append("mixed_precision")
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    env = {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
    env["ACCELERATE_USE_CPU"] = str(bool(args.cpu)).lower()
    if args.gpu_ids not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = worker_gpus(args.gpu_ids, machine.visible_gpu_ids())
    return env


def worker_gpus(gpu_ids: str, visible: list[str]) -> str:
    """`gpu_ids` (indices of the GPUs this process sees, as torch numbers them) as CUDA_VISIBLE_DEVICES for
    the workers: under a parent limited to `4,5,6,7`, gpu_ids='0,1' are GPUs 4 and 5, not other people's 0 and 1."""
    chosen = []
    for part in gpu_ids.split(","):
        if not part.strip().isdigit() or int(part) >= len(visible):
            raise RuntimeError(
                f"run_with_accelerate(gpu_ids={gpu_ids!r}): {part.strip()!r} is not one of this process's GPUs "
                f"0..{len(visible) - 1} (CUDA_VISIBLE_DEVICES={','.join(visible)}); give indices among them"
            )
        chosen.append(visible[int(part)])
    return ",".join(chosen)


def _call(func, kwargs: dict, launch_args: dict):
    import cloudpickle

    from xtrain.launch.supervisor import Topology, free_port, supervise
    from xtrain.core.rundir import first_rank_error

    args, defaults, mp_from_config = _launch_args(launch_args, torch.cuda.is_available())
    machines = args.num_machines or 1
    topology = Topology(
        nodes=machines, node_rank=int(args.machine_rank or 0),
        processes_per_node=max(1, (args.num_processes or 1) // machines),
        main_process_ip=args.main_process_ip or "127.0.0.1",
        main_process_port=args.main_process_port or (free_port() if machines == 1 else 29500),
    )
    env = _accelerate_env(args, defaults, mp_from_config, topology.main_process_port)
    env[INSIDE] = "1"
    # functions pickled by reference are imported again in the workers: give them this process's path
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    workdir, keep = Path(tempfile.mkdtemp(prefix="xtrain-function-")), None
    try:
        (workdir / PAYLOAD).write_bytes(cloudpickle.dumps((func, kwargs)))
        code = supervise(topology, workdir, ["xtrain.decorator.worker", str(workdir)], env)
        if code < 0:
            raise KeyboardInterrupt(f"run_with_accelerate: stopped by signal {-code}; all workers ended")
        outcome = workdir / RESULT
        kind, value = cloudpickle.loads(outcome.read_bytes()) if outcome.exists() else ("missing", None)
        if kind == "ok" and code == 0:
            return value
        root = first_rank_error(workdir)
        if kind == "error" and (root is None or root["rank"] == 0):
            raise value  # rank 0's own exception, as if the function had run here
        detail = f"rank {root['rank']} failed: {root['summary']}\n{root['traceback']}" if root else \
            f"workers exited with code {code}"
        keep = workdir  # the evidence: every rank's output and torchrun's log
        raise RuntimeError(f"run_with_accelerate({func.__name__}): {detail}\nlogs: {keep / 'logs'}")
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


def run_with_accelerate(func=None, /, **launch_args):
    """Decorate a function to run under `accelerate launch` semantics; see the module docstring."""
    if func is not None and not callable(func):
        raise RuntimeError(
            f"run_with_accelerate takes `accelerate launch` options as keywords, e.g. "
            f"@run_with_accelerate(num_processes=2); got the positional argument {func!r}"
        )
    # unknown, invalid or unrunnable launch options fail at decoration, not at the first call
    _launch_args(launch_args, torch.cuda.is_available())

    def decorate(target):
        if hasattr(target, MARK):
            raise RuntimeError(f"{target.__name__} is already decorated with run_with_accelerate: decorate it once")
        if not inspect.isfunction(target):
            raise RuntimeError(
                f"run_with_accelerate decorates functions, not {type(target).__name__} objects: "
                "wrap the call in a function and decorate that"
            )
        params = ", ".join(f"{name}=..." for name in inspect.signature(target).parameters)

        @functools.wraps(target)
        def wrapper(*args, **kwargs):
            if args:
                raise RuntimeError(
                    f"{target.__name__} runs in other processes and takes keyword arguments only: "
                    f"call {target.__name__}({params})"
                )
            if os.environ.get(INSIDE) or os.environ.get("LOCAL_RANK") is not None:
                raise RuntimeError(
                    f"{target.__name__} was called inside a worker process that is already distributed: "
                    f"call the undecorated function there ({target.__name__}.__wrapped__(...))"
                )
            return _call(target, kwargs, launch_args)

        setattr(wrapper, MARK, launch_args)
        return wrapper

    return decorate(func) if func is not None else decorate
