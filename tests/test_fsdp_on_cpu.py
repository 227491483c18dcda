"""FSDP through the real trainer, without a GPU: FSDP2 over gloo on 2 CPU processes.

Users are refused FSDP without CUDA (Accelerate would silently train DDP); the test seam
`tests/seams/fsdp_on_cpu.py` presents the CPU process group to Accelerate as an accelerator
group, so the FSDP paths (wrapping, mixed precision, sharded and full checkpoints, resume,
the gathered final model) run in CI. Only the device, the backend and pinned memory for
cpu_offload differ from a GPU run.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import (FSDP_ON_CPU, SHARDED, SMALL, assert_one_line_error, compose_run, model_weights, read_metrics,
                      read_result, run_xtrain, start_xtrain, train_losses, xtrain_in_process)
from xtrain.launch import hardware

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; on a GPU test_gpu.py covers FSDP")

FINAL = Path("checkpoints") / "step_00000020"


def after_10(run_dir: Path) -> list[tuple]:
    """The rows a resume from step 10 repeats: losses and lr (not timings)."""
    return [(r["step"], r.get("train/loss"), r.get("train/lr"), r.get("val/loss"))
            for r in read_metrics(run_dir) if r["step"] > 10]


def fsdp_run(run_dir: Path, *overrides: str) -> Path:
    run_xtrain(f"run_dir={run_dir}", "strategy=fsdp", *SHARDED, *overrides, env=FSDP_ON_CPU)
    return run_dir


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return fsdp_run(tmp_path_factory.mktemp("fsdp") / "run")


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    return fsdp_run(tmp_path_factory.mktemp("fsdp_full") / "run", "strategy.state_dict_type=full")


def test_fsdp2_follows_ddp(sharded, ddp_two_processes):
    """Same seed, fp32, gradient accumulation: FSDP2's curve is DDP's (measured: 3e-7 relative)."""
    result = read_result(sharded)
    assert result["status"] == "completed" and result["world_size"] == 2
    assert result["model_parameters"] == read_result(ddp_two_processes)["model_parameters"]  # not a local shard
    assert result["fsdp_units"]["GPT2Block"] == 4  # the wrap layer from GPT-2's _no_split_modules
    assert result["backend"] == "gloo"
    for key in ("peak_rss_bytes", "peak_rss_model_ready_bytes"):  # each rank's own
        assert len(result[key]) == 2 and all(100 * 2**20 < peak < 8 * 2**30 for peak in result[key]), key
    assert all(a <= b for a, b in zip(result["peak_rss_model_ready_bytes"], result["peak_rss_bytes"]))
    assert train_losses(sharded) == pytest.approx(train_losses(ddp_two_processes), rel=1e-4)


def test_fsdp2_bf16_follows_ddp_bf16(tmp_path):
    """FSDP's mixed-precision policy (bf16 compute) against DDP's bf16 autocast, on `SMALL` (bf16 on a CPU without
    bf16 units is ~8x fp32's time a step on the default model): measured 7e-4 apart on the default model on a CPU
    with bf16 units, 4.9e-3 at one step (the others under 3e-3) on an AMD EPYC without them."""
    ddp = tmp_path / "ddp"
    run_xtrain(f"run_dir={ddp}", "strategy=ddp", "precision=bf16", *SHARDED, *SMALL)
    fsdp = fsdp_run(tmp_path / "fsdp", "precision=bf16", *SMALL)
    result = read_result(fsdp)
    assert result["precision"] == "bf16" and result["autocast"] is True and result["steps"] == 20
    assert result["fsdp_units"]["GPT2Block"] == 1
    assert result["val_loss"] < result["initial_val_loss"] - 0.3
    assert train_losses(fsdp) == pytest.approx(train_losses(ddp), rel=1e-2)


def test_llama_wraps_its_decoder_layer(tmp_path):
    result = read_result(fsdp_run(tmp_path / "run", "model=tiny_llama"))
    assert result["fsdp_units"]["LlamaDecoderLayer"] == 4 and "GPT2Block" not in result["fsdp_units"]
    assert result["val_loss"] < result["initial_val_loss"] - 0.5


def test_a_wrong_wrap_layer_is_one_line_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", "strategy=fsdp", "strategy.wrap_layer=LlamaDecoderLayer", *SHARDED,
                             check=False, env=FSDP_ON_CPU)
    assert_one_line_error(proc, "strategy.wrap_layer=LlamaDecoderLayer: no such layer in GPT2LMHeadModel",
                          "choose one of", "GPT2Block")
    assert not run_dir.exists()


def test_sharded_checkpoints_hold_one_shard_per_rank_and_full_ones_a_gathered_state(sharded, full):
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (sharded / FINAL / part).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (sharded / FINAL / "pytorch_model_fsdp.bin").exists()
    # full: one gathered file, every tensor at its full shape: the final model's weights
    gathered = torch.load(full / FINAL / "pytorch_model_fsdp.bin", weights_only=True)
    final = model_weights(full)
    assert final.keys() <= gathered.keys()
    for name, tensor in final.items():
        assert torch.equal(gathered[name], tensor), name
    assert (full / FINAL / "optimizer.bin").is_file() and not (full / FINAL / "pytorch_model_fsdp_0").exists()


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_resume_from_step_10_repeats_the_unbroken_run_exactly(request, tmp_path, kind):
    unbroken = request.getfixturevalue(kind)
    checkpoint = unbroken / "checkpoints" / "step_00000010"
    resumed = fsdp_run(tmp_path / "run", f"strategy.state_dict_type={kind}", f"resume={checkpoint}")
    assert read_result(resumed)["resumed_from"] == str(checkpoint)

    assert after_10(resumed) == after_10(unbroken)
    final, expected = model_weights(resumed), model_weights(unbroken)
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name


def test_model_dir_is_what_accelerate_merges_from_the_last_sharded_checkpoint(tmp_path, sharded):
    from transformers import AutoModelForCausalLM

    merged = tmp_path / "merged"
    accelerate = Path(sys.executable).parent / "accelerate"
    subprocess.run([str(accelerate), "merge-weights", str(sharded / FINAL / "pytorch_model_fsdp_0"), str(merged)],
                   check=True, capture_output=True, timeout=300)
    from safetensors.torch import load_file

    consolidated, final = load_file(merged / "model.safetensors"), model_weights(sharded)
    assert consolidated.keys() == final.keys()
    for name, tensor in final.items():
        assert torch.equal(consolidated[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(sharded / "model")
    assert model.num_parameters() == read_result(sharded)["model_parameters"]


def test_activation_checkpointing_recomputes_the_same_losses(tmp_path, sharded):
    run_dir = fsdp_run(tmp_path / "run", "strategy.activation_checkpointing=true")
    assert read_result(run_dir)["fsdp_units"]["activation_checkpointed"] == 4
    assert "activation_checkpointed" not in read_result(sharded)["fsdp_units"]
    assert train_losses(run_dir) == pytest.approx(train_losses(sharded), rel=1e-6)  # measured: identical


def test_compiled_fsdp2_with_activation_checkpointing_follows_eager_and_resumes_exactly(tmp_path, sharded):
    """Checkpointing, then compile, then `fully_shard` (on the meta-built model, as Accelerate orders them):
    eager's losses up to rounding (measured 3e-8 relative), eager's names, and a resume that repeats the run."""
    compiled = fsdp_run(tmp_path / "compiled", "strategy.activation_checkpointing=true", "trainer.compile=true")
    result = read_result(compiled)
    assert result["compiled_regions"] >= 4 and result["fsdp_units"]["activation_checkpointed"] == 4
    assert train_losses(compiled) == pytest.approx(train_losses(sharded), rel=1e-5)
    assert model_weights(compiled).keys() == model_weights(sharded).keys()
    resumed = fsdp_run(tmp_path / "resumed", "strategy.activation_checkpointing=true", "trainer.compile=true",
                       f"resume={compiled / 'checkpoints' / 'step_00000010'}")
    assert after_10(resumed) == after_10(compiled) and after_10(compiled)
    for name, tensor in model_weights(compiled).items():
        assert torch.equal(model_weights(resumed)[name], tensor), name


def test_cpu_ram_efficient_loading_fine_tunes_from_the_pretrained_weights(tmp_path, sharded):
    """Rank 0 loads the local pretrained model, the other rank receives it: the first eval is the source's last."""
    run_dir = fsdp_run(tmp_path / "run", "model=hf", f"model.name_or_path={sharded / 'model'}",
                       "strategy.cpu_ram_efficient_loading=true", "trainer.max_steps=4", "trainer.eval_every=4",
                       "trainer.save_every=4", "trainer.warmup_steps=1")
    result = read_result(run_dir)
    assert result["fsdp_units"]["GPT2Block"] == 4  # detected from the loaded model's _no_split_modules
    assert result["initial_val_loss"] == pytest.approx(read_result(sharded)["val_loss"], rel=1e-5)


def test_one_process_fsdp_with_cpu_offload_runs_under_the_launcher_and_matches_ddp(tmp_path, ddp_two_processes):
    """In-process Accelerate would drop FSDP; under torchrun, check_setup sees FSDP on one process. Its parameters,
    gradients and optimizer state offloaded to the host (Accelerate's `fsdp_offload_params`)."""
    run_dir = fsdp_run(tmp_path / "run", "cluster.num_processes=1", "trainer.batch_size=8", "strategy.cpu_offload=true")
    result = read_result(run_dir)
    assert result["world_size"] == 1 and result["fsdp_units"]["GPT2Block"] == 4
    assert yaml.safe_load((run_dir / "accelerate_config.yaml").read_text())["fsdp_config"]["fsdp_offload_params"] is True
    assert (run_dir / "logs" / "launcher-node0.log").exists()
    assert train_losses(run_dir) == pytest.approx(train_losses(ddp_two_processes), rel=1e-4)


def test_fsdp1_cannot_run_on_a_cpu(tmp_path):
    """torch's FSDP1 computes on an accelerator only: the docs (Strategies and precision) state this error. (With the default
    cpu_ram_efficient_loading=true Accelerate's plugin fails earlier: no device for sync_module_states.)"""
    proc = run_xtrain(f"run_dir={tmp_path / 'run'}", "strategy=fsdp", "strategy.fsdp_version=1",
                      "strategy.cpu_ram_efficient_loading=false", *SHARDED, check=False, env=FSDP_ON_CPU)
    assert proc.returncode == 1  # whichever rank reaches the wrapping first is the one reported
    assert re.search(r"rank (\d) failed: ValueError: Inconsistent compute device and `device_id` on rank \1: "
                     r"cpu vs cpu:\d", proc.stderr), proc.stderr[-2000:]  # (the device index Accelerate gives varies)


def test_fsdp_on_cpu_is_a_test_seam_only(monkeypatch):
    monkeypatch.delenv("XTRAIN_SEAMS", raising=False)
    assert "FSDP needs CUDA GPUs" in hardware.refusal(compose_run("strategy=fsdp"))
    monkeypatch.setenv("XTRAIN_SEAMS", FSDP_ON_CPU["XTRAIN_SEAMS"])
    assert hardware.refusal(compose_run("strategy=fsdp")) is None
    assert "DeepSpeed ZeRO needs CUDA GPUs" in hardware.refusal(compose_run("strategy=zero2"))
    assert "precision=fp16" in hardware.refusal(compose_run("strategy=fsdp", "precision=fp16"))


BIG = ["model=tiny_llama", "model.hidden_size=1024", "model.num_layers=24", "model.num_heads=16",
       "model.intermediate_size=2816"]  # 303 M parameters: 1.21 GB in fp32
ONE_STEP = ["cluster.num_processes=2", "trainer.batch_size=1", "trainer.max_steps=1", "trainer.warmup_steps=0",
            "trainer.eval_every=1", "trainer.save_every=1", "data.block_size=64", "data.max_val_tokens=128"]


def model_ready(run_dir: Path, *overrides: str) -> dict:
    """result.json as the run starts (its model built, sharded, placed: `peak_rss_model_ready_bytes`), as read then;
    the run is then killed: what comes after (a step, a checkpoint and an export of the whole model, and the
    workers recording that their driver was killed) is not what is measured."""
    proc = start_xtrain(f"run_dir={run_dir}", "strategy=fsdp", *ONE_STEP, *overrides, env=FSDP_ON_CPU, quiet=True)
    deadline = time.monotonic() + 300
    started = {}
    while "peak_rss_model_ready_bytes" not in started:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its model was ready"
        time.sleep(0.1)
        started = read_result(run_dir) if (run_dir / "result.json").exists() else {}
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return started


def test_a_config_built_model_never_exists_whole_on_a_rank(tmp_path):
    """FSDP2 of a 303 M-parameter model built from config: built on meta, each rank's shards filled from the
    eager build's values. Each rank's peak RSS until the model is ready (built, sharded, placed; before any eval
    or step) is at most its baseline (the same run of a 1 M model) + 0.6 x the full fp32 model: its half and the
    one parameter being filled. The eager build held the whole model on every rank."""
    result = model_ready(tmp_path / "big", *BIG)
    baseline = model_ready(tmp_path / "small", "model=tiny_llama")
    full = 4 * result["model_parameters"]
    assert result["status"] == "running" and full > 1.2e9
    peaks, floors = result["peak_rss_model_ready_bytes"], baseline["peak_rss_model_ready_bytes"]
    print(f"full fp32 model {full / 2**20:.0f} MB; peak RSS until the model is ready, per rank: 303 M model "
          f"{[p // 2**20 for p in peaks]} MB, 1 M model {[p // 2**20 for p in floors]} MB")
    assert all(peak <= floor + 0.6 * full for peak, floor in zip(peaks, floors))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_meta_build_replays_the_eager_builds_weights_bitwise(arch):
    """meta_init.build: every tensor built on meta gets, when replayed, the eager build's value for the same seed,
    bitwise, and the global generator ends where the eager build leaves it (dropout draws the same masks)."""
    from transformers import AutoModelForCausalLM

    from xtrain.parallel import meta_init
    from xtrain.tasks.causal_lm import model as models

    cfg = compose_run(f"model=tiny_{arch}", "model.hidden_size=256", "model.intermediate_size=688").model
    hf_config = models.transformers_config(cfg, cfg.vocab_size, 128, eos_token_id=0)
    torch.manual_seed(3)
    eager = AutoModelForCausalLM.from_config(hf_config)
    after_eager = torch.rand(4)
    torch.manual_seed(3)
    lazy = meta_init.build(lambda: AutoModelForCausalLM.from_config(hf_config))
    assert torch.equal(torch.rand(4), after_eager)
    recorder = meta_init._built[lazy]
    on_meta = [name for name, p in lazy.named_parameters() if p.is_meta]
    assert len(on_meta) >= 4 * cfg.num_layers  # every matrix: attention and MLP weights, the embedding
    built = {**dict(lazy.named_parameters(remove_duplicate=False)), **dict(lazy.named_buffers())}
    for name, want in eager.state_dict().items():
        assert torch.equal(recorder.value(built[name]) if built[name].is_meta else built[name], want), name
    # materialized on a device (a GPU's path, here the CPU): the eager build's tensors, tied as it ties them
    placed = meta_init.materialize(lazy, torch.device("cpu"))
    assert not meta_init.is_lazy(placed) and placed.state_dict().keys() == eager.state_dict().keys()
    for name, want in eager.state_dict().items():
        assert torch.equal(placed.state_dict()[name], want), name
    assert placed.get_output_embeddings().weight is placed.get_input_embeddings().weight
