"""Strategies and precisions on a CUDA GPU (skipped without one): they train, agree with DDP, and fit the plan."""

from __future__ import annotations

import pytest
import torch

from conftest import read_result, run_xtrain, train_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = ["trainer.max_steps=40", "trainer.log_every=5", "trainer.eval_every=20", "trainer.save_every=20",
         "trainer.warmup_steps=5"]
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]


@pytest.fixture(scope="module")
def ddp_fp32(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    run_xtrain(f"run_dir={run_dir}", "strategy=ddp", "precision=fp32", *STEPS)
    return run_dir


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_strategy_trains_and_saves_a_loadable_model(tmp_path, strategy, precision):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", f"strategy={strategy}", f"precision={precision}", *STEPS)
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["val_loss"] < result["initial_val_loss"] - 1.0
    assert AutoModelForCausalLM.from_pretrained(run_dir / "model").num_parameters() == result["model_parameters"]
    # a checkpoint of this strategy resumes
    run_xtrain(f"run_dir={run_dir}", f"strategy={strategy}", f"precision={precision}", "resume=auto",
               *STEPS[1:], "trainer.max_steps=45")
    assert read_result(run_dir)["steps"] == 45


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_loss_curve_matches_ddp(tmp_path, ddp_fp32, strategy):
    """Same seed, fp32: the sharded strategies follow DDP's loss curve within 2 % at every logged step."""
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", f"strategy={strategy}", "precision=fp32", *STEPS)
    assert train_losses(run_dir) == pytest.approx(train_losses(ddp_fp32), rel=0.02)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_peak_memory_holds_the_estimated_model_states(tmp_path, strategy):
    """The plan counts model states only: the measured peak (states + activations) is at least that."""
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", f"strategy={strategy}", "precision=bf16", "model=tiny_llama",
               "model.hidden_size=512", "model.num_layers=8", "model.num_heads=8", "model.intermediate_size=1376",
               *STEPS)
    result = read_result(run_dir)
    estimate, peaks = result["model_state_bytes_estimate"], result["peak_device_memory_bytes"]
    print(f"{strategy}: estimate {estimate / 1e6:.1f} MB, peak per rank {[round(p / 1e6, 1) for p in peaks]} MB")
    assert len(peaks) == result["world_size"]
    assert all(reserved >= allocated for reserved, allocated in zip(result["peak_device_reserved_bytes"], peaks))
    # states + activations (16 x 128 tokens, 8 layers of 512) + allocator slack: a band, not only a floor
    assert all(0.9 * estimate <= p <= 2 * estimate + 2 * 2**30 for p in peaks)


def test_every_visible_gpu_is_a_rank_over_nccl_in_real_bf16(tmp_path):
    """num_processes=auto: one rank per visible GPU, NCCL between them; bf16 is accepted only where the GPU
    has bf16 units (compute capability >= 8.0), and the facts xtrain reads without a CUDA context agree."""
    from xtrain.core import machine

    facts = machine.gpus()
    assert len(facts) == torch.cuda.device_count()
    assert [g.capability for g in facts] == [torch.cuda.get_device_capability(i) for i in range(len(facts))]
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", "precision=bf16", "cluster.num_processes=auto", *STEPS, check=False)
    if min(g.capability for g in facts) < (8, 0):
        assert proc.returncode == 2 and "precision=bf16" in proc.stderr
        return
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["world_size"] == torch.cuda.device_count()
    assert result["autocast"] and result["precision"] == "bf16"
    if result["world_size"] > 1:
        assert result["backend"] == "nccl"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        product = torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
    assert product.dtype == torch.bfloat16
