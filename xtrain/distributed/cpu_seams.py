"""Test seams: the GPU-only paths (ZeRO, FSDP2, fp16 loss scaling) run on a CPU, so CI executes them.

Each is switched on by an environment variable that tests set, and honoured only where there is no
CUDA GPU (on a GPU the real path runs). None is a user option: Accelerate does not support these
paths on a CPU, and preflight (launch/hardware.py) refuses them to users with one line.

| variable | what runs on the CPU |
| --- | --- |
| `XTRAIN_TEST_ZERO_ON_CPU=1` | ZeRO through DeepSpeed's own CPU accelerator (gloo) |
| `XTRAIN_TEST_FSDP_ON_CPU=1` | FSDP2 over gloo, the process group presented to Accelerate as an accelerator's |
| `XTRAIN_TEST_FP16_ON_CPU=1` | fp16 autocast with a loss scaler (DDP), so the skipped-step path runs |
| `XTRAIN_TEST_FP8_ON_CPU=1` | fp8 with torchao: its layers' scaled casts and fp8 matmuls (torch's CPU `_scaled_mm`) |
"""

from __future__ import annotations

import os
from datetime import timedelta

from xtrain.config.schema import Fp8Backend, Precision, RunConfig, Strategy
from xtrain.config.strategy import StrategyConfig

ZERO_ON_CPU_ENV = "XTRAIN_TEST_ZERO_ON_CPU"
FSDP_ON_CPU_ENV = "XTRAIN_TEST_FSDP_ON_CPU"
FP16_ON_CPU_ENV = "XTRAIN_TEST_FP16_ON_CPU"
FP8_ON_CPU_ENV = "XTRAIN_TEST_FP8_ON_CPU"


def _switched_on(env: str) -> bool:
    import torch

    return os.environ.get(env) == "1" and not torch.cuda.is_available()


def zero_on_cpu(strategy: StrategyConfig) -> bool:
    """ZeRO through DeepSpeed's CPU accelerator (slow; Accelerate does not support it)."""
    return strategy.name in (Strategy.zero1, Strategy.zero2, Strategy.zero3) and _switched_on(ZERO_ON_CPU_ENV)


def fsdp_on_cpu(strategy: StrategyConfig) -> bool:
    """FSDP over gloo: Accelerate takes its FSDP branch only for accelerator process groups (`present_cpu_as_accelerator`)."""
    return strategy.name is Strategy.fsdp and _switched_on(FSDP_ON_CPU_ENV)


def fp16_on_cpu(cfg: RunConfig) -> bool:
    """fp16 autocast and a loss scaler on CPU (DDP): Accelerate runs fp16 only on accelerators (on CPU it trains fp32)."""
    return cfg.precision.name is Precision.fp16 and cfg.strategy.name is Strategy.ddp and _switched_on(FP16_ON_CPU_ENV)


def fp8_on_cpu(cfg: RunConfig) -> bool:
    """fp8 with torchao on CPU: Accelerate converts the layers and autocasts as on a GPU; torch's CPU `_scaled_mm`
    runs the fp8 matmuls (as slowly as any CPU fp8: a check of the path, not of its speed)."""
    return (cfg.precision.name is Precision.fp8 and cfg.precision.fp8_backend is Fp8Backend.torchao
            and _switched_on(FP8_ON_CPU_ENV))


def emulate_fp8_matmuls() -> None:
    """fp8 seam: torch's CPU `_scaled_mm` upcasts and multiplies (exact for fp8 inputs), not oneDNN's. On a CPU with
    AMX units torch hands fp8 matmuls to oneDNN, which has only its reference kernel for them: measured 2 s for one
    512 x 128 x 512 matmul, about 1,000x the upcast (a 10-step run of the seam's model took over 10 minutes)."""
    import torch

    torch.backends.mkldnn.enabled = False


def compile_fp8_without_cpu_vectors() -> None:
    """fp8 seam with trainer.compile: inductor's C++ code for the CPU without SIMD vectors. With them, torch 2.13
    miscompiles torchao's backward (weight gradients of layers that share an input read uninitialised memory: NaN
    at the first step). Without torchao, `torch.compile(g)(torch.randn(128, 128, dtype=torch.bfloat16))` differs
    from `g`'s for `def g(w): a, b = w.t().float(), w.t().float(); return a.t().contiguous(), b.t().contiguous()`.
    GPUs compile through Triton, not this code."""
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 1


def present_cpu_as_accelerator(fsdp_plugin, timeout: timedelta) -> None:
    """FSDP seam, before the Accelerator exists: the gloo group a CPU run gets, presented as an accelerator
    group. FSDP2 runs over gloo as it is; the one other difference from a GPU run is unpinned host memory
    for cpu_offload (pinning needs a GPU)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy

    PartialState(cpu=True, timeout=timeout, backend="gloo")
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    if isinstance(fsdp_plugin.cpu_offload, CPUOffloadPolicy):  # strategy.cpu_offload=true (else OffloadPolicy())
        fsdp_plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)


def accept_torch_adamw_offloaded(deepspeed_plugin) -> None:
    """ZeRO seam with strategy.offload_optimizer: torch's AdamW steps on the host copy (DeepSpeedCPUAdam, the
    GPU path's optimizer, would be compiled on first use, minutes on this CPU). DeepSpeed refuses a client
    optimizer under offload unless told."""
    deepspeed_plugin.deepspeed_config["zero_force_ds_cpu_optimizer"] = False


def skip_the_shared_memory_all_reduce() -> None:
    """ZeRO seam, before DeepSpeed sets up its process group: no shared-memory all-reduce op. DeepSpeed's CPU
    accelerator compiles it on first use and takes a lock file for every later load; a rank killed while holding
    it leaves the file, and every DeepSpeed run after waits for it forever. gloo's all-reduce serves instead."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def scale_fp16_losses(accelerator) -> None:
    """fp16 seam, after the Accelerator exists: what Accelerate sets up for fp16 on a GPU, on the CPU. The
    scale starts high enough that the first steps overflow for real, so the skip path runs."""
    import torch

    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
