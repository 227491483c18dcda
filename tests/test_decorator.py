"""run_with_accelerate: any function under N real processes, with accelerate launch's arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xtrain import run_with_accelerate


@run_with_accelerate(num_processes=2, mixed_precision="bf16")
def all_reduce(base: float) -> dict:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    total = accelerator.reduce(torch.tensor([base + accelerator.process_index]), reduction="sum")
    return {"total": total.item(), "world": accelerator.num_processes, "rank": accelerator.process_index,
            "type": accelerator.distributed_type.value, "mixed_precision": accelerator.mixed_precision}


def test_two_processes_really_all_reduce_and_rank_0_returns():
    out = all_reduce(base=10.0)
    assert out == {"total": 21.0, "world": 2, "rank": 0, "type": "MULTI_CPU", "mixed_precision": "bf16"}


@run_with_accelerate(num_processes=2)
def fails(on_rank: int) -> None:
    import os

    if int(os.environ["RANK"]) == on_rank:
        raise ValueError(f"bad value on rank {on_rank}")
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()


def test_rank_0_exception_comes_back_as_itself():
    with pytest.raises(ValueError, match="bad value on rank 0"):
        fails(on_rank=0)


def test_another_ranks_failure_is_reported_with_its_rank():
    with pytest.raises(RuntimeError, match="rank 1 failed: ValueError: bad value on rank 1"):
        fails(on_rank=1)


SCRIPT = """
from xtrain import run_with_accelerate

SCALE = 3.0  # a global of __main__: travels with the function (cloudpickle by value)

@run_with_accelerate(num_processes=2)
def train(lr: float, steps: int) -> float:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    loss = torch.tensor([lr * steps * SCALE * (accelerator.process_index + 1)])
    return accelerator.reduce(loss, reduction="mean").item()

print("RESULT", train(lr=0.5, steps=4))
"""


def test_function_from_a_scripts_main(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "RESULT 9.0" in out.stdout  # mean of 6 and 12


def test_function_defined_interactively(tmp_path):
    """Like a notebook cell: __main__ without a file (python -c)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "RESULT 9.0" in out.stdout


def test_positional_arguments_are_refused_with_the_keyword_call():
    with pytest.raises(RuntimeError, match=r"takes keyword arguments only: call all_reduce\(base=\.\.\.\)"):
        all_reduce(1.0)


def test_decorating_something_that_is_not_a_function():
    class Model:
        pass

    with pytest.raises(RuntimeError, match="decorates functions, not type objects"):
        run_with_accelerate(num_processes=2)(Model)
    with pytest.raises(RuntimeError, match="decorates functions, not int objects"):
        run_with_accelerate(num_processes=2)(3)


def test_decorating_twice():
    with pytest.raises(RuntimeError, match="all_reduce is already decorated with run_with_accelerate"):
        run_with_accelerate(num_processes=2)(all_reduce)


def test_unknown_launch_argument_fails_at_decoration():
    with pytest.raises(RuntimeError, match=r"not an `accelerate launch` argument: num_process \(did you mean "
                                           r"num_processes\?\)"):
        run_with_accelerate(num_process=2)
    with pytest.raises(RuntimeError, match="invalid int value: 'two'"):
        run_with_accelerate(num_processes="two")


@run_with_accelerate(num_processes=2)
def calls_a_decorated_function() -> None:
    all_reduce(base=1.0)


def test_calling_it_from_inside_a_worker():
    with pytest.raises(RuntimeError, match=r"called inside a worker process.*all_reduce.__wrapped__"):
        calls_a_decorated_function()


def test_same_meanings_as_accelerate_launch_for_the_environment():
    """Accelerate's own translation of the arguments; on a CUDA machine (cuda=True) FSDP passes through."""
    from xtrain.decorator.run_with_accelerate import _accelerate_env, _launch_args

    gpu = _accelerate_env(*_launch_args({"num_processes": 4, "mixed_precision": "fp16", "use_fsdp": True,
                                         "fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_version": 1},
                                        cuda=True), port=29555)
    assert gpu["ACCELERATE_MIXED_PRECISION"] == "fp16" and gpu["ACCELERATE_USE_FSDP"] == "true"
    assert gpu["FSDP_SHARDING_STRATEGY"] == "SHARD_GRAD_OP" and gpu["FSDP_VERSION"] == "1"
    assert gpu["ACCELERATE_USE_CPU"] == "false"
    cpu = _accelerate_env(*_launch_args({"num_processes": 2, "mixed_precision": "bf16"}, cuda=False), port=29556)
    assert cpu["ACCELERATE_MIXED_PRECISION"] == "bf16" and cpu["ACCELERATE_USE_CPU"] == "true"


@pytest.mark.parametrize("launch_args,message", [
    ({"num_processes": 2, "use_fsdp": True}, r"run_with_accelerate\(use_fsdp=True\): FSDP needs CUDA GPUs"),
    ({"num_processes": 2, "use_deepspeed": True}, r"use_deepspeed=True\): DeepSpeed needs CUDA GPUs"),
    ({"num_processes": 2, "mixed_precision": "fp16"}, r"mixed_precision='fp16'\): needs a CUDA GPU"),
    ({"num_processes": 2, "cpu": False}, r"cpu=False\): this machine has no CUDA GPU, so every rank would train alone"),
    ({"num_processes": 2, "gpu_ids": "0,1"}, r"gpu_ids='0,1'\): this machine has no CUDA GPU; leave gpu_ids out"),
])
def test_what_a_cpu_cannot_run_is_refused(launch_args, message):
    from xtrain.decorator.run_with_accelerate import _launch_args

    with pytest.raises(RuntimeError, match=message):
        _launch_args(launch_args, cuda=False)


def test_gpu_ids_are_indices_among_the_gpus_this_process_sees(monkeypatch):
    """Under a parent limited to GPUs 4-7 (a shared box, a SLURM binding), gpu_ids='1,3' are its 5 and 7."""
    from xtrain.core import machine
    from xtrain.decorator.run_with_accelerate import _accelerate_env, _launch_args

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setattr(machine, "visible_gpus", lambda: 4)  # (no GPU here: the count CUDA would give)
    env = _accelerate_env(*_launch_args({"num_processes": 2, "gpu_ids": "1,3"}, cuda=True), port=29557)
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1f2e,MIG-9a8b")
    monkeypatch.setattr(machine, "visible_gpus", lambda: 2)
    env = _accelerate_env(*_launch_args({"num_processes": 1, "gpu_ids": "1"}, cuda=True), port=29558)
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-9a8b"
    with pytest.raises(RuntimeError, match=r"gpu_ids='1,2'\): '2' is not one of this process's GPUs 0..1"):
        _accelerate_env(*_launch_args({"num_processes": 2, "gpu_ids": "1,2"}, cuda=True), port=29559)


@run_with_accelerate(num_processes=2)
def partial_state_first() -> dict:
    from accelerate import Accelerator, PartialState

    state = PartialState()  # before the Accelerator, as many Hugging Face scripts do
    accelerator = Accelerator()
    return {"state": (state.distributed_type.value, state.num_processes),
            "accelerator": (accelerator.distributed_type.value, accelerator.num_processes)}


def test_a_partial_state_made_before_the_accelerator_sees_every_process():
    assert partial_state_first() == {"state": ("MULTI_CPU", 2), "accelerator": ("MULTI_CPU", 2)}


@run_with_accelerate(num_processes=2)
def prints_a_bad_byte_then_a_lot(lines: int) -> int:
    import sys

    sys.stdout.buffer.write(b"latin-1 caf\xe9\n")  # not UTF-8
    sys.stdout.buffer.flush()
    for i in range(lines):  # far more than a pipe holds: the reader must still be reading
        print(f"line {i} " + "x" * 100)
    return lines


def test_a_worker_that_writes_bytes_that_are_not_utf8_is_still_read(capfd):
    assert prints_a_bad_byte_then_a_lot(lines=5000) == 5000
    out = capfd.readouterr().out
    assert "latin-1 caf\ufffd" in out and "line 4999 " in out


def test_the_reader_of_torchruns_output_replaces_bytes_that_are_not_utf8_and_reads_on():
    import io

    from xtrain.launch.supervisor import RANK0_PREFIX, _pump

    stream = io.BytesIO(b"torchrun: caf\xe9\n" + RANK0_PREFIX.encode() + b"rank 0: \xff\xfe\n" + b"torchrun: later\n")
    terminal, log = io.StringIO(), io.StringIO()
    _pump(stream, terminal, log)
    assert terminal.getvalue() == "rank 0: \ufffd\ufffd\n"
    assert log.getvalue() == "torchrun: caf\ufffd\ntorchrun: later\n"
