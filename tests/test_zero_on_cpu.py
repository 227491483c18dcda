"""ZeRO-1/2/3 through the real trainer, without a GPU: DeepSpeed's own CPU accelerator over gloo.

Users are refused ZeRO without CUDA (Accelerate does not support it); the test seam
`tests/seams/zero_on_cpu.py` lifts that refusal so the DeepSpeed paths (engine, sharded
checkpoints, resume, the gathered final model) run in CI. Only the device and the process
group backend differ from a GPU run.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import (SHARDED as RUN, SMALL, ZERO_ON_CPU, assert_one_line_error, compose_run, read_metrics, read_result,
                      run_xtrain, train_losses, xtrain_in_process)
from xtrain.core import machine
from xtrain.parallel import plugins
from xtrain.parallel.zero import deepspeed_config
from xtrain.launch import hardware

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; on a GPU test_gpu.py covers ZeRO")

# RUN has gradient accumulation: DeepSpeed accumulates itself, in step with Accelerate's
# zero.Init draws ZeRO-3's initial weights in another order (same distributions, other values)
# ZeRO-3 gathers and reduce-scatters in a different order than DDP: measured up to 1.3% apart by step 7
TOLERANCE = {"zero1": 1e-4, "zero2": 1e-4, "zero3": 2e-2}


def zero_run(run_dir: Path, strategy: str, *overrides: str) -> Path:
    run_xtrain(f"run_dir={run_dir}", f"strategy={strategy}", *RUN, *overrides, env=ZERO_ON_CPU)
    return run_dir


def stale_extension_lock(root: Path) -> Path:
    """What a rank killed while loading DeepSpeed's shared-memory op leaves in torch's extensions dir: a lock
    file that torch waits on, forever, in every later load."""
    lock = root / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    return lock


@pytest.fixture(scope="module")
def ddp(ddp_two_processes) -> Path:
    return ddp_two_processes


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """`zero_runs(strategy)`: that strategy's run of RUN, made once for the module whichever tests ask for it."""

    @functools.cache
    def run(strategy: str) -> Path:
        root = tmp_path_factory.mktemp(strategy)
        stale_extension_lock(root / "torch_extensions")
        run_xtrain(f"run_dir={root / 'run'}", f"strategy={strategy}", *RUN,
                   env={**ZERO_ON_CPU, "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions")})
        return root / "run"

    return run


@pytest.fixture(params=["zero1", "zero2", "zero3"])
def zero(request, zero_runs) -> tuple[str, Path]:
    return request.param, zero_runs(request.param)


def test_zero_follows_ddp(zero, ddp):
    strategy, run_dir = zero
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["world_size"] == 2
    assert (run_dir.parent / "torch_extensions" / "deepspeed_shm_comm" / "lock").exists()  # not waited on, kept
    assert result["model_parameters"] == read_result(ddp)["model_parameters"]  # not ZeRO-3's empty local shards
    assert train_losses(run_dir) == pytest.approx(train_losses(ddp), rel=TOLERANCE[strategy])
    assert result["val_loss"] < result["initial_val_loss"] - 0.5


def test_zero_checkpoints_are_sharded_and_model_is_the_full_final_weights(zero):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    strategy, run_dir = zero
    final = run_dir / "checkpoints" / "step_00000020"
    shards = sorted(p.name for p in (final / "pytorch_model").glob("*optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    # DeepSpeed's own tool puts the shards back together; model/ holds exactly those weights
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(final))
    saved = load_file(run_dir / "model" / "model.safetensors")
    assert saved.keys() <= consolidated.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, consolidated[name]), name
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert model.num_parameters() == read_result(run_dir)["model_parameters"]


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])  # zero1 saves and loads as zero2 does
def test_zero_resume_continues_exactly(tmp_path, zero_runs, strategy):
    """From the step-10 checkpoint into a fresh run dir: steps 11-20 repeat the unbroken run exactly."""
    unbroken = zero_runs(strategy)
    resumed = zero_run(tmp_path / "run", strategy, f"resume={unbroken / 'checkpoints' / 'step_00000010'}")
    assert read_result(resumed)["resumed_from"] == str(unbroken / "checkpoints" / "step_00000010")

    def after_10(run_dir):
        return [(r["step"], r.get("train/loss"), r.get("train/lr"), r.get("val/loss"))
                for r in read_metrics(run_dir) if r["step"] > 10]

    assert after_10(resumed) == after_10(unbroken)


def test_a_zero3_resume_applies_a_new_lr_and_weight_decay(tmp_path, zero_runs):
    """resume_changes=apply under ZeRO-3, whose optimizer holds no parameters between steps: the matrices' group
    takes the new weight decay, the other keeps none, and step 12 trains at the new schedule's lr."""
    from xtrain.engine.optim import lr_factor

    unbroken = zero_runs("zero3")
    changed = [*(a for a in RUN if "max_steps" not in a), "trainer.lr=0.004", "trainer.weight_decay=0.05",
               "trainer.max_steps=12"]
    run_xtrain(f"run_dir={tmp_path / 'run'}", "strategy=zero3", *changed,
               f"resume={unbroken / 'checkpoints' / 'step_00000010'}", "resume_changes=apply", env=ZERO_ON_CPU)
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step_00000012" / "pytorch_model"
                       / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)["optimizer_state_dict"]
    assert [g["weight_decay"] for g in saved["optimizer_state_dict"]["param_groups"]] == [0.05, 0.0]
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(tmp_path / "run") if "train/lr" in r}
    assert lrs[12] == pytest.approx(0.004 * lr_factor(11, compose_run(*changed).trainer), rel=1e-6)


def test_a_zero3_checkpoint_continues_under_ddp_and_exports_the_runs_model(tmp_path, zero_runs):
    """DeepSpeed's universal checkpoint, read whole: ZeRO-3 on 2 processes continues on 1 under DDP (grad_accum 2 ->
    4 keeps the effective batch) along the unbroken ZeRO-3 run; its last checkpoint exports to the run's model/."""
    from transformers import AutoModelForCausalLM

    from xtrain.commands.export import main

    unbroken = zero_runs("zero3")
    run_dir = tmp_path / "run"
    shutil.copytree(unbroken, run_dir, ignore=shutil.ignore_patterns("step_00000020"))
    one = [arg for arg in RUN if not arg.startswith("cluster.num_processes=")]
    run_xtrain(f"run_dir={run_dir}", "strategy=ddp", *one, "resume=auto")
    result = read_result(run_dir)
    assert result["restarts"][-1]["moved"] == {"world": [2, 1], "strategy": ["zero3", "ddp"], "grad_accum": [2, 4]}
    after = {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r and r["step"] > 10}
    expected = {r["step"]: r["train/loss"] for r in read_metrics(unbroken) if "train/loss" in r and r["step"] > 10}
    assert after == pytest.approx(expected, rel=1e-5)  # measured 7e-8
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000010", "step_00000020"]

    main([str(unbroken), f"out={tmp_path / 'exported'}"])
    ids = torch.arange(128).reshape(2, 64)
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")(ids).logits
        final = AutoModelForCausalLM.from_pretrained(unbroken / "model")(ids).logits
    torch.testing.assert_close(exported, final, rtol=0, atol=1e-5)


def test_compiled_zero3_follows_eager_under_eagers_names(tmp_path, zero_runs):
    """Accelerate compiles the engine's module in place (measured: 1e-6 relative to eager ZeRO-3)."""
    from safetensors.torch import load_file

    eager = zero_runs("zero3")
    compiled = zero_run(tmp_path / "run", "zero3", "trainer.compile=true")
    assert read_result(compiled)["compiled_regions"] >= 4
    assert train_losses(compiled) == pytest.approx(train_losses(eager), rel=1e-5)
    assert load_file(compiled / "model" / "model.safetensors").keys() == load_file(eager / "model" / "model.safetensors").keys()


def test_one_process_zero2_with_optimizer_offload_runs_under_the_launcher_and_matches_ddp(tmp_path, ddp):
    """World size 1 still goes through torchrun: in-process, Accelerate would not set DeepSpeed up. One process with
    twice the batch sees the same samples per step as two processes' DDP. ZeRO-Offload with torch's AdamW stepping
    on the host copy (the seam sets zero_force_ds_cpu_optimizer off; the exported deepspeed.json, the GPU path's,
    leaves DeepSpeed's default: its DeepSpeedCPUAdam)."""
    run_dir = zero_run(tmp_path / "run", "zero2", "cluster.num_processes=1", "trainer.batch_size=8",
                       "strategy.offload_optimizer=cpu")
    assert read_result(run_dir)["world_size"] == 1 and (run_dir / "logs" / "launcher-node0.log").exists()
    assert json.loads((run_dir / "deepspeed.json").read_text())["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert train_losses(run_dir) == pytest.approx(train_losses(ddp), rel=1e-4)


def test_zero3_bf16_with_parameter_and_optimizer_offload(tmp_path):
    """On `SMALL` (bf16 on a CPU without bf16 units is ~8x fp32's time a step on the default model), against one
    fp32 process on the same effective batch."""
    run_dir = zero_run(tmp_path / "run", "zero3", "precision=bf16", "strategy.offload_optimizer=cpu",
                       "strategy.offload_param=cpu", *SMALL)
    ds = json.loads((run_dir / "deepspeed.json").read_text())
    assert ds["bf16"] == {"enabled": True} and ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    one = tmp_path / "one"
    run_xtrain(f"run_dir={one}", *RUN, *SMALL, "cluster.num_processes=1", "trainer.batch_size=8")
    result = read_result(run_dir)
    assert result["precision"] == "bf16" and result["world_size"] == 2
    assert result["val_loss"] < result["initial_val_loss"] - 0.3
    assert result["val_loss"] == pytest.approx(read_result(one)["val_loss"], rel=0.02)


def test_zero_on_cpu_is_a_test_seam_only(monkeypatch):
    monkeypatch.delenv("XTRAIN_SEAMS", raising=False)
    assert "needs CUDA GPUs" in hardware.refusal(compose_run("strategy=zero2"))
    monkeypatch.setenv("XTRAIN_SEAMS", ZERO_ON_CPU["XTRAIN_SEAMS"])
    assert hardware.refusal(compose_run("strategy=zero2")) is None
    assert "FSDP needs CUDA GPUs" in hardware.refusal(compose_run("strategy=fsdp"))
    assert "precision=fp16" in hardware.refusal(compose_run("strategy=zero2", "precision=fp16"))


def test_nvme_offload_runs_or_is_refused_before_launch(tmp_path):
    """ZeRO-Infinity needs DeepSpeed's async_io op: where it cannot be built, refuse before anything starts."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    run_dir = tmp_path / "run"
    overrides = ["strategy.offload_optimizer=nvme", "strategy.offload_param=nvme", f"strategy.nvme_path={nvme}"]
    if machine.async_io_available():
        zero_run(run_dir, "zero3", *overrides)
        result = read_result(run_dir)
        assert result["status"] == "completed" and result["val_loss"] < result["initial_val_loss"] - 0.5
        assert any(nvme.rglob("*.swp")), "nothing was swapped to the NVMe path"
    else:
        proc = xtrain_in_process(f"run_dir={run_dir}", "strategy=zero3", *RUN, *overrides, check=False, env=ZERO_ON_CPU)
        assert_one_line_error(proc, "strategy.offload_optimizer=nvme: DeepSpeed's async_io op cannot be built here",
                              "apt-get install libaio-dev", "offload to cpu")
        assert not run_dir.exists()


def test_zero3_fine_tunes_a_local_pretrained_model_from_its_weights(tmp_path, short_run):
    """from_pretrained under zero.Init loads every shard: the first eval equals the source run's last."""
    run_dir = zero_run(tmp_path / "run", "zero3", "model=hf", f"model.name_or_path={short_run / 'model'}",
                       "trainer.max_steps=4", "trainer.eval_every=4", "trainer.save_every=4", "trainer.warmup_steps=1")
    assert read_result(run_dir)["initial_val_loss"] == pytest.approx(read_result(short_run)["val_loss"], rel=1e-5)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_deepspeed_reads_every_config_xtrain_writes(strategy, monkeypatch):
    """Each precision x offload that xtrain can write for this stage, read by DeepSpeed's own config class."""
    import itertools

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    offloads = [("none", "none"), ("cpu", "none"), ("nvme", "none")]
    if strategy == "zero3":
        offloads += [("cpu", "cpu"), ("nvme", "nvme")]
    for precision, (optimizer, param) in itertools.product(["fp32", "fp16", "bf16", "fp8"], offloads):
        cfg = compose_run(f"strategy={strategy}", f"precision={precision}", f"strategy.offload_optimizer={optimizer}",
                          *([f"strategy.offload_param={param}"] if strategy == "zero3" else []),
                          *(["strategy.nvme_path=/local/nvme"] if "nvme" in (optimizer, param) else []),
                          "cluster.num_processes=1", "trainer.batch_size=4",
                          "trainer.grad_accum=2")
        parsed = DeepSpeedConfig(deepspeed_config(cfg, plugins.ModelFacts(hidden_size=64)))
        case = f"{strategy} {precision} offload {optimizer}/{param}"
        assert parsed.zero_optimization_stage == int(strategy[-1]), case
        assert (parsed.train_batch_size, parsed.gradient_accumulation_steps) == (8, 2), case
        assert parsed.float16_config.enabled is (precision == "fp16"), case
        assert parsed.bfloat16_config.enabled is (precision in ("bf16", "fp8")), case  # fp8 runs inside bf16
        if precision == "fp16":
            assert parsed.float16_config.loss_scale == 0 and parsed.float16_config.initial_scale_power == 16, case
        offloaded = parsed.zero_config.offload_optimizer
        device = getattr(offloaded, "device", "none")  # an enum, or its value
        assert getattr(device, "value", device) == optimizer, case
        if optimizer == "nvme":
            assert str(offloaded.nvme_path) == "/local/nvme", case
        assert parsed.zero_force_ds_cpu_optimizer is True, case  # on GPUs: DeepSpeedCPUAdam for an offload
