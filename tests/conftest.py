"""Shared fixtures: every test runs the real CLI in a subprocess, offline, with a fresh cache per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A short run of the default model and data: a few seconds on a 2-core CPU.
SHORT = ["trainer.max_steps=12", "trainer.warmup_steps=2", "trainer.log_every=4", "trainer.eval_every=6",
         "trainer.save_every=6"]


# Two processes with gradient accumulation: the run every sharded strategy is compared with DDP on.
SHARDED = ["cluster.num_processes=2", "trainer.batch_size=4", "trainer.grad_accum=2", "trainer.max_steps=20",
           "trainer.warmup_steps=4", "trainer.log_every=2", "trainer.eval_every=10", "trainer.save_every=10"]


@pytest.fixture(scope="session", autouse=True)
def isolated_env(tmp_path_factory):
    """No hub access, no stray Accelerate/W&B settings, one tokenizer/data cache for the session."""
    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_", "WANDB_", "HYDRA_")):
            del os.environ[key]
    os.environ.update(
        XTRAIN_CACHE_DIR=str(tmp_path_factory.mktemp("cache")),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_SILENT="true",
    )
    yield


def run_xtrain(*overrides: str, check: bool = True, timeout: float = 600, env: dict | None = None):
    proc = subprocess.run(
        [sys.executable, "-m", "xtrain", *overrides],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"xtrain {' '.join(overrides)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


@pytest.fixture(scope="session")
def short_run(tmp_path_factory) -> Path:
    """One short default-config run shared by the tests that only read its outputs."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    run_xtrain(f"run_dir={run_dir}", *SHORT)
    return run_dir


def train_losses(run_dir: Path) -> list[float]:
    return [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]


@pytest.fixture(scope="session")
def ddp_two_processes(tmp_path_factory) -> Path:
    """The DDP reference for the sharded strategies (`SHARDED`)."""
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    run_xtrain(f"run_dir={run_dir}", "strategy=ddp", *SHARDED)
    return run_dir


SLURM_SCRIPTS = REPO / "tests" / "slurm"


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real 2-node SLURM cluster on this machine (tests/slurm/start_slurm.sh: munge, slurmdbd, slurmctld,
    slurmd n1 and n2), stopped after the session with every daemon it started."""
    if os.geteuid() != 0:
        pytest.fail("the SLURM tests start a cluster's daemons: run the tests as root (CI does)")
    proc = subprocess.run(["bash", str(SLURM_SCRIPTS / "start_slurm.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"the test SLURM cluster did not start:\n{proc.stderr[-3000:]}")
    try:
        yield
    finally:
        subprocess.run(["bash", str(SLURM_SCRIPTS / "stop_slurm.sh")], capture_output=True, text=True)
