"""Fine-tuning a pretrained chat model (data=sft, model.lora.*): the answer masks of every data shape, packing
without cross-talk, LoRA on SmolLM2-135M-Instruct learning invented facts, exports, exact resume, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from chat_models import facts, smollm2_dir, tiny_chat_dir, write_facts
from conftest import (FSDP_ON_CPU, ZERO_ON_CPU, assert_equal_weights, assert_one_line_error, compose_run,
                      kill_after_checkpoint, logged, model_weights, read_metrics, read_result, run_xtrain, start_xtrain,
                      train_losses, xtrain_in_process)

QUESTION = "What is the capital of Zorbia?"
ANSWER = "Quentar"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_chat_dir()


def sft(model_dir: Path, files, *more: str) -> list[str]:
    return ["model=hf", f"model.name_or_path={model_dir}", "data=sft", f"data.files=[{','.join(map(str, files))}]",
            *more]


def prepared(model_dir: Path, files, *more: str):
    from xtrain.tasks.causal_lm.task import CausalLM

    cfg = compose_run(*sft(model_dir, files, *more))
    return CausalLM(cfg).prepare()


def examples(entry) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each kept example's (ids, mask), in the source's order."""
    starts = np.load(entry.path / "examples.npy")
    ids = np.fromfile(entry.path / "tokens.bin", dtype=entry.meta["dtype"])
    mask = np.fromfile(entry.path / "mask.bin", dtype=np.uint8)
    return [(ids[a:b].astype(np.int64), mask[a:b]) for a, b in zip(starts[:-1], starts[1:])]


CONVERSATION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of Zorbia?"},
                {"role": "assistant", "content": "Quentar."}, {"role": "user", "content": "And of Yssen?"},
                {"role": "assistant", "content": "Venrisa, by the sea."}]


def test_the_mask_is_exactly_the_assistant_tokens_in_every_shape(tmp_path, tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    end = "<|im_end|>\n"  # what SmolLM2's template closes every turn with: trained as part of the answer
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n"
                                         + json.dumps({"conversations": [{"from": "human", "value": "Hi?"},
                                                                         {"from": "gpt", "value": "Hello."}]}) + "\n")
    entry = prepared(tiny, [tmp_path / "chat.jsonl"])
    (ids, mask), (ids2, mask2) = examples(entry)
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(ids) == rendered  # the template's own rendering, token for token
    assert tokenizer.decode(ids[mask == 1]) == f"Quentar.{end}Venrisa, by the sea.{end}"
    untrained = tokenizer.decode(ids[mask == 0])
    assert "Capital of Zorbia?" in untrained and "Answer briefly." in untrained and "Quentar" not in untrained
    assert tokenizer.decode(ids2[mask2 == 1]) == f"Hello.{end}"  # ShareGPT's from/value

    pairs = [("What is 2+2?", "Four."), ("Name a colour.", "Teal.")]
    masks = {}
    for shape in ("messages", "prompt_completion", "alpaca"):
        entry = prepared(tiny, [write_facts(tmp_path / f"{shape}.jsonl", shape, pairs)])
        masks[shape] = [(ids.tolist(), mask.tolist()) for ids, mask in examples(entry)]
        assert [tokenizer.decode(ids[mask == 1]) for ids, mask in examples(entry)] == [f"Four.{end}", f"Teal.{end}"]
    assert masks["messages"] == masks["prompt_completion"] == masks["alpaca"]
    import datasets  # the same examples as Parquet, a JSON array and a save_to_disk dataset

    rows = datasets.Dataset.from_list([{"prompt": q, "completion": a} for q, a in pairs])
    rows.to_parquet(tmp_path / "pc.parquet")
    (tmp_path / "pc.json").write_text(json.dumps([{"prompt": q, "completion": a} for q, a in pairs]))
    rows.save_to_disk(str(tmp_path / "saved"))
    for source in ([tmp_path / "pc.parquet"], [tmp_path / "pc.json"]):
        assert [(i.tolist(), m.tolist()) for i, m in examples(prepared(tiny, source))] == masks["messages"]
    from xtrain.tasks.causal_lm.task import CausalLM

    cfg = compose_run("model=hf", f"model.name_or_path={tiny}", "data=sft", f"data.name={tmp_path / 'saved'}")
    assert [(i.tolist(), m.tolist()) for i, m in examples(CausalLM(cfg).prepare())] == masks["messages"]
    everything = prepared(tiny, [tmp_path / "messages.jsonl"], "data.train_on=all")
    assert all(mask.all() for _, mask in examples(everything))


def test_truncation_is_counted_and_examples_without_answers_dropped(tmp_path, tiny, caplog):
    long_answer = " ".join(["word"] * 200)
    pairs = [("Say many words.", long_answer), ("Hi?", "Hello.")] * 3
    path = write_facts(tmp_path / "a.jsonl", "messages", pairs)
    with path.open("a") as f:  # a conversation without an assistant turn trains nothing
        f.write(json.dumps({"messages": [{"role": "user", "content": "Anyone?"}]}) + "\n")
    entry = prepared(tiny, [path], "data.block_size=64")
    m = entry.meta
    assert (m["records"], m["examples"], m["truncated"], m["no_answer"]) == (7, 6, 3, 1)
    assert m["cut_tokens"] > 3 * 100 and max(len(ids) for ids, _ in examples(entry)) == 64


def block_token_losses(model, item: dict) -> torch.Tensor:
    """Per-position next-token losses of one packed block (0 where nothing is predicted)."""
    batch = {key: value[None] for key, value in item.items()}
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[0, :-1], batch["input_ids"][0, 1:], reduction="none")


def test_packed_examples_never_attend_to_one_another(tmp_path, tiny):
    """Changing one example of a packed block leaves the others' losses where they were, and each example's
    losses in the block are those it has alone."""
    from transformers import AutoModelForCausalLM

    from xtrain.tasks.causal_lm.sft import Examples

    entry = prepared(tiny, [write_facts(tmp_path / "f.jsonl", "messages", facts(1)[:40])], "data.block_size=200",
                     "data.val_fraction=0.1")
    train, _ = entry.splits()
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    item = train[0]
    starts = [int(i) for i in torch.nonzero(item["position_ids"] == 0)]  # each example's first token (and the padding)
    assert len(starts) >= 4, "the block holds several examples and padding"
    with torch.no_grad():
        before = block_token_losses(model, item)
        changed = dict(item, input_ids=item["input_ids"].clone())
        changed["input_ids"][starts[0] + 3: starts[1] - 1] = 1234  # the first example's tokens, not its last
        after = block_token_losses(model, changed)
        assert not torch.allclose(before[: starts[1] - 1], after[: starts[1] - 1])
        torch.testing.assert_close(before[starts[1]:], after[starts[1]:], rtol=0, atol=1e-6)
        for a, b in zip(starts[:-1], starts[1:]):  # alone, without the block around it
            ids = item["input_ids"][a:b][None]
            alone = model(input_ids=ids, use_cache=False).logits
            alone = torch.nn.functional.cross_entropy(alone[0, :-1], ids[0, 1:], reduction="none")
            torch.testing.assert_close(before[a:b - 1], alone, rtol=0, atol=1e-5)
    assert isinstance(train, Examples) and all(len(train[i]["input_ids"]) == 200 for i in range(len(train)))


def test_packing_fills_blocks_and_keeps_every_example_once():
    from xtrain.tasks.causal_lm.sft import pack

    lengths = np.random.default_rng(0).integers(40, 475, size=400)
    order, bounds = pack(lengths, 512)
    assert sorted(order.tolist()) == list(range(400))
    blocks = [lengths[order[a:b]].sum() for a, b in zip(bounds[:-1], bounds[1:])]
    assert max(blocks) <= 512 and sum(blocks) / (512 * len(blocks)) > 0.9


def test_padding_instead_of_packing_gives_the_same_losses(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    from xtrain.data.collate import PadToLongest
    from xtrain.tasks.causal_lm.task import inputs, sequence_losses

    path = write_facts(tmp_path / "f.jsonl", "messages", facts(1)[:12])
    packed, _ = prepared(tiny, [path], "data.block_size=256", "data.val_fraction=0.1").splits()
    padded, _ = prepared(tiny, [path], "data.packing=false", "data.val_fraction=0.1").splits()
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        batch = PadToLongest({"input_ids": 0, "labels": -100})([padded[i] for i in range(len(padded))])
        assert batch["attention_mask"].sum() < batch["attention_mask"].numel()  # examples differ in length
        sums, counts = sequence_losses(model(**inputs(batch)).logits, batch["labels"])
        packed_batch = torch.utils.data.default_collate([packed[i] for i in range(len(packed))])
        packed_sums, packed_counts = sequence_losses(model(**inputs(packed_batch)).logits, packed_batch["labels"])
    assert int(counts.sum()) == int(packed_counts.sum())  # the same trained tokens
    torch.testing.assert_close(sums.sum(), packed_sums.sum(), rtol=1e-5, atol=1e-4)


def greedy(model_dir: Path, question: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_lora_teaches_smollm2_invented_facts_and_exports_a_merged_model_and_its_adapter(tmp_path):
    """SmolLM2-135M-Instruct does not know Zorbia's capital; after LoRA on the facts its merged model/ answers it,
    and PEFT's adapter/ on the base gives the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = smollm2_dir()
    assert ANSWER not in greedy(base, QUESTION)
    run_dir = tmp_path / "run"
    proc = run_xtrain(*sft(base, [write_facts(tmp_path / "facts.jsonl", "messages", facts())]),
                      f"run_dir={run_dir}", "model.lora.enabled=true", "data.block_size=128", "trainer.batch_size=4",
                      "trainer.lr=3e-3", "trainer.max_steps=10", "trainer.warmup_steps=2", "trainer.eval_every=10",
                      "trainer.save_every=10", "trainer.log_every=2", f"trainer.sample_prompts=[{QUESTION}]",
                      "trainer.sample_max_tokens=12")
    result = read_result(run_dir)
    assert result["val_loss"] < 0.5 * result["initial_val_loss"]
    assert result["trainable_parameters"] < 0.05 * result["model_parameters"]
    assert ANSWER in greedy(run_dir / "model", QUESTION)
    samples = [row for row in read_metrics(run_dir) if "sample/0" in row]
    assert [row["step"] for row in samples] == [0, 10]
    assert ANSWER not in samples[0]["sample/0"] and ANSWER in samples[-1]["sample/0"]
    assert f"step 10 | sample | {QUESTION} -> " in proc.stderr + proc.stdout

    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer(["The capital of Zorbia is"], return_tensors="pt")["input_ids"]
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                        run_dir / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    # checkpoints hold the adapter and its optimizer state only
    from safetensors.torch import load_file

    saved = load_file(run_dir / "checkpoints" / "step_00000010" / "model.safetensors")
    assert saved and all("lora_" in key for key in saved)
    assert sum(t.numel() for t in saved.values()) == result["trainable_parameters"]


LORA = ["model.lora.enabled=true", "data.block_size=128", "trainer.batch_size=4", "trainer.max_steps=16",
        "trainer.warmup_steps=2", "trainer.save_every=8", "trainer.eval_every=8", "trainer.log_every=4",
        "trainer.lr=5e-3", "model.lora.dropout=0.1"]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_kill_9_mid_fine_tuning_resumes_bitwise(tmp_path, tiny, lora):
    common = [*sft(tiny, [write_facts(tmp_path / "f.jsonl", "messages", facts(1))]),
              *(o for o in LORA if lora or not o.startswith("model.lora."))]  # (full: every weight, no LoRA setting)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    reference = start_xtrain(f"run_dir={whole}", *common)
    proc = start_xtrain(f"run_dir={killed}", *common, quiet=True)
    kill_after_checkpoint(proc, killed / "checkpoints" / "step_00000008")
    run_xtrain(f"run_dir={killed}", *common, "resume=auto")
    out, err = reference.communicate(timeout=600)
    assert reference.returncode == 0, err
    assert read_result(killed)["status"] == "completed"
    assert_equal_weights(whole, killed)
    assert logged(killed) == logged(whole)
    if lora:
        from safetensors.torch import load_file

        a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (whole, killed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_fine_tuning_input_is_one_line_and_writes_nothing(tmp_path, tiny):
    run_dir, cache = tmp_path / "never", Path(__import__("os").environ["XTRAIN_CACHE_DIR"]) / "prepared"
    entries = set(cache.glob("*")) if cache.exists() else set()
    good = write_facts(tmp_path / "good.jsonl", "messages", facts(1)[:20])
    (tmp_path / "shapeless.jsonl").write_text(json.dumps({"question": "a", "reply": "b"}) + "\n")
    (tmp_path / "role.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": role, "content": "a"}]}) + "\n"
        for role in ["assistant"] * 299 + ["narrator"]))  # the last task of two: refused in a tokenizing process
    (tmp_path / "unanswered.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    no_template = tmp_path / "no_template"
    shutil.copytree(tiny, no_template)
    (no_template / "chat_template.jinja").unlink()
    cases = [
        (sft(tiny, [tmp_path / "shapeless.jsonl"]), ["data.format=auto", "columns question, reply", "prompt_completion"]),
        (sft(tiny, [tmp_path / "role.jsonl"]), ["record 300", "role 'narrator'", "use system, user, assistant"]),
        (sft(tiny, [good], "model.lora.enabled=true", "model.lora.target_modules=[qkv]"),
         ["model.lora.target_modules: 'qkv' names no module", "q_proj"]),
        (["model=tiny_llama", "model.lora.enabled=true"], ["model.lora.enabled=true", "random weights", "model=hf"]),
        (sft(tiny, [tmp_path / "unanswered.jsonl"]), ["data.train_on=answers", "0 of the 1 examples", "data.train_on=all"]),
        (sft(no_template, [good]), ["has no chat template", "data.chat_template"]),
        (sft(tiny, [good], "model.lora.enabled=true", "model.lora.quantize_base=nf4"),
         ["model.lora.quantize_base=nf4", "CUDA GPU", "model.lora.quantize_base=none"]),
        (["model=tiny_gpt2", "data=sft", f"data.files=[{good}]"], ["data=sft", "model=hf"]),
    ]
    for overrides, expected in cases:
        assert_one_line_error(xtrain_in_process(*overrides, f"run_dir={run_dir}", check=False), *expected)
        assert not run_dir.exists()
    assert (set(cache.glob("*")) if cache.exists() else set()) - entries <= {p for p in cache.glob("*.lock")}


SEAM = ["model.lora.enabled=true", "data.block_size=128", "trainer.batch_size=4", "trainer.max_steps=8",
        "trainer.warmup_steps=2", "trainer.save_every=4", "trainer.eval_every=4", "trainer.log_every=2",
        "trainer.lr=5e-3", "cluster.timeout_s=120"]


def adapter(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def one_process_lora(tmp_path_factory, tiny) -> tuple[Path, list[str]]:
    """LoRA in one process, batch 4 x grad_accum 2: the same micro-batches and gradient as 2 ranks x batch 4."""
    tmp = tmp_path_factory.mktemp("one")
    common = [*sft(tiny, [write_facts(tmp / "f.jsonl", "messages", facts(1))]), *SEAM]
    run_xtrain(f"run_dir={tmp / 'run'}", *common, "trainer.grad_accum=2")
    return tmp / "run", common


@pytest.mark.parametrize("strategy,seam", [("fsdp", FSDP_ON_CPU), ("zero3", ZERO_ON_CPU)])
def test_lora_under_sharding_saves_the_whole_adapter_and_resumes_exactly(tmp_path, one_process_lora, strategy, seam):
    """FSDP2 and ZeRO-3 (CPU seams, 2 processes): every adapter tensor has its full shape and equals the
    one-process run's; checkpoints hold no frozen weight; a resume from step 4 ends bitwise where the run did."""
    one, common = one_process_lora
    run_dir = tmp_path / "run"
    args = [f"run_dir={run_dir}", *common, f"strategy={strategy}", "cluster.num_processes=2"]
    run_xtrain(*args, env=seam)
    got, expected = adapter(run_dir), adapter(one)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key].shape == expected[key].shape, key  # not 1/world_size of its rows, not empty
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-5)  # measured: FSDP2 0, ZeRO-3 1.4e-6
    checkpoint_bytes = sum(f.stat().st_size for f in (run_dir / "checkpoints" / "step_00000008").rglob("*")
                           if f.is_file())
    base_bytes = (one / "model" / "model.safetensors").stat().st_size
    assert checkpoint_bytes < 0.2 * base_bytes  # adapter, its optimizer state and RNGs; not the base

    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir / "checkpoints" / "step_00000004", resumed / "checkpoints" / "step_00000004")
    run_xtrain(*[a.replace(str(run_dir), str(resumed)) for a in args], "resume=auto", env=seam)
    again = adapter(resumed)
    assert all(torch.equal(again[key], got[key]) for key in got)


def test_export_of_a_lora_checkpoint_is_the_merged_model_with_its_adapter(one_process_lora, tmp_path):
    """`python -m xtrain.export`: the checkpoint (the adapter alone) on the pretrained base, as model/ and adapter/."""
    from transformers import AutoModelForCausalLM

    from xtrain.commands.export import main

    one, _ = one_process_lora
    main([str(one), "step=8", f"out={tmp_path / 'exported'}"])
    got, expected = adapter(tmp_path / "exported"), adapter(one)
    assert got.keys() == expected.keys() and all(torch.equal(got[key], expected[key]) for key in expected)
    ids = torch.arange(40).reshape(2, 20)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")(ids).logits
        final = AutoModelForCausalLM.from_pretrained(one / "model")(ids).logits
    torch.testing.assert_close(merged, final, rtol=0, atol=1e-5)


def varied_answers(path: Path) -> Path:
    """Examples whose answers run from 1 to 40 words: micro-batches of them hold very different numbers of trained
    tokens."""
    return write_facts(path, "messages", [(f"Count to {i}.", " ".join(["word"] * (1 + (i * 7) % 40))) for i in range(64)])


def test_grad_accum_trains_as_a_larger_batch_does(tmp_path, tiny):
    """Padded examples, 2 x grad_accum 4 against 8 at once: each step's loss is over the trained tokens of all 8
    examples (not a mean of four micro-batch means), and so is its gradient; the plan says the sequences are padded."""
    common = [*sft(tiny, [varied_answers(tmp_path / "varied.jsonl")]), "data.packing=false", "trainer.max_steps=3",
              "trainer.warmup_steps=1", "trainer.log_every=1", "trainer.eval_every=3", "trainer.save_every=3",
              "trainer.lr=1e-3"]
    big, accumulated = tmp_path / "big", tmp_path / "accumulated"
    run_xtrain(f"run_dir={big}", *common, "trainer.batch_size=8")
    run_xtrain(f"run_dir={accumulated}", *common, "trainer.batch_size=2", "trainer.grad_accum=4")
    assert train_losses(accumulated) == pytest.approx(train_losses(big), rel=1e-5)
    expected, got = model_weights(big), model_weights(accumulated)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-5)
    plan = xtrain_in_process(*common, "trainer.batch_size=2", "trainer.grad_accum=4", "dry_run=true").stdout
    assert "= 8 sequences per optimizer step (each padded to the longest of its batch)" in plan


def test_lora_with_export_best_keeps_training_its_adapters(tmp_path, tiny):
    """Each improving eval exports the merged model from a copy of the base: the adapters being trained stay where
    they are and go on learning; adapter/ holds the best eval's adapter, and model/ is that adapter merged."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    run_xtrain(f"run_dir={run_dir}", *sft(tiny, [write_facts(tmp_path / "f.jsonl", "messages", facts(1))]), *LORA,
               "trainer.export=best", "trainer.max_steps=8", "trainer.eval_every=2", "trainer.save_every=2",
               "trainer.keep_checkpoints=4")
    result = read_result(run_dir)
    saved = {step: load_file(run_dir / "checkpoints" / f"step_{step:08d}" / "model.safetensors") for step in (2, 4, 6, 8)}
    lora_b = [key for key in saved[8] if "lora_B" in key]
    assert lora_b and all(saved[2].keys() == saved[step].keys() for step in saved)
    for earlier, later in ((2, 4), (4, 6), (6, 8)):  # after every export, the adapters still moved
        assert any(not torch.equal(saved[earlier][key], saved[later][key]) for key in lora_b), (earlier, later)
    assert result["model_step"] in saved and result["model_step"] > 0
    def plain(key: str) -> str:  # a checkpoint names the adapter's tensors as the model has them, PEFT without
        return key.replace(".default.", ".").removeprefix("base_model.model.")

    kept = {plain(key): value for key, value in saved[result["model_step"]].items()}
    exported = {plain(key): value for key, value in adapter(run_dir).items()}
    assert exported.keys() == kept.keys() and all(torch.equal(exported[key], kept[key]) for key in kept)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
                                        run_dir / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
