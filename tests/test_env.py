"""`python -m xtrain.env`: versions, devices and the preflight verdict for every strategy and precision."""

from __future__ import annotations

import sys
from importlib import metadata

from conftest import xtrain_in_process
from xtrain.config.schema import Precision, PrecisionConfig, RunConfig, Strategy, strategy_config
from xtrain.core import machine
from xtrain.launch import hardware


def test_env_report():
    out = xtrain_in_process(command="xtrain.env").stdout
    rows = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines() if line.startswith("  ")}
    for package in ("torch", "accelerate", "deepspeed", "transformers", "hydra-core"):
        assert rows[package] == metadata.version(package)
    assert rows["python"] == ".".join(map(str, sys.version_info[:3]))
    assert rows["cpu"].startswith(f"{__import__('os').cpu_count()} cores")
    assert rows["cpu"].endswith(", matrix units AMX (bf16)") is ("amx_bf16" in (machine.cpu_flags() or ()))
    assert rows["memory"] == f"{machine.ram_bytes() / 1e9:.2f} GB RAM (what a run on the CPU plans against)"
    for strategy in Strategy:  # the report says what preflight would say
        reason = hardware.refusal(RunConfig(strategy=strategy_config(strategy)))
        assert rows[f"strategy={strategy.value}"] == ("yes" if reason is None else f"no: {reason.split(': ', 1)[1]}")
    for precision in Precision:  # (bf16 on a CPU without AMX units: yes, and slower than fp32: tests/test_speed.py)
        cfg = RunConfig(precision=PrecisionConfig(name=precision))
        reason = hardware.refusal(cfg)
        yes = "yes, likely slower than fp32: this CPU has no AMX units" if hardware.slow_precision(cfg) else "yes"
        assert rows[f"precision={precision.value}"] == (yes if reason is None else f"no: {reason.split(': ', 1)[1]}")
    assert rows["strategy=ddp"] == "yes" and rows["precision=fp32"] == "yes"
    typo = xtrain_in_process("--gpus", check=False, command="xtrain.env")
    assert typo.returncode == 2 and typo.stdout == "" and \
        typo.stderr == "xtrain.env: error: --gpus: it takes no arguments (python -m xtrain.env --help)\n"


def test_gpus_without_bf16_or_fp8_units_are_refused_by_their_compute_capability(monkeypatch):
    """torch counts emulated bf16 as supported (V100, T4): xtrain refuses it by compute capability, and fp8
    below 8.9. The facts come from a short subprocess (a parent makes no CUDA context); here they are given."""
    v100, a100, h100 = (machine.Gpu("Tesla V100-SXM2-32GB", (7, 0), 32 << 30),
                        machine.Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 80 << 30),
                        machine.Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80 << 30))
    bf16, fp8 = RunConfig(precision=PrecisionConfig(name=Precision.bf16)), RunConfig(precision=PrecisionConfig(name=Precision.fp8))
    monkeypatch.setattr(machine, "gpus", lambda: (v100,))
    assert hardware.refusal(bf16) == (
        "precision=bf16: Tesla V100-SXM2-32GB (compute capability 7.0) has no bf16 units (needs >= 8.0, e.g. A100, "
        "H100; torch would emulate it, slowly); use precision=fp16 or precision=fp32")
    monkeypatch.setattr(machine, "gpus", lambda: (h100, a100))  # the oldest GPU decides
    assert hardware.refusal(bf16) is None
    assert hardware.refusal(fp8).startswith("precision=fp8: NVIDIA A100-SXM4-80GB (compute capability 8.0) has no FP8 units")
    assert machine.local_gpu_gb() == h100.memory_bytes / 1e9  # the plan's device memory: the first GPU's
