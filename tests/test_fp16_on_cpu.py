"""fp16 with loss scaling through the real trainer, without a GPU.

Users are refused fp16 without CUDA (Accelerate would silently train fp32); the test seam
`XTRAIN_TEST_FP16_ON_CPU=1` sets up on the CPU what Accelerate sets up on a GPU (fp16 autocast,
a gradient scaler), with a scale that overflows the first steps for real: the scaled loss,
unscaling before clipping, skipped steps and the schedule that waits for them all run in CI.
"""

from __future__ import annotations

import pytest
import torch

from conftest import (FP16_ON_CPU, compose_run, read_metrics, read_result, run_xtrain)
from xtrain.engine.optim import lr_factor
from xtrain.launch import hardware

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; on a GPU test_gpu.py covers fp16")


def test_skipped_steps_do_not_advance_the_schedule(tmp_path):
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", "precision=fp16", "trainer.batch_size=4", "trainer.max_steps=14",
               "trainer.warmup_steps=4", "trainer.log_every=1", "trainer.eval_every=14", "trainer.save_every=14",
               env=FP16_ON_CPU)
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["precision"] == "fp16" and result["autocast"] is True
    assert 0 < result["skipped_steps"] < 14  # overflows at the start, then the halved scale fits
    cfg = compose_run("trainer.max_steps=14", "trainer.warmup_steps=4")
    rows = [r for r in read_metrics(run_dir) if "train/lr" in r]
    assert [r["step"] for r in rows] == list(range(1, 15))
    skipped = [r["train/skipped_steps"] for r in rows]
    assert skipped == sorted(skipped) and skipped[-1] == result["skipped_steps"]
    # a step trains at lr_factor(n), n the optimizer steps taken before it: a skipped step is not counted
    for row, skipped_before in zip(rows, [0, *skipped]):
        taken = row["step"] - 1 - skipped_before
        assert row["train/lr"] == pytest.approx(cfg.trainer.lr * lr_factor(taken, cfg.trainer))
    assert result["val_loss"] < result["initial_val_loss"] - 0.3


def test_fp16_on_cpu_is_a_test_seam_only(monkeypatch):
    monkeypatch.delenv("XTRAIN_SEAMS", raising=False)
    assert "precision=fp16: needs a CUDA GPU" in hardware.refusal(compose_run("precision=fp16"))
    monkeypatch.setenv("XTRAIN_SEAMS", FP16_ON_CPU["XTRAIN_SEAMS"])
    assert hardware.refusal(compose_run("precision=fp16")) is None
