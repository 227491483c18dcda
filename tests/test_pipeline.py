"""Pipeline stages (strategy.pp), on CPU processes over gloo: pp=2 x 2 FSDP2 shards of the built-in Llama against
4-process DDP on the same effective batch; kill -9 and resume; the checkpoint's moves (another pp, DDP without
stages, one process) and its export; GPipe and the interleaved 1F1B schedule of GPT-2 against one process; the
stages' forward against the whole model's; the mesh's arithmetic; every refusal before launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import (FSDP_ON_CPU, assert_equal_weights, assert_one_line_error, compose_run, kill_after_checkpoint,
                      model_weights, read_metrics, read_result, refusal, run_xtrain, start_xtrain)
from test_mesh import killed_after
from xtrain.parallel import dims, pipeline, stages, strategies

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU seam; pipelines on GPUs: test_gpu.py")

SEAM = FSDP_ON_CPU
# 16 sequences a step: DDP deals micro-batches of 4 to 4 ranks; the pipeline 2 micro-batches of 4 to 2 shards
RUN = ["model=tiny_llama", "cluster.num_processes=4", "trainer.max_steps=8", "trainer.warmup_steps=2",
       "trainer.log_every=1", "trainer.eval_every=4", "trainer.save_every=4", "trainer.batch_size=4"]
PP = ["strategy=fsdp", "strategy.pp=2", "trainer.grad_accum=2"]
# GPT-2's 4 layers, 8 sequences a step, on one process or in 2 pipeline stages of 2 processes
SMALL = ["trainer.max_steps=6", "trainer.warmup_steps=2", "trainer.log_every=1", "trainer.eval_every=3",
         "trainer.save_every=3", "trainer.batch_size=4", "trainer.grad_accum=2"]


def run(run_dir: Path, *overrides: str) -> Path:
    run_xtrain(f"run_dir={run_dir}", *overrides, env=SEAM)
    return run_dir


def curve(run_dir: Path) -> list[tuple]:
    return [(r["step"], r.get("train/loss"), r.get("val/loss")) for r in read_metrics(run_dir)
            if "train/loss" in r or "val/loss" in r]


def assert_follows(ours: Path, theirs: Path, after: int = -1) -> None:
    """Every train and val loss after step `after` equal to float rounding (measured: 1e-7 relative)."""
    got = [row for row in curve(ours) if row[0] > after]
    expected = [row for row in curve(theirs) if row[0] > after]
    assert [row[0] for row in got] == [row[0] for row in expected] and len(got) >= 3
    for (_, loss, val), (_, loss_e, val_e) in zip(got, expected):
        assert loss == pytest.approx(loss_e, rel=1e-5, abs=0) if loss is not None else loss_e is None
        assert val == pytest.approx(val_e, rel=1e-5, abs=0) if val is not None else val_e is None


@pytest.fixture(scope="module")
def ddp4(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ddp4") / "run", *RUN)


@pytest.fixture(scope="module")
def pp_fsdp(tmp_path_factory):
    return run(tmp_path_factory.mktemp("pp") / "run", *RUN, *PP)


def test_two_stages_of_two_ddp_replicas_follow_the_4_process_ddp_curve(ddp4, tmp_path):
    """Each stage replicated by DDP on 2 of the 4 processes: the replicas' gradients averaged once a step, after
    every micro-batch's backward, as DDP averages them."""
    pp_ddp = run(tmp_path / "run", *RUN, "strategy=ddp", "strategy.pp=2", "trainer.grad_accum=2")
    assert (read_result(pp_ddp)["world_size"], read_result(pp_ddp)["data_parallel_size"]) == (4, 2)
    assert_follows(pp_ddp, ddp4)


def test_two_stages_of_two_shards_follow_the_4_process_ddp_curve(ddp4, pp_fsdp):
    result = read_result(pp_fsdp)
    assert result["status"] == "completed" and result["mesh"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
    assert result["data_parallel_size"] == 2 and result["effective_batch"] == 16
    assert result["model_parameters"] == read_result(ddp4)["model_parameters"]  # (the whole model's, not a stage's)
    log = next((pp_fsdp / "logs").glob("node0/*/attempt_0/0/stdout.log")).read_text()
    assert "4 processes (PP x FSDP: 2 stages x 2 shards) | effective batch 16 sequences" in log
    assert_follows(pp_fsdp, ddp4)
    seen = {r["step"]: r["train/tokens_seen"] for r in read_metrics(pp_fsdp) if "train/tokens_seen" in r}
    assert seen[8] == 8 * 16 * 128


@pytest.fixture(scope="module")
def pp_tp(tmp_path_factory):
    return run(tmp_path_factory.mktemp("pp_tp") / "run", *RUN, *PP, "cluster.num_processes=8", "strategy.tp=2")


@pytest.fixture(scope="module")
def pp_hsdp(tmp_path_factory):
    return run(tmp_path_factory.mktemp("pp_hsdp") / "run", *RUN, *PP, "cluster.num_processes=8",
               "strategy.dp_replicate=2", "trainer.batch_size=2")


@pytest.mark.parametrize("kind,mesh,words", [
    ("pp_tp", {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}, "PP x FSDP x TP: 2 stages x 2 shards x 2-way TP"),
    ("pp_hsdp", {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 1}, "PP x HSDP: 2 stages x 2 replicas x 2 shards"),
])
def test_stages_compose_with_tensor_parallelism_and_hsdp_on_8_processes(request, ddp4, kind, mesh, words):
    """Each stage split over 2-way TP and sharded over 2 ranks, or sharded in 2 replicas of 2 shards: DDP's curve at
    16 sequences a step, and the whole model exported."""
    ours = request.getfixturevalue(kind)
    result = read_result(ours)
    assert result["mesh"] == mesh and result["effective_batch"] == 16 and result["world_size"] == 8
    log = next((ours / "logs").glob("node0/*/attempt_0/0/stdout.log")).read_text()
    assert f"8 processes ({words}) | effective batch 16 sequences" in log
    assert_follows(ours, ddp4)
    expected = model_weights(ddp4)
    for name, tensor in model_weights(ours).items():  # (Adam's steps on rarely seen tokens' rows magnify float
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=5e-5)  # rounding: measured 1.2e-5 at most)


def test_each_stage_holds_its_layers_and_the_checkpoint_holds_the_whole_model(pp_fsdp, ddp4):
    """Ranks 0-1 hold the embeddings and layers 0-1, ranks 2-3 layers 2-3, the norm and head (the tied embedding's
    copy), each stage in 2 shards: together the whole model and the head's copy once; the export is the whole
    model."""
    sizes = read_result(pp_fsdp)["parameter_bytes"]
    whole = read_result(ddp4)["parameter_bytes"][0]
    head = 2048 * 128 * 4  # (the tiny Llama's vocabulary x hidden, fp32)
    assert len(sizes) == 4 and sum(sizes) == whole + head and max(sizes) < 0.35 * whole
    checkpoint = pp_fsdp / "checkpoints" / "step_00000008"
    model, optimizer = stages.read(checkpoint)
    names = set(model)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"0", "1", "2", "3"}
    assert set(optimizer["state"]) == {n for n in names if not n.endswith("inv_freq")}
    torch.testing.assert_close(model["lm_head.weight"], model["model.embed_tokens.weight"], rtol=0, atol=0)
    exported = model_weights(pp_fsdp)
    assert exported.keys() == model_weights(ddp4).keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, model_weights(ddp4)[name], rtol=1e-4, atol=1e-6)


def test_a_pipeline_run_resumes_bitwise_after_kill_9(tmp_path, pp_fsdp):
    run_dir = tmp_path / "run"
    proc = start_xtrain(f"run_dir={run_dir}", *RUN, *PP, env=SEAM, quiet=True)
    kill_after_checkpoint(proc, run_dir / "checkpoints" / "step_00000004")
    run(run_dir, *RUN, *PP, "resume=auto")
    result = read_result(run_dir)
    assert result["status"] == "completed" and [r["at_step"] for r in result["restarts"]] == [4]
    assert curve(run_dir) == curve(pp_fsdp)
    assert_equal_weights(run_dir, pp_fsdp)


def test_a_pipeline_checkpoint_moves_to_another_pp_and_to_fsdp2_without_stages(pp_fsdp, tmp_path):
    """From 2 stages x 2 FSDP2 shards (4 processes): to 4 stages of one DDP process each (a layer a stage), then to
    FSDP2 without stages on 2 processes; the effective batch kept by grad_accum (2 -> 4 -> 2), every later loss the
    unbroken run's."""
    same = [arg for arg in RUN if not arg.startswith("cluster.num_processes=")]
    four = killed_after(pp_fsdp, 4, tmp_path / "four")
    run(four, *RUN, "strategy=ddp", "strategy.pp=4", "trainer.grad_accum=4", "trainer.save_every=2", "resume=auto")
    assert read_result(four)["restarts"][-1]["moved"] == {"strategy": ["fsdp", "ddp"], "pp": [2, 4],
                                                          "grad_accum": [2, 4]}
    assert read_result(four)["mesh"] == {"pp": 4, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert_follows(four, pp_fsdp, after=4)
    flat = killed_after(four, 6, tmp_path / "flat")
    run(flat, *same, "cluster.num_processes=2", "strategy=fsdp", "trainer.grad_accum=2", "resume=auto")
    assert read_result(flat)["restarts"][-1]["moved"] == {"world": [4, 2], "strategy": ["ddp", "fsdp"],
                                                          "pp": [4, 1], "grad_accum": [4, 2]}
    assert "pp" not in read_result(flat)["mesh"] and "pp 4 -> 1" in (flat / "run.yaml").read_text()
    assert_follows(flat, pp_fsdp, after=6)


def test_export_of_a_pipeline_checkpoint_is_the_whole_model(pp_fsdp, tmp_path):
    """Step 8's stage files, exported whole, are the model the run exported at its end."""
    from transformers import AutoModelForCausalLM

    from xtrain.commands.export import main

    main([str(pp_fsdp), "step=8", f"out={tmp_path / 'at8'}"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "at8")
    assert sum(p.numel() for p in model.parameters()) == read_result(pp_fsdp)["model_parameters"]
    ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, AutoModelForCausalLM.from_pretrained(pp_fsdp / "model")(ids).logits,
                                   rtol=0, atol=0)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run(tmp_path_factory.mktemp("one") / "run", *SMALL)


@pytest.mark.parametrize("schedule,overrides", [
    ("gpipe", []),
    ("interleaved_1f1b", ["strategy.pp_stage_layers=[1,1,1,1]"]),  # 2 stages a rank, one layer each
    ("1f1b", ["strategy.pp_microbatches=4", "strategy.pp_stage_layers=[1,3]"]),  # 4 micro-batches of 2 sequences
])
def test_each_schedule_follows_one_process(one_process, tmp_path, schedule, overrides):
    ours = run(tmp_path / "run", *SMALL, "cluster.num_processes=2", "strategy.pp=2",
               f"strategy.pp_schedule={schedule}", *overrides)
    assert read_result(ours)["status"] == "completed"
    assert_follows(ours, one_process)


def test_bf16_stages_follow_one_bf16_process(tmp_path):
    """Autocast around each stage's forward and backward, as Accelerate's around a whole model (measured 2e-6), on
    GPT-2's 4 layers at a quarter of their width (bf16 on a CPU without bf16 units is ~8x fp32's time a step)."""
    narrow = [*SMALL, "precision=bf16", "model.hidden_size=32", "model.intermediate_size=128", "model.num_heads=2"]
    alone = run(tmp_path / "one", *narrow)
    ours = run(tmp_path / "pp", *narrow, "cluster.num_processes=2", "strategy.pp=2")
    assert read_result(ours)["autocast"] is True
    assert_follows(ours, alone)


def test_a_pretrained_decoder_splits_into_stages(tmp_path):
    """A Llama-family model loaded with from_pretrained (grouped-query attention, tied embeddings), in 2 stages on 2
    processes: one process's curve."""
    from chat_models import tiny_chat_dir

    model = ["model=hf", f"model.name_or_path={tiny_chat_dir()}", *SMALL]
    alone = run(tmp_path / "one", *model)
    ours = run(tmp_path / "pp", *model, "cluster.num_processes=2", "strategy.pp=2")
    assert read_result(ours)["model_parameters"] == read_result(alone)["model_parameters"]
    assert_follows(ours, alone)


def test_the_stages_forward_is_the_whole_models():
    """GPT-2 and Llama split into stages by hand, chained in one process: the whole model's logits, exactly."""
    from transformers import AutoModelForCausalLM

    from xtrain.tasks.causal_lm.model import transformers_config

    for arch in ("tiny_gpt2", "tiny_llama"):
        cfg = compose_run(f"model={arch}")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(transformers_config(cfg.model, 2048, 64, 0)).eval()
        layout = stages.DECODERS[type(model).__name__]
        base, layers = getattr(model, layout.base), list(getattr(getattr(model, layout.base), layout.layers))
        parts = [stages.stage_module(layout, base, model.lm_head, part, i == 0, i == 2, model.config)
                 for i, part in enumerate((layers[:1], layers[1:3], layers[3:]))]
        ids = torch.randint(0, 2048, (2, 64))
        h = ids
        with torch.no_grad():
            for part in parts:
                h = part(h)
            assert torch.equal(h, model(input_ids=ids, use_cache=False).logits), arch
        assert parts[0].embeddings[0] is (base.embed_tokens if arch == "tiny_llama" else base.wte)  # (not a copy)


def test_the_mesh_puts_stages_outermost():
    layout = dims.layout("fsdp", 8, dp_replicate=1, tp=1, pp=2)
    assert (layout.pp, layout.dp_shard, layout.data_parallel) == (2, 4, 4)
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("dp_shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.effective_batch(4, 2) == 32 and layout.words() == "PP x FSDP: 2 stages x 4 shards"
    ddp = dims.layout("ddp", 4, pp=2)
    assert (ddp.dp_replicate, ddp.data_parallel, ddp.words()) == (2, 2, "PP x DDP: 2 stages x 2 replicas")
    cfg = compose_run("strategy.pp=2", "strategy.pp_schedule=interleaved_1f1b", "cluster.num_processes=2",
                      "trainer.grad_accum=4")
    assert stages.stages(cfg) == 4 and stages.owned_stages(cfg, 1) == [1, 3]
    assert stages.stage_layers(cfg, 8) == [2, 2, 2, 2] and pipeline.bubble(cfg, 4) == pytest.approx(0.2)
    assert strategies.of(cfg).name == "PP x DDP"


def test_the_plan_shows_the_stages_and_a_stages_memory(tmp_path):
    proc = run_xtrain(f"run_dir={tmp_path / 'run'}", *RUN, *PP, "dry_run=true", env=SEAM)
    assert "mesh         2 x 1 x 2 x 1 (pp x dp_replicate x dp_shard x tp): PP x FSDP: 2 stages x 2 shards" in proc.stdout
    assert "pp           2: ranks [0, 2]" in proc.stdout and '"bubble": 0.3333' in proc.stdout
    assert not (tmp_path / "run").exists()
    from xtrain.parallel import estimate
    from xtrain.tasks.facts import model_facts

    flat, staged = compose_run(*RUN, "strategy=fsdp"), compose_run(*RUN, *PP)
    n, facts = model_facts(flat)
    whole, half = estimate.device_memory(n, flat, facts), estimate.device_memory(n, staged, facts)
    assert half.params == pytest.approx(whole.params, rel=1e-6)  # (4 shards of all vs 2 shards of half)
    assert half.activations < whole.activations * 2  # (2 layers, 2 micro-batches in flight)


@pytest.mark.parametrize("overrides,expected", [
    (["strategy=zero3", "strategy.pp=2"], ["strategy.pp=2: pipeline stages compose with strategy=ddp or strategy=fsdp",
                                           "strategy=fsdp strategy.pp=2"]),
    (["strategy.pp=3", "cluster.num_processes=4"], ["strategy.pp=3: does not divide the 4 processes"]),
    (["strategy.pp=2", "cluster.num_processes=2"],
     ["strategy.pp=2 with 1 micro-batch(es) a step", "so 50% of each step is idle (the bubble)", "trainer.grad_accum=2"]),
    (["strategy.pp=2", "cluster.num_processes=2", "trainer.grad_accum=2", "model.num_layers=3"],
     ["3 layers do not split evenly into 2 stages", "strategy.pp_stage_layers"]),
    (["strategy.pp=2", "cluster.num_processes=2", "trainer.grad_accum=2", "strategy.pp_stage_layers=[1,2]"],
     ["strategy.pp_stage_layers=[1, 2]: sums to 3", "has 4 layers"]),
    (["strategy.pp=2", "strategy.pp_stage_layers=[1,1,2]"], ["strategy.pp_stage_layers=[1, 1, 2]: give 2 whole numbers"]),
    (["strategy.pp_stage_layers=[2,2]"], ["strategy.pp_stage_layers=[2, 2]: a pipeline setting, and strategy.pp=1"]),
    (["strategy.pp=2", "strategy.pp_schedule=zb"], ["strategy.pp_schedule=zb: no such schedule", "gpipe, 1f1b"]),
    (["strategy=fsdp", "strategy.pp=2", "cluster.num_processes=2", "trainer.grad_accum=2"],
     ["leaves dp_shard=1: FSDP2 needs at least 2 ranks", "strategy=ddp strategy.pp=2"]),
    (["strategy=fsdp", "strategy.pp=2", "strategy.tp=2", "cluster.num_processes=8", "trainer.grad_accum=2"],
     ["strategy.tp=2: GPT2LMHeadModel has no tensor-parallel plan"]),
    (["model=tiny_llama", "strategy=fsdp", "strategy.pp=2", "strategy.tp=2", "cluster.num_processes=6",
      "trainer.grad_accum=2"], ["strategy.pp=2 x strategy.dp_replicate=1 x strategy.tp=2: does not divide the 6"]),
    (["strategy.pp=2", "cluster.num_processes=2", "strategy.pp_schedule=interleaved_1f1b", "trainer.grad_accum=3",
      "strategy.pp_stage_layers=[1,1,1,1]"], ["its 3 micro-batches a step must be a multiple of strategy.pp=2"]),
    (["strategy.pp=2", "cluster.num_processes=2", "trainer.grad_accum=2", "trainer.compile=true"],
     ["strategy.pp=2: with trainer.compile=true pipeline stages are not supported here"]),
    (["strategy.pp=2", "cluster.num_processes=2", "trainer.grad_accum=2", "strategy.pp_microbatches=3"],
     ["strategy.pp_microbatches=3: does not divide a data-parallel rank's step"]),
])
def test_a_pipeline_that_cannot_be_is_refused_before_launch(tmp_path, monkeypatch, overrides, expected):
    monkeypatch.setenv("XTRAIN_SEAMS", FSDP_ON_CPU["XTRAIN_SEAMS"])
    line = refusal(f"run_dir={tmp_path / 'run'}", *overrides)
    for text in expected:
        assert text in line, line
    assert not (tmp_path / "run").exists()


def test_a_model_the_splitter_does_not_know_is_refused(tmp_path):
    import numpy as np
    from PIL import Image

    for label in ("0", "1"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(tmp_path / "images" / label / f"{i}.png")
    line = refusal(f"run_dir={tmp_path / 'run'}", "task=image_cls", f"data.files=[{tmp_path / 'images'}]",
                   "task.num_labels=2", "task.num_channels=1", "strategy.pp=2", "cluster.num_processes=2",
                   "trainer.grad_accum=2", "trainer.batch_size=2")
    assert line.startswith("strategy.pp=2: ResNetForImageClassification is not a decoder the pipeline splitter knows")
    assert line.endswith("use strategy.pp=1") and not (tmp_path / "run").exists()


def test_a_checkpoint_without_stages_is_refused_by_a_pipeline_run(one_process, tmp_path):
    run_dir = killed_after(one_process, 3, tmp_path / "run")
    proc = run_xtrain(f"run_dir={run_dir}", *SMALL, "cluster.num_processes=2", "strategy.pp=2", "resume=auto",
                      check=False)
    assert_one_line_error(proc, "cannot continue in pipeline stages (strategy.pp=2)", "strategy.pp=1")
    assert read_result(run_dir) == read_result(one_process)
