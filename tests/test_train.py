"""Training runs end to end: the default job learns, leaves the run dir contract, and its model loads."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import yaml

from conftest import SHORT, SMALL, assert_one_line_error, compose_run, read_metrics, read_result, run_xtrain, train_losses, xtrain_in_process


@pytest.mark.slow
def test_default_job_learns(tmp_path):
    """`python -m xtrain` exactly as shipped (only the run dir and a fresh cache pinned): val loss falls well below
    its start."""
    run_dir = tmp_path / "run"
    proc = run_xtrain(f"run_dir={run_dir}", env={"XTRAIN_CACHE_DIR": str(tmp_path / "cache")}, own_process=True)
    # a cold cache included (tokenizer training, tokenization): the output is xtrain's own log lines only
    lines = (proc.stdout + proc.stderr).splitlines()
    assert lines and [line for line in lines if not re.match(r"\[\d\d:\d\d:\d\d\]\[xtrain\]\[INFO\] ", line)] == []
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["steps"] == 300
    assert result["initial_val_loss"] > 7.0  # ~ln(2048): an untrained model
    assert result["val_loss"] < result["initial_val_loss"] - 2.0
    assert result["val_ppl"] == pytest.approx(2.718281828 ** result["val_loss"], rel=1e-6)
    assert "step 300 | val loss" in proc.stdout and "tokens/s" in proc.stdout


def test_run_dir_contract(short_run):
    assert {p.name for p in short_run.iterdir()} >= {"run.yaml", "metrics.jsonl", "result.json", "checkpoints", "model",
                                                    "accelerate_config.yaml"}
    assert not (short_run / "deepspeed.json").exists()  # only for ZeRO strategies
    exported = yaml.safe_load((short_run / "accelerate_config.yaml").read_text())
    assert exported["distributed_type"] == "NO" and exported["mixed_precision"] == "no" and exported["num_processes"] == 1
    assert "batch_size: 16" in (short_run / "run.yaml").read_text()
    result = read_result(short_run)
    assert result["status"] == "completed" and result["steps"] == 12 and result["world_size"] == 1
    assert result["tokens_per_s"] > 0 and 0 < result["time_to_first_step_s"] < result["wall_time_s"]
    # keep_checkpoints=2 of the saves at steps 6 and 12, newest last; no partial saves left
    assert sorted(p.name for p in (short_run / "checkpoints").iterdir()) == ["step_00000006", "step_00000012"]


def test_metrics_jsonl_has_every_logged_step_and_eval(short_run):
    rows = read_metrics(short_run)
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "val/loss" in r]
    assert [r["step"] for r in train] == [4, 8, 12]
    assert [r["step"] for r in evals] == [0, 6, 12]
    assert all(r["train/lr"] > 0 and r["train/tokens_per_s"] > 0 for r in train)
    assert train[-1]["train/tokens_seen"] == 12 * 16 * 128
    assert evals[-1]["val/loss"] < evals[0]["val/loss"]
    assert read_result(short_run)["val_loss"] == evals[-1]["val/loss"]
    # the epoch of each row: pydoc's 955 train blocks make 59 whole steps of 16
    result = read_result(short_run)
    assert result["steps_per_epoch"] == 955 // 16 == 59 and result["effective_batch"] == 16
    assert [r["epoch"] for r in train] == [round(step / 59, 4) for step in (4, 8, 12)]
    assert [r["epoch"] for r in evals] == [0.0, round(6 / 59, 4), round(12 / 59, 4)] and result["epoch"] == round(12 / 59, 4)


def test_saved_model_loads_with_transformers_and_generates(short_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = short_run / "model"
    assert (model_dir / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # the saved weights are the final checkpoint's weights
    from safetensors.torch import load_file

    final = load_file(short_run / "checkpoints" / "step_00000012" / "model.safetensors")
    for name, tensor in final.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    inputs = tokenizer("The for statement", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 8
    assert isinstance(tokenizer.decode(out[0]), str)
    # GPT-2's activation (gelu_new) as torch's one-kernel tanh GELU: the same function, to float rounding
    assert model.config.activation_function == "gelu_pytorch_tanh"
    as_gpt2 = AutoModelForCausalLM.from_pretrained(model_dir, activation_function="gelu_new")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, as_gpt2(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_tiny_llama_trains(tmp_path):
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", "model=tiny_llama", *SHORT)
    config = json.loads((run_dir / "model" / "config.json").read_text())
    assert config["model_type"] == "llama"
    evals = [r for r in read_metrics(run_dir) if "val/loss" in r]
    assert evals[-1]["val/loss"] < evals[0]["val/loss"]


def test_text_files_and_pretrained_local_model(tmp_path, short_run):
    """data=text from a glob of local files, fine-tuning model=hf from a local directory."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 300)
    run_dir = tmp_path / "run"
    run_xtrain(
        f"run_dir={run_dir}", "model=hf", f"model.name_or_path={short_run / 'model'}",
        "data=text", f"data.files=[{corpus}/*.txt]", "trainer.batch_size=4", *SHORT,
    )
    evals = [r for r in read_metrics(run_dir) if "val/loss" in r]
    assert evals[-1]["val/loss"] < evals[0]["val/loss"]
    # started from the pretrained weights: its first val loss is well below an untrained model's, ln(vocab)
    assert evals[0]["val/loss"] < math.log(2048) - 0.4


def test_datasets_save_to_disk_directory(tmp_path):
    import datasets

    ds_dir = tmp_path / "ds"
    texts = [f"Record {i}: the answer is {i * 7}. " * 20 for i in range(200)]
    datasets.Dataset.from_dict({"body": texts, "id": list(range(200))}).save_to_disk(str(ds_dir))
    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", "data=hf", f"data.name={ds_dir}", "data.text_column=body", *SHORT)
    assert read_result(run_dir)["status"] == "completed"
    bad_dir = tmp_path / "bad"
    proc = xtrain_in_process(f"run_dir={bad_dir}", "data=hf", f"data.name={ds_dir}", "data.text_column=text", check=False)
    assert proc.returncode == 2 and "data.text_column=text: not a column" in proc.stderr and "body, id" in proc.stderr
    # failed before training started: the same run dir takes the corrected run
    run_xtrain(f"run_dir={bad_dir}", "data=hf", f"data.name={ds_dir}", "data.text_column=body", *SHORT)
    # a DatasetDict without the split: a dry run refuses it as the run would, from the directory's index
    datasets.DatasetDict(train=datasets.Dataset.from_dict({"body": texts[:4]})).save_to_disk(str(tmp_path / "dd"))
    proc = xtrain_in_process("data=hf", f"data.name={tmp_path / 'dd'}", "data.split=validation", "dry_run=true",
                             check=False)
    assert_one_line_error(proc, f"data.split=validation: not in {tmp_path / 'dd'}; choose one of train")


def test_bf16_autocast_is_really_applied(tmp_path):
    """On the small model: bf16 on a CPU without bf16 units is emulated, and slow."""
    run_dir, fp32 = tmp_path / "run", tmp_path / "fp32"
    run_xtrain(f"run_dir={run_dir}", "precision=bf16", *SHORT, *SMALL)
    xtrain_in_process(f"run_dir={fp32}", *SHORT, *SMALL)
    result = read_result(run_dir)
    assert result["precision"] == "bf16" and result["autocast"] is True
    bf16_losses = [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]
    fp32_losses = [r["train/loss"] for r in read_metrics(fp32) if "train/loss" in r]
    # same seed and data: close to fp32, but not bit-identical (the matmuls ran in bf16)
    assert bf16_losses == pytest.approx(fp32_losses, rel=0.02)
    assert bf16_losses != fp32_losses


def test_fused_adamw_follows_the_default_update(tmp_path, short_run):
    """trainer.fused_optimizer=true: torch's fused AdamW kernel steps; the losses are the default update's up to
    rounding (measured on this CPU: equal to 1e-6 relative over 12 steps; asserted to 1e-4)."""
    from xtrain.engine.optim import build_optimizer

    cfg = compose_run("trainer.fused_optimizer=true")
    assert build_optimizer(torch.nn.Linear(4, 4), cfg).defaults["fused"] is True
    assert not build_optimizer(torch.nn.Linear(4, 4), compose_run()).defaults["fused"]
    run_dir = tmp_path / "run"
    xtrain_in_process(f"run_dir={run_dir}", *SHORT, "trainer.fused_optimizer=true")
    fused, default = train_losses(run_dir), train_losses(short_run)
    assert len(fused) == len(default) == 3 and fused == pytest.approx(default, rel=1e-4)


def test_the_perplexity_of_a_huge_finite_loss_is_infinite_not_an_error():
    """exp(loss) overflows a float past ~709.8: a finite loss there is a perplexity of inf, not an OverflowError."""
    from xtrain.engine.evaluation import perplexity

    assert perplexity(2.0) == pytest.approx(math.exp(2.0)) and perplexity(709.0) < math.inf
    assert perplexity(710.0) == math.inf and perplexity(1e6) == math.inf
