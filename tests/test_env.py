"""`python -m xtrain.env`: versions, devices and the preflight verdict for every strategy and precision."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from xtrain import hardware
from xtrain.config import Precision, PrecisionConfig, RunConfig, Strategy, StrategyConfig


def test_env_report():
    out = subprocess.run([sys.executable, "-m", "xtrain.env"], capture_output=True, text=True, check=True).stdout
    rows = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines() if line.startswith("  ")}
    for package in ("torch", "accelerate", "deepspeed", "transformers", "hydra-core"):
        assert rows[package] == metadata.version(package)
    assert rows["python"] == ".".join(map(str, sys.version_info[:3]))
    assert rows["cpu"].startswith(f"{__import__('os').cpu_count()} cores")
    for strategy in Strategy:  # the report says what preflight would say
        reason = hardware.refusal(RunConfig(strategy=StrategyConfig(name=strategy)))
        assert rows[f"strategy={strategy.value}"] == ("yes" if reason is None else f"no: {reason.split(': ', 1)[1]}")
    for precision in Precision:
        reason = hardware.refusal(RunConfig(precision=PrecisionConfig(name=precision)))
        assert rows[f"precision={precision.value}"] == ("yes" if reason is None else f"no: {reason.split(': ', 1)[1]}")
    assert rows["strategy=ddp"] == "yes" and rows["precision=fp32"] == "yes"
