"""fp8 with torchao on the CPU: Accelerate converts the layers and autocasts as on a GPU; torch's CPU `_scaled_mm`
runs the fp8 matmuls (as slowly as any CPU fp8: a check of the path, not of its speed)."""

from __future__ import annotations

import torch


def _applies(cfg) -> bool:
    return (cfg.precision.name.value == "fp8" and cfg.precision.fp8_backend.value == "torchao"
            and not torch.cuda.is_available())


class Fp8OnCpu:
    def runs_on_cpu(self, what: str, cfg) -> bool | None:
        return True if what == "fp8" and _applies(cfg) else None

    def before_accelerator(self, cfg, kwargs: dict, setup: dict) -> None:
        if _applies(cfg):
            emulate_fp8_matmuls()
            if cfg.trainer.compile:
                compile_without_cpu_vectors()


def emulate_fp8_matmuls() -> None:
    """torch's CPU `_scaled_mm` upcasts and multiplies (exact for fp8 inputs), not oneDNN's. On a CPU with AMX units
    torch hands fp8 matmuls to oneDNN, which has only its reference kernel for them: measured 2 s for one
    512 x 128 x 512 matmul, about 1,000x the upcast (a 10-step run of the seam's model took over 10 minutes)."""
    torch.backends.mkldnn.enabled = False


def compile_without_cpu_vectors() -> None:
    """With trainer.compile: inductor's C++ code for the CPU without SIMD vectors. With them, torch 2.13 miscompiles
    torchao's backward (weight gradients of layers that share an input read uninitialised memory: NaN at the first
    step). Without torchao, `torch.compile(g)(torch.randn(128, 128, dtype=torch.bfloat16))` differs from `g`'s for
    `def g(w): a, b = w.t().float(), w.t().float(); return a.t().contiguous(), b.t().contiguous()`. GPUs compile
    through Triton, not this code."""
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 1


SEAM = Fp8OnCpu()
