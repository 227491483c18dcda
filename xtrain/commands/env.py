"""`python -m xtrain.env`: versions, devices, Accelerate settings that could leak in, and what runs here.

What `accelerate env` gives, plus xtrain's own preflight verdict for every strategy and
precision (the same checks that refuse a run before launch).
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

from xtrain.config.schema import Precision, PrecisionConfig, RunConfig, Strategy, strategy_config
from xtrain.core import machine
from xtrain.launch import hardware

PACKAGES = ["torch", "accelerate", "deepspeed", "transformers", "datasets", "hydra-core", "omegaconf", "wandb",
            "tensorboard", "submitit"]


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def devices() -> list[tuple[str, str]]:
    import torch

    matrix = ", matrix units AMX (bf16)" if "amx_bf16" in (machine.cpu_flags() or ()) else ""
    rows = [("cpu", f"{os.cpu_count()} cores, {platform.machine()}, "
                    f"vector units {torch.backends.cpu.get_cpu_capability()}{matrix}"),
            ("memory", f"{machine.ram_bytes() / 1e9:.2f} GB RAM (what a run on the CPU plans against)")]
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        rows.append(("cuda", f"no GPU visible (torch {torch.__version__}, {build})"))
    for i, gpu in enumerate(machine.gpus()):
        rows.append((f"cuda:{i}", f"{gpu.name}, {gpu.memory_bytes / 1e9:.1f} GB, "
                                  f"compute capability {gpu.capability[0]}.{gpu.capability[1]}"))
    return rows


def accelerate_settings() -> list[tuple[str, str]]:
    from accelerate.commands.config.config_args import default_config_file

    leaked = sorted(k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_")))
    return [
        ("default config", default_config_file if os.path.exists(default_config_file) else f"none ({default_config_file})"),
        ("env variables", ", ".join(leaked) if leaked else "none (ACCELERATE_* / FSDP_*)"),
    ]


def can_run() -> list[tuple[str, str]]:
    requests = [(f"strategy={s.value}", RunConfig(strategy=strategy_config(s))) for s in Strategy]
    requests += [(f"precision={p.value}", RunConfig(precision=PrecisionConfig(name=p))) for p in Precision]
    rows = []
    for key, cfg in requests:
        reason = hardware.refusal(cfg)
        slow = "yes, likely slower than fp32: this CPU has no AMX units" if hardware.slow_precision(cfg) else "yes"
        rows.append((key, f"no: {reason.removeprefix(key + ': ')}" if reason else slow))
    gpus = machine.visible_gpus()
    rows.append(("cluster.num_processes", f"auto = {max(1, gpus)} here ({'one per GPU' if gpus else 'no GPU'}); "
                                          "more than 1 on a CPU: DDP over gloo, cores split between processes"))
    return rows


def report() -> str:
    import xtrain

    sections = [
        ("versions", [("python", platform.python_version()), ("xtrain", xtrain.__version__)]
         + [(p, version(p)) for p in PACKAGES]),
        ("devices", devices()),
        ("accelerate", accelerate_settings()),
        ("runs here", can_run()),
    ]
    width = max(len(k) for _, rows in sections for k, _ in rows) + 2
    lines = []
    for title, rows in sections:
        lines.append(title)
        lines += [f"  {key:<{width}}{value}" for key, value in rows]
    return "\n".join(lines)


def main() -> None:
    if {"--help", "-h"} & set(sys.argv[1:]):
        print("usage: python -m xtrain.env\n\nVersions of Python, xtrain, torch and the libraries it uses; the devices found; "
              "leaked ACCELERATE_*/FSDP_* settings; which strategies and precisions this machine can run, and why not.")
        return
    if sys.argv[1:]:
        print(f"xtrain.env: error: {sys.argv[1]}: it takes no arguments (python -m xtrain.env --help)", file=sys.stderr)
        sys.exit(2)
    print(report())


if __name__ == "__main__":
    main()
