"""trainer.compile on 2 CPU processes (DDP): torch.compile per transformer block, in place. The losses are
eager's up to rounding (measured on this CPU: 2e-8 relative over 20 steps; asserted to 1e-5), parameter names
stay eager's in checkpoints and in model/, and a compiled run resumes exactly. FSDP2 and ZeRO compiled:
test_fsdp_on_cpu.py, test_zero_on_cpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import SHARDED, assert_one_line_error, compose_run, model_weights, read_metrics, read_result, run_xtrain, train_losses, xtrain_in_process

STEP_10 = Path("checkpoints") / "step_00000010"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("compiled") / "run"
    run_xtrain(f"run_dir={run_dir}", "strategy=ddp", *SHARDED, "trainer.compile=true")
    return run_dir


def test_compiled_ddp_trains_eagers_losses_under_eagers_names(compiled, ddp_two_processes):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result = read_result(compiled)
    assert result["status"] == "completed" and result["world_size"] == 2
    # the 4 GPT-2 blocks (one compiled graph, reused), and the modules around them one by one
    assert result["compiled_regions"] >= 4 and "compiled_regions" not in read_result(ddp_two_processes)
    assert train_losses(compiled) == pytest.approx(train_losses(ddp_two_processes), rel=1e-5)
    assert model_weights(compiled).keys() == model_weights(ddp_two_processes).keys()
    for run_dir in (compiled, ddp_two_processes):  # no `_orig_mod.` in a checkpoint's names either
        assert not any("_orig_mod" in name for name in load_file(run_dir / STEP_10 / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(compiled / "model")
    assert model.num_parameters() == result["model_parameters"]


def test_the_steady_rate_leaves_out_the_first_window_where_blocks_compile(compiled):
    """result.json's rate is the logged windows after the first (their tokens over their time); the first, where
    the blocks compile, is far slower; the whole run's rate (start-up, compile and evals in) is beside it."""
    result = read_result(compiled)
    rows = [r for r in read_metrics(compiled) if "train/tokens_per_s" in r]
    seen = [0] + [r["train/tokens_seen"] for r in rows]
    counts = [b - a for a, b in zip(seen, seen[1:])]
    seconds = [n / r["train/tokens_per_s"] for n, r in zip(counts, rows)]
    assert len(rows) == 10 and result["tokens_per_s"] == pytest.approx(sum(counts[1:]) / sum(seconds[1:]), rel=1e-6)
    assert rows[0]["train/tokens_per_s"] < 0.5 * result["tokens_per_s"]
    assert result["tokens_per_s_whole_run"] < 0.5 * result["tokens_per_s"]


def test_a_compiled_run_resumes_exactly(tmp_path, compiled):
    resumed = tmp_path / "run"
    run_xtrain(f"run_dir={resumed}", "strategy=ddp", *SHARDED, "trainer.compile=true", f"resume={compiled / STEP_10}")

    def after_10(run_dir):
        return [(r["step"], r.get("train/loss"), r.get("train/lr"), r.get("val/loss"))
                for r in read_metrics(run_dir) if r["step"] > 10]

    assert after_10(resumed) == after_10(compiled) and len(after_10(resumed)) >= 5
    final, expected = model_weights(resumed), model_weights(compiled)
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name


def test_compile_without_a_kernel_compiler_is_refused_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", "trainer.compile=true", check=False,
                             env={"CXX": "/no/such/g++"})
    assert_one_line_error(proc, "trainer.compile=true", "/no/such/g++", "trainer.compile=false")
    assert not run_dir.exists()


def test_compile_tuning_needs_compile_and_gpus_and_lasts_as_long_as_its_run(tmp_path):
    """Inductor's kernel tuning tunes GPU (Triton) kernels: asked without trainer.compile, or on a machine without a
    GPU, it is refused before anything starts. A run's tuning is a patch of inductor's settings around that run."""
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", "trainer.compile_tuning=true", check=False)
    assert_one_line_error(proc, "trainer.compile_tuning=true", "trainer.compile=true")
    if not torch.cuda.is_available():
        proc = xtrain_in_process(f"run_dir={run_dir}", "trainer.compile=true", "trainer.compile_tuning=true",
                                 check=False)
        assert_one_line_error(proc, "trainer.compile_tuning=true", "no", "trainer.compile_tuning=false")
    assert not run_dir.exists()

    import torch._inductor.config as inductor

    from xtrain.config.trainer import TrainerConfig
    from xtrain.parallel import compiling

    before = {name: getattr(inductor, name) for name in compiling.TUNING}
    with compiling.tuning(TrainerConfig(compile=True, compile_tuning=True)):
        assert {name: getattr(inductor, name) for name in compiling.TUNING} == compiling.TUNING
    with compiling.tuning(TrainerConfig(compile=True)):
        assert {name: getattr(inductor, name) for name in compiling.TUNING} == before
    assert {name: getattr(inductor, name) for name in compiling.TUNING} == before

    from xtrain.config import schema
    from xtrain.engine import resume

    now = schema.to_container(compose_run("trainer.compile=true"))  # a checkpoint from before the setting: resumes
    assert resume.changes({**now, "trainer": {k: v for k, v in now["trainer"].items() if k != "compile_tuning"}},
                          now) == []


def test_the_blocks_share_their_compiled_code_at_any_depth(tmp_path):
    """10 blocks compile as often as 1 (measured: 3 times, for the eval batch, the last eval batch's size and
    training's grad mode). A cache passed through the blocks compiled once per block, and past dynamo's 8 the
    rest ran eager without a word."""
    proc = run_xtrain(f"run_dir={tmp_path / 'run'}", "trainer.compile=true", "model.num_layers=10",
                      "trainer.batch_size=4", "trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.eval_every=2", "trainer.save_every=2",
                      env={"TORCH_LOGS": "recompiles"})
    recompiles = proc.stderr.count("Recompiling function")
    assert 1 <= recompiles <= 3 and "recompile_limit" not in proc.stderr, proc.stderr[-3000:]
