"""fp8 with torchao through the real trainer, without a GPU.

Users are refused fp8 without FP8 units; the test seam `XTRAIN_TEST_FP8_ON_CPU=1` lets a CPU run it: the layers
xtrain converts, their scaled casts and fp8 matmuls (torch's CPU `_scaled_mm`), and under FSDP2 the fp8 all-gather
of the weights. torchao lives in a folder of its own (the Makefile's `fp8-seam`) that only these runs put on their
path: transformers imports torchao in every process wherever it is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (FP8_ON_CPU, REPO, compose_run, read_result, run_xtrain, seams, train_losses)
from xtrain.core.errors import ConfigError
from xtrain.parallel import fp8
from xtrain.launch import hardware
from xtrain.tasks.facts import model_facts

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the CPU path; on a GPU test_gpu.py covers fp8 (torchao)")

TORCHAO = Path(sys.prefix) / "fp8-seam"
SEAM = {**FP8_ON_CPU, "PYTHONPATH": os.pathsep.join([str(TORCHAO), os.environ.get("PYTHONPATH", "")])}
# MLP weights of 128 x 512: multiples of 16 (converted) and large enough to be built on meta under FSDP2
LLAMA = ["model=tiny_llama", "model.intermediate_size=512", "precision=fp8", "precision.fp8_backend=torchao",
         "precision.fp8_skip=[k_proj]", "trainer.batch_size=4", "trainer.max_steps=10", "trainer.warmup_steps=2",
         "trainer.log_every=1", "trainer.eval_every=10", "trainer.save_every=10"]


TWO_BLOCKS = [*LLAMA, "model.num_layers=2"]  # (fp8 on a CPU is emulated: a run's steps cost what its blocks do)


def test_the_layers_in_fp8_are_the_linear_ones_but_the_ends_and_the_skipped():
    cfg = compose_run(*LLAMA)
    chosen = model_facts(cfg)[1].fp8_layers
    blocks = [f"model.layers.{i}.{name}" for i in range(4) for name in
              ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj")]
    assert chosen == tuple(blocks)  # every block alike, its first linear layer (q_proj) too; lm_head kept
    # dims that are not multiples of 16 stay out (tiny_llama's own MLP: 344)
    narrow = model_facts(compose_run(*LLAMA, "model.intermediate_size=344"))[1].fp8_layers
    assert narrow and not any("mlp" in name for name in narrow)
    gpt2 = compose_run("precision=fp8", "precision.fp8_backend=torchao")
    with pytest.raises(ConfigError, match="precision=fp8: no linear layer of GPT2LMHeadModel can train in fp8"):
        fp8.check(gpt2.precision, model_facts(gpt2)[1].fp8_layers, "GPT2LMHeadModel")  # (GPT-2's are Conv1D)


def test_fp8_on_cpu_is_a_test_seam_only(monkeypatch):
    cfg = compose_run(*LLAMA)
    monkeypatch.delenv("XTRAIN_SEAMS", raising=False)
    assert hardware.refusal(cfg).startswith("precision=fp8: needs a GPU with FP8 units")
    monkeypatch.setenv("XTRAIN_SEAMS", FP8_ON_CPU["XTRAIN_SEAMS"])
    assert hardware.refusal(cfg) is None or "torchao is not installed" in hardware.refusal(cfg)  # (this process's path)
    te = compose_run("model=tiny_llama", "precision=fp8")  # (Transformer Engine: no seam)
    assert "needs a GPU with FP8 units" in hardware.refusal(te)


def test_fsdp2_compiled_and_ddp_train_the_chosen_layers_in_fp8(tmp_path):
    """FSDP2 compiled (2 processes, tensorwise: the weights all-gathered in fp8) and DDP eager (1 process x
    grad_accum 2, rowwise) train the same layers in fp8 and follow each other (measured within 2 %: fp8 rounds
    differently by recipe and path; compiled FSDP2 follows eager FSDP2 to 3e-4). (That the weights start as the
    eager build's: the meta-build test below, bitwise.)"""
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    out = run_xtrain(f"run_dir={fsdp}", *TWO_BLOCKS, "strategy=fsdp", "cluster.num_processes=2", "trainer.compile=true",
                     env={**SEAM, **seams("fp8_on_cpu", "fsdp_on_cpu")}).stdout
    assert ("fp8 (torchao, tensorwise): 12 of 15 linear layers; in bf16: model.layers.0.self_attn.k_proj, "
            "model.layers.1.self_attn.k_proj, lm_head") in out
    out = run_xtrain(f"run_dir={ddp}", *TWO_BLOCKS, "trainer.grad_accum=2", "precision.fp8_recipe=rowwise",
                     env=SEAM).stdout
    assert "fp8 (torchao, rowwise): 12 of 15 linear layers" in out
    for run, scaling in ((fsdp, "tensorwise"), (ddp, "rowwise")):
        result = read_result(run)
        assert result["status"] == "completed" and result["precision"] == "fp8" and result["autocast"] is True
        assert result["val_loss"] < result["initial_val_loss"] - 0.5
        assert result["fp8"]["scaling"] == scaling and len(result["fp8"]["layers"]) == 12
        kept = result["fp8"]["kept_in_bf16"]
        assert kept == ["model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.k_proj", "lm_head"]
    assert read_result(fsdp)["compiled_regions"] >= 2  # (the blocks)
    a, b = train_losses(fsdp), train_losses(ddp)
    assert len(a) == 10 and a == pytest.approx(b, rel=0.03)


META_BUILD = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from xtrain.config.schema import Fp8Backend, Precision, PrecisionConfig
from xtrain.parallel import fp8, meta_init
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

config = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=2048)
torch.manual_seed(3)
eager = LlamaForCausalLM(config)
torch.manual_seed(3)
lazy = meta_init.build(lambda: LlamaForCausalLM(config))
fp8.convert(lazy, PrecisionConfig(name=Precision.fp8, fp8_backend=Fp8Backend.torchao), fsdp=True)
wrapped = [n for n, p in lazy.named_parameters()
           if isinstance(p, WeightWithDynamicFloat8CastTensor) and p._tensor.is_meta]
assert "model.layers.1.mlp.up_proj.weight" in wrapped, wrapped
placed = meta_init.materialize(lazy, torch.device("cpu"))
for name, want in eager.state_dict().items():
    got = placed.state_dict()[name]
    assert torch.equal(getattr(got, "_tensor", got), want), name
print(len(wrapped), "wrapped weights built on meta, filled bitwise")

# FSDP2's full state dict on one rank keeps the wrappers (as this one does): the export saves what they wrap
state = fp8.unwrapped(placed.state_dict())
placed.save_pretrained(OUT, state_dict=state, safe_serialization=True)
exported = LlamaForCausalLM.from_pretrained(OUT).state_dict()
assert all(torch.equal(exported[name], want) for name, want in eager.state_dict().items())
print("exported bitwise")
"""


def test_weights_wrapped_for_the_fp8_all_gather_are_built_on_meta_as_the_eager_build_and_export(tmp_path):
    """FSDP2's tensorwise fp8 wraps each converted weight (its all-gather casts); a model built on meta is
    converted before it is sharded, and its wrapped weights get the eager build's values, bitwise; a state dict
    that holds the wrappers exports them (the model/ of a one-process FSDP2 fp8 run)."""
    proc = subprocess.run([sys.executable, "-c", f"OUT = {str(tmp_path)!r}\n" + META_BUILD], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, **SEAM})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "6 wrapped weights built on meta, filled bitwise\n" in proc.stdout and "exported bitwise\n" in proc.stdout
