"""Speed as a run reports it: the steady rate beside the whole run's, MFU against a known dense peak (on the CPU
through its test seam; absent, with the reason, where no peak is known), fused AdamW where the run trains on GPUs,
the asked vocabulary, and the log's words. (The steady rate of a compiled run: tests/test_compile.py.)"""

from __future__ import annotations

import pytest
import torch

from conftest import (SHORT, compose_run, read_metrics, read_result, run_xtrain, seams)


def test_mfu_is_the_models_flops_at_the_steady_rate_over_the_peak_and_the_vocabulary_is_the_asked_one(tmp_path,
                                                                                                     short_run):
    """A 16384-token vocabulary asked of a corpus that fills fewer: the model keeps 16384 and the log says how many
    the corpus filled. With a dense peak for the CPU (the test seam), MFU is 6N + 12·L·d·T per token at the
    steady rate over it, in result.json and in every train row."""

    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", "model.vocab_size=16384", *SHORT, env={**seams("timings"), "XTRAIN_TEST_PEAK_TFLOPS": "0.05"})
    out = proc.stdout + proc.stderr
    filled = [line for line in out.splitlines() if "the corpus filled" in line]
    assert len(filled) == 1 and "of the tokenizer's model.vocab_size=16384 tokens; the model keeps 16384" in filled[0]
    import yaml

    result, model = read_result(run_dir), yaml.safe_load((run_dir / "run.yaml").read_text())["model"]
    n, layers, width, block = result["model_parameters"], model["num_layers"], model["hidden_size"], 128
    assert n - read_result(short_run)["model_parameters"] == (16384 - 2048) * width  # (the same run at 2048)
    assert result["flops_per_token"] == 6 * n + 12 * layers * width * block
    assert result["mfu_peak"] == {"device": "cpu", "precision": "fp32", "tflops": 0.05, "source": "seam",
                                  "gpus": 1}
    assert result["mfu"] == pytest.approx(result["flops_per_token"] * result["tokens_per_s"] / 0.05e12, abs=1e-4)
    rows = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert len(rows) == 3 and all(r["train/mfu"] == pytest.approx(result["flops_per_token"] * r["train/tokens_per_s"]
                                                                  / 0.05e12) for r in rows)
    assert " | mfu " in out and "| 1 process |" in out
    assert f"tokens/s steady ({result['tokens_per_s_whole_run']:.0f} over the whole run) | mfu" in out


def test_where_no_peak_is_known_mfu_is_absent_and_says_why(short_run):
    result = read_result(short_run)
    assert result["mfu"] is None and "no dense peak is known for a CPU" in result["mfu_peak"]["unavailable"]
    assert "train/mfu" not in read_metrics(short_run)[-1]
    assert 0 < result["tokens_per_s_whole_run"] < result["tokens_per_s"]


def test_the_data_sheets_peaks_by_device_name_and_precision():
    from xtrain.engine.speed import dense_peak

    assert dense_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == 989.4e12
    assert dense_peak("NVIDIA H100 PCIe", "bf16")[0] == 756e12  # the more specific name first
    assert dense_peak("NVIDIA H200", "fp8")[0] == 1978.9e12
    assert dense_peak("NVIDIA A100-SXM4-80GB", "tf32")[1] == {"device": "NVIDIA A100-SXM4-80GB", "precision": "tf32",
                                                              "tflops": 156.0}
    assert "has no fp8 peak" in dense_peak("NVIDIA A100-SXM4-80GB", "fp8")[1]["unavailable"]
    assert "add it to" in dense_peak("Some Future GPU", "bf16")[1]["unavailable"]


def test_a_models_flops_are_counted_where_no_formula_is_known():
    """Any model: torch's FLOP counter on one batch's forward, × 3 for the backward, per example."""
    from xtrain.engine.speed import counted_flops

    class Task:
        def count(self, batch):
            return batch.shape[0]

        def eval_losses(self, model, batch):
            return model(batch).sum(dim=1), torch.ones(batch.shape[0])

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    assert counted_flops(Task(), model, torch.ones(5, 8)) == 3 * 2 * (8 * 16 + 16 * 4)
    assert model.training  # (counted in eval mode, handed back training)


@pytest.mark.parametrize("overrides,gpus,fused", [
    ([], 1, True),  # DDP on the nodes' GPUs
    (["strategy=fsdp"], 1, True),
    (["strategy=fsdp", "strategy.cpu_offload=true"], 1, False),
    (["strategy=zero2"], 1, False),  # DeepSpeed's engine steps it
    (["trainer.optimizer._target_=torch.optim.SGD"], 1, False),
    ([], 0, False),  # CPUs
    (["trainer.fused_optimizer=false"], 1, False),
    (["trainer.fused_optimizer=true"], 0, True),
])
def test_adamw_is_fused_by_default_where_the_run_trains_on_gpus(overrides, gpus, fused):
    """`auto` resolved for a SLURM job's nodes of `gpus` GPUs each (this machine has none), as run.yaml and the
    plan record it."""
    from dataclasses import replace

    from xtrain.config.cluster import SlurmConfig
    from xtrain.launch import hardware
    from xtrain.launch.plan import optimizer

    here = compose_run(*overrides)  # (resolved for this machine: no GPU)
    asked = "auto" if not any("fused_optimizer" in o for o in overrides) else here.trainer.fused_optimizer
    job = replace(here, trainer=replace(here.trainer, fused_optimizer=asked),
                  cluster=SlurmConfig(num_processes=here.cluster.num_processes, gpus_per_node=str(gpus)))
    cfg = hardware.resolve_fused(job)
    assert cfg.trainer.fused_optimizer is fused
    assert optimizer(cfg) == {True: "AdamW (fused)", False: "AdamW (foreach)"}[fused] or overrides[0].startswith(
        "trainer.optimizer") and optimizer(cfg) == "torch.optim.SGD"


@pytest.mark.parametrize("flags, warned", [({"avx512_bf16"}, True), ({"avx512_bf16", "amx_bf16"}, False)])
def test_bf16_on_a_cpu_without_amx_is_told_it_trains_slower_than_fp32(tmp_path, monkeypatch, flags, warned):
    """One line before anything starts, and the run goes on as asked (here it then stops at its data, in one line,
    as any run with that block size would); a CPU with AMX units, or an fp32 run, is not warned."""
    from conftest import assert_one_line_error, xtrain_in_process
    from xtrain.core import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset(flags))
    for precision in ("bf16", "fp32"):
        proc = xtrain_in_process(f"run_dir={tmp_path / precision}", f"precision={precision}", "data.block_size=100000",
                                 "cluster.check_memory=false", check=False)
        assert_one_line_error(proc, "data.block_size=100000: the corpus yields 1 block(s)")
        lines = [line for line in proc.stdout.splitlines() if "[WARNING] speed:" in line]
        assert len(lines) == (precision == "bf16" and warned)
        if lines:
            assert lines[0].endswith("speed: precision=bf16 on this CPU: it has no AMX units (no amx_bf16 flag), "
                                     "and bf16 autocast on such CPUs trains slower than fp32 (0.57x measured on a "
                                     "Xeon with AVX-512 bf16 instructions); precision=fp32 is likely faster here")
            assert proc.stdout.index("[WARNING] speed:") < proc.stdout.index("data:")


def test_the_gpu_benchmark_runs_its_path_on_the_cpu(tmp_path):
    """`benchmarks/gpu.py --smoke`: xtrain and the HF Trainer, each in a process of its own, train the same model;
    the table, the ratio, the steady rate against the logged windows and where a step's time goes, per kind of
    kernel (on a CPU: its operators), all come out."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "bench.md"
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--steps", "20", "--out", str(out),
                           "--only", "xtrain defaults,HF Trainer defaults"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {row["name"]: row for row in map(json.loads, [line for line in proc.stdout.splitlines() if line[:1] == "{"])}
    assert set(rows) == {"xtrain defaults", "HF Trainer defaults"}
    ours, theirs = rows["xtrain defaults"], rows["HF Trainer defaults"]
    assert ours["parameters"] == theirs["parameters"] > 0 and ours["tokens_per_s"] > 0 and theirs["tokens_per_s"] > 0
    assert len(ours["windows"]) == 3  # steps 6-10, 11-15, 16-20: the first window (start-up, profiled) left out
    profile = ours["profile"]
    assert profile["kinds_ms"]["bf16/fp32 matmul"] > 0 and sum(profile["kinds_ms"].values()) == pytest.approx(
        profile["kernels_ms"])
    text = out.read_text()
    assert text.count("| xtrain defaults |") == 2 and "| HF Trainer defaults |" in text and "failed" not in text
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    assert f"- every run trains the same model: {ours['parameters']:,} parameters" in text
    assert f"- xtrain defaults / HF Trainer defaults: {ratio:.2f}x" in text
    assert "- xtrain defaults: result.json's steady rate / median of its windows after the first: " in text
