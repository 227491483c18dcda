"""Strategies and precisions on a CUDA GPU (skipped without one): they train, resume, agree with DDP, fit the
plan, report MFU and fuse AdamW by default. The module's runs are shared between tests and start together,
AT_ONCE at a time (each is mostly start-up), so `pytest -m gpu -s` takes a few minutes on one GPU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import read_result, run_xtrain, train_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = ["trainer.max_steps=20", "trainer.log_every=5", "trainer.eval_every=10", "trainer.save_every=10",
         "trainer.warmup_steps=2"]
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
WIDER = ["model=tiny_llama", "model.hidden_size=512", "model.num_layers=8", "model.num_heads=8",
         "model.intermediate_size=1376"]  # (bf16 runs: large enough for the memory band below)
COMPILED = ("trainer.compile=true",)
TUNED = (*COMPILED, "trainer.compile_tuning=true")
RUNS = [  # (strategy, precision, *more): the slowest first
    ("ddp", "fp8", *TUNED), ("ddp", "fp8", *COMPILED), *((s, "fp32") for s in STRATEGIES), *((s, "bf16") for s in STRATEGIES),
    ("ddp", "fp16"), ("zero2", "fp16"), ("ddp", "fp8"), ("fsdp", "fp8"),
]
AT_ONCE = 4  # runs sharing the GPU: each is a process of its own, a few hundred MB of the GPU's memory


def train(run_dir, strategy: str, precision: str, *more: str):
    model = WIDER if precision in ("bf16", "fp8") else []
    fp8 = ["precision.fp8_backend=torchao"] if precision == "fp8" else []
    run_xtrain(f"run_dir={run_dir}", f"strategy={strategy}", f"precision={precision}", *fp8, *model, *STEPS, *more,
               own_process=True)  # (not in this process: runs go on in other threads)
    return run_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`trained(strategy, precision, *more)`: the run dir of that run of RUNS; all of them start when the first
    test asks for one."""
    root = tmp_path_factory.mktemp("runs")
    with ThreadPoolExecutor(AT_ONCE) as pool:
        runs = {key: pool.submit(train, root / "_".join(key).replace("=", "-") / "run", *key) for key in RUNS}
        yield lambda *key: runs[key].result()
        for future in runs.values():
            future.cancel()


@pytest.mark.parametrize("strategy,precision", [*((s, "fp32") for s in STRATEGIES), *((s, "bf16") for s in STRATEGIES),
                                                ("ddp", "fp16"), ("zero2", "fp16")])
def test_strategy_trains_resumes_and_saves_a_loadable_model(trained, strategy, precision):
    from transformers import AutoModelForCausalLM

    run_dir = trained(strategy, precision)
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["val_loss"] < result["initial_val_loss"] - 1.0
    assert AutoModelForCausalLM.from_pretrained(run_dir / "model").num_parameters() == result["model_parameters"]
    if precision == "fp32":  # a checkpoint of this strategy resumes
        run_xtrain(f"run_dir={run_dir}", f"strategy={strategy}", f"precision={precision}", "resume=auto",
                   "resume_changes=apply", *STEPS[1:], "trainer.max_steps=25", own_process=True)
        assert read_result(run_dir)["steps"] == 25


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_loss_curve_matches_ddp(trained, strategy):
    """Same seed, fp32: the sharded strategies follow DDP's loss curve within 2 % at every logged step (the first
    20 steps: the resumed 5 are left out)."""
    ours, ddp = train_losses(trained(strategy, "fp32")), train_losses(trained("ddp", "fp32"))
    assert ours[:4] == pytest.approx(ddp[:4], rel=0.02)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_peak_memory_holds_the_estimated_model_states(trained, strategy):
    """The plan counts model states only: the measured peak (states + activations) is at least that."""
    result = read_result(trained(strategy, "bf16"))
    estimate, peaks = result["model_state_bytes_estimate"], result["peak_device_memory_bytes"]
    print(f"{strategy}: estimate {estimate / 1e6:.1f} MB, peak per rank {[round(p / 1e6, 1) for p in peaks]} MB")
    assert len(peaks) == result["world_size"]
    assert all(reserved >= allocated for reserved, allocated in zip(result["peak_device_reserved_bytes"], peaks))
    # states + activations (16 x 128 tokens, 8 layers of 512) + allocator slack: a band, not only a floor
    assert all(0.9 * estimate <= p <= 2 * estimate + 2 * 2**30 for p in peaks)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fp8_with_torchao_follows_bf16(trained, strategy):
    """fp8 matmuls (torchao, tensorwise; under FSDP2 the weights all-gathered in fp8) for every linear layer but the
    output head: the bf16 run's curve within 3 % at every logged step."""
    result = read_result(trained(strategy, "fp8"))
    assert result["status"] == "completed" and result["precision"] == "fp8"
    assert result["fp8"]["scaling"] == "tensorwise" and len(result["fp8"]["layers"]) == 8 * 7
    assert result["fp8"]["kept_in_bf16"] == ["lm_head"]
    assert train_losses(trained(strategy, "fp8")) == pytest.approx(train_losses(trained(strategy, "bf16")), rel=0.03)


def test_fp8_compiled_follows_fp8_eager(trained):
    """torch.compile over torchao's fp8 layers (the benchmark's fastest configuration): eager fp8's curve within 1 %
    at every logged step (on the CPU, torch's vectorised inductor code gets this backward wrong)."""
    compiled = read_result(trained("ddp", "fp8", *COMPILED))
    assert compiled["status"] == "completed" and compiled["compiled_regions"] >= 8
    assert train_losses(trained("ddp", "fp8", *COMPILED)) == pytest.approx(
        train_losses(trained("ddp", "fp8")), rel=0.01)


def test_fp8_compiled_with_kernel_tuning_follows_untuned(trained):
    """trainer.compile_tuning (inductor times its kernels' launch configurations as it compiles): the untuned
    compiled curve within 1 % at every logged step, and run.yaml says what compiled."""
    import yaml

    run_dir = trained("ddp", "fp8", *TUNED)
    assert read_result(run_dir)["status"] == "completed"
    assert yaml.safe_load((run_dir / "run.yaml").read_text())["trainer"]["compile_tuning"] is True
    assert train_losses(run_dir) == pytest.approx(train_losses(trained("ddp", "fp8", *COMPILED)), rel=0.01)


def test_mfu_is_reported_against_the_gpus_dense_peak_and_adamw_is_fused_by_default(trained):
    import yaml

    from xtrain.engine import speed

    run_dir = trained("ddp", "bf16")
    result = read_result(run_dir)
    name = torch.cuda.get_device_name()
    assert result["mfu_peak"]["device"] == name and result["mfu_peak"]["precision"] == "bf16"
    assert result["mfu_peak"]["tflops"] == next(p[0] for k, p in speed.PEAK_TFLOPS.items() if k in name)
    assert 0 < result["mfu"] < 1 and result["flops_per_token"] > 6 * result["model_parameters"]
    assert result["mfu"] == pytest.approx(result["flops_per_token"] * result["tokens_per_s"]
                                          / (result["mfu_peak"]["tflops"] * 1e12), abs=1e-4)  # (4 decimals)
    print(f"ddp bf16: {result['tokens_per_s']:,.0f} tokens/s steady, "
          f"{result['tokens_per_s_whole_run']:,.0f} over the whole run, mfu {result['mfu']:.1%}")
    recorded = yaml.safe_load((run_dir / "run.yaml").read_text())
    assert recorded["trainer"]["fused_optimizer"] is True
    zero = yaml.safe_load((trained("zero2", "bf16") / "run.yaml").read_text())
    assert zero["trainer"]["fused_optimizer"] is False  # DeepSpeed's engine steps it


def test_every_visible_gpu_is_a_rank_over_nccl_in_real_bf16(trained, tmp_path):
    """num_processes=auto (the default): one rank per visible GPU, NCCL between them; bf16 is accepted only where
    the GPU has bf16 units (compute capability >= 8.0), and the facts xtrain reads without a CUDA context agree."""
    from xtrain.core import machine

    facts = machine.gpus()
    assert len(facts) == torch.cuda.device_count()
    assert [g.capability for g in facts] == [torch.cuda.get_device_capability(i) for i in range(len(facts))]
    if min(g.capability for g in facts) < (8, 0):
        proc = run_xtrain(f"run_dir={tmp_path / 'run'}", "precision=bf16", *STEPS, check=False, own_process=True)
        assert proc.returncode == 2 and "precision=bf16" in proc.stderr
        return
    result = read_result(trained("ddp", "bf16"))
    assert result["status"] == "completed" and result["world_size"] == torch.cuda.device_count()
    assert result["autocast"] and result["precision"] == "bf16"
    if result["world_size"] > 1:
        assert result["backend"] == "nccl"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        product = torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
    assert product.dtype == torch.bfloat16
