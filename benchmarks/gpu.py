"""xtrain side by side with the Hugging Face Trainer on one GPU: the same Llama (856 M parameters: hidden 2048,
16 layers, MLP 5632, 16 heads, vocabulary 16384, tied embeddings), block 1024, batch 16, bf16 autocast over fp32
master weights, AdamW (0.9, 0.95), weight decay 0.1, 5 warmup steps then cosine, the same number of steps.

    python benchmarks/gpu.py [--steps 40] [--out results.md]      # on a GPU: about 5 minutes on an H100
    python benchmarks/gpu.py --smoke                               # on a CPU: the same path on a tiny model
    python benchmarks/gpu.py --wide --only "xtrain compile,xtrain fp8 (torchao) + compile"   # fp8 at a width of 4096

Each configuration runs in a process of its own, one after another: the bf16 matmul peak (8192³, median of 10
after 3), xtrain at its defaults, xtrain with `trainer.compile=true`, xtrain with fp8 (torchao) and compile, the
HF Trainer at its defaults and with `torch_compile=True`. Throughput is the median of the step rates after step
15 (xtrain: its logged windows of 5 steps; the Trainer: a callback's per-step times, the GPU synchronised);
MFU is 6N + 12·L·d·T FLOPs per token over the measured bf16 matmul rate (and over the data sheet's dense peak,
as xtrain's result.json reports it); peak memory is torch's peak allocation; time to first step from the process's
start. The Trainer's part imports nothing from xtrain; it trains on random token ids (throughput does not depend
on the tokens), xtrain on its bundled corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(hidden_size=2048, num_layers=16, num_heads=16, intermediate_size=5632, vocab_size=16384)
SMOKE = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=172, vocab_size=512)
# --wide: Llama 2 7B's width and MLP in 8 blocks (1.69 B parameters), batch 8: fp8's matmuls longer beside its casts
WIDE = dict(hidden_size=4096, num_layers=8, num_heads=32, intermediate_size=11008, vocab_size=16384)
BATCH, BLOCK, WARMUP, AFTER = 16, 1024, 5, 15
RUN_TIMEOUT_S = 300  # one configuration's process, start to end
XTRAIN_RUNS = {
    "xtrain defaults": [],
    "xtrain compile": ["trainer.compile=true"],
    "xtrain fp8 (torchao) + compile": ["precision=fp8", "precision.fp8_backend=torchao", "trainer.compile=true"],
    # fp8's levers, run by name (--only): the MLP alone in fp8, and rowwise scaling
    "xtrain fp8 MLP only + compile": ["precision=fp8", "precision.fp8_backend=torchao", "precision.fp8_skip=[self_attn]",
                                      "trainer.compile=true"],
    "xtrain fp8 rowwise + compile": ["precision=fp8", "precision.fp8_backend=torchao", "precision.fp8_recipe=rowwise",
                                     "trainer.compile=true"],
}
# trainer.compile_tuning: inductor times launch configurations of the kernels it generates (fp8's scaling is such kernels)
XTRAIN_RUNS |= {"xtrain compile + tuned kernels": [*XTRAIN_RUNS["xtrain compile"], "trainer.compile_tuning=true"],
                "xtrain fp8 (torchao) + compile + tuned kernels": [*XTRAIN_RUNS["xtrain fp8 (torchao) + compile"],
                                                                   "trainer.compile_tuning=true"]}
HF_RUNS = {"HF Trainer defaults": False, "HF Trainer torch_compile": True}


def flops_per_token(shape: dict, block: int) -> float:
    d, layers, mlp, vocab = shape["hidden_size"], shape["num_layers"], shape["intermediate_size"], shape["vocab_size"]
    params = layers * (4 * d * d + 3 * d * mlp + 2 * d) + vocab * d + d
    return 6.0 * params + 12.0 * layers * d * block


def matmul_peak() -> float:
    """The GPU's bf16 matmul rate in FLOP/s (8192³, median of 10 after 3)."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(13):
        torch.cuda.synchronize()
        began = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - began)
    return 2 * n**3 / statistics.median(times)


def run_xtrain(name: str, extra: list[str], shape: dict, steps: int, block: int, batch: int, work: Path,
               smoke: bool) -> dict:
    run_dir = work / "_".join(re.findall(r"[A-Za-z0-9]+", name))  # (a comma in an override would be a sweep)
    settings = [
        f"run_dir={run_dir}", "model=tiny_llama", *(f"model.{k}={v}" for k, v in shape.items()),
        f"data.block_size={block}", f"trainer.batch_size={batch}", f"trainer.max_steps={steps}",
        f"trainer.warmup_steps={WARMUP}", "trainer.log_every=5", f"trainer.eval_every={steps}",
        f"trainer.save_every={steps}", "trainer.lr=3e-4", "trainer.weight_decay=0.1", "data.max_val_tokens=16384",
        *([] if smoke else ["precision=bf16"]), *extra,
    ]
    began = time.time()
    profile = work / f"{run_dir.name}.profile.json"
    command = [sys.executable, __file__, "--xtrain-part", str(profile), "--steps", str(steps), "--", *settings]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"over {RUN_TIMEOUT_S} s"}
    if proc.returncode != 0:
        return {"name": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    result = json.loads((run_dir / "result.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [(r["step"], r["train/tokens_per_s"]) for r in rows if "train/tokens_per_s" in r]
    rates = [rate for step, rate in windows if step > AFTER]
    return {
        "name": name, "parameters": result["model_parameters"], "tokens_per_s": statistics.median(rates),
        "reported_tokens_per_s": result["tokens_per_s"],
        "whole_run_tokens_per_s": result.get("tokens_per_s_whole_run"), "reported_mfu": result.get("mfu"),
        "peak_memory_bytes": max(result.get("peak_device_memory_bytes") or result["peak_rss_bytes"]),
        "time_to_first_step_s": result["time_to_first_step_s"], "wall_s": time.time() - began,
        "windows": [rate for _, rate in windows[1:]],  # (the first holds start-up and compilation)
        "profile": json.loads(profile.read_text()) if profile.exists() else None,
    }


PROFILED = 3  # steps whose kernels are timed: 3 to 5, in the first logged window, which no rate counts
KINDS = {  # a kernel's kind, by the first of these its name contains
    "fp8 matmul": ("e4m3", "e5m2", "f8f8", "fp8", "_qrtst_", "_qqtst_"),  # (cuBLAS's fp8 kernels: q for e4m3, r e5m2)
    "bf16/fp32 matmul": ("gemm", "xmma", "cutlass", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm"),
    "attention": ("flash", "fmha", "attention"),
    "optimizer": ("adam",),
    "compiled (triton)": ("triton",),
}


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, marks in KINDS.items() if any(mark in name for mark in marks)), "other (eager)")


def xtrain_profiled(profile: Path, steps: int, settings: list[str]) -> None:
    """`python -m xtrain` in this process, the GPU kernels of PROFILED steps timed by torch's profiler: per step,
    the time of each kind of kernel and the top kernels, into `profile` as JSON (on a CPU: its operators). The
    profiled steps come after compilation (steps 1 and 2: training's graphs, and the eval's before them) and lie in
    the first logged window, which neither xtrain's steady rate nor the medians above count; the profiler starts
    and stops between steps, outside xtrain's step clock, and its results are read once the run has ended."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    import xtrain.engine.loop as loop
    from xtrain.commands import cli

    first, state = 3, {}
    between_steps = loop.Run.log_eval_save
    gpu = torch.cuda.is_available()

    def sync():
        if gpu:
            torch.cuda.synchronize()

    def profiled(run):
        step = run.progress.step
        if step == first - 1:
            sync()
            state["prof"] = profiler(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU])
            state["prof"].__enter__()
            state["began"] = time.perf_counter()
        elif step == first + PROFILED - 1:
            sync()
            state["step_ms"] = (time.perf_counter() - state["began"]) / PROFILED * 1e3
            state["prof"].__exit__(None, None, None)  # (its results are parsed when first read)
        return between_steps(run)

    loop.Run.log_eval_save = profiled
    sys.argv = ["xtrain", *settings]
    try:
        cli.main()
    finally:
        if "step_ms" in state:
            kernels = {}
            for avg in state["prof"].key_averages():
                if avg.device_type == (DeviceType.CUDA if gpu else DeviceType.CPU):
                    us = avg.self_device_time_total if gpu else avg.self_cpu_time_total
                    kernels[avg.key] = kernels.get(avg.key, 0.0) + us / 1e3 / PROFILED
            kinds = {}
            for name, ms in kernels.items():
                kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + ms
            top = sorted(kernels.items(), key=lambda item: -item[1])[:15]
            profile.write_text(json.dumps({"step_ms": state["step_ms"], "kernels_ms": sum(kernels.values()),
                                           "kinds_ms": kinds, "top_ms": top}))


def hf_trainer(compile_: bool, shape: dict, steps: int, block: int, batch: int, out: Path, smoke: bool) -> None:
    """The HF Trainer run, in this process (started by `run_hf`): its figures into `out` as JSON."""
    import torch
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    started = float(os.environ["BENCH_STARTED"])
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_layers"],
                         num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_heads"],
                         intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"],
                         max_position_embeddings=block, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)

    class Tokens(Dataset):
        def __init__(self):
            self.ids = torch.randint(0, shape["vocab_size"], (batch * (steps + 1), block),
                                     generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends, self.first = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append((state.global_step, time.perf_counter() - self.began))
            if self.first is None:
                self.first = time.time() - started

    clock = Clock()
    args = TrainingArguments(
        output_dir=str(out.parent / "hf"), per_device_train_batch_size=batch, max_steps=steps, learning_rate=3e-4,
        weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, warmup_steps=WARMUP, lr_scheduler_type="cosine",
        bf16=not smoke, logging_steps=5, save_strategy="no", report_to=[], torch_compile=compile_,
        dataloader_num_workers=0, use_cpu=smoke,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[clock]).train()
    rates = [batch * block / seconds for step, seconds in clock.ends if step > AFTER]
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
    else:  # (the process's peak resident memory, as xtrain reports it on a CPU)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write_text(json.dumps({"parameters": model.num_parameters(), "tokens_per_s": statistics.median(rates),
                               "peak_memory_bytes": peak,
                               "time_to_first_step_s": clock.first}))


def run_hf(name: str, compile_: bool, shape: dict, steps: int, block: int, batch: int, work: Path,
           smoke: bool) -> dict:
    out = work / f"{name.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    began = time.time()
    args = [sys.executable, __file__, "--hf-part", str(out), "--steps", str(steps)] + (["--compile"] if compile_ else [])
    try:
        proc = subprocess.run(args + (["--smoke"] if smoke else []) + (["--wide"] if shape is WIDE else []),
                              capture_output=True, text=True,
                              env={**os.environ, "BENCH_STARTED": str(began)}, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"over {RUN_TIMEOUT_S} s"}
    if proc.returncode != 0:
        return {"name": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return {"name": name, **json.loads(out.read_text()), "wall_s": time.time() - began}


def table(rows: list[dict], peak: float | None, per_token: float, sheet: float | None) -> str:
    lines = ["| run | tokens/s (median after step 15) | MFU vs measured matmul | MFU vs data sheet | "
             "xtrain reports (steady / whole run / mfu) | peak memory | first step | wall |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | |")
            continue
        mfu = f"{per_token * r['tokens_per_s'] / peak:.1%}" if peak else "-"
        sheet_mfu = f"{per_token * r['tokens_per_s'] / sheet:.1%}" if sheet else "-"
        reported = (f"{r['reported_tokens_per_s']:,.0f} / {r['whole_run_tokens_per_s']:,.0f} / "
                    f"{r['reported_mfu'] if r['reported_mfu'] is not None else '-'}" if "reported_tokens_per_s" in r else "")
        lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {mfu} | {sheet_mfu} | {reported} | "
                     f"{r['peak_memory_bytes'] / 2**30:.1f} GiB | {r['time_to_first_step_s']:.1f} s | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


def breakdown(rows: list[dict]) -> str:
    """Where xtrain's steps spend the GPU's time: ms per step by kind of kernel, and each run's top kernels."""
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return ""
    kinds = [*KINDS, "other (eager)"]
    lines = ["", "", f"GPU time per step by kind of kernel (ms; torch's profiler over steps 3 to {2 + PROFILED}):", "",
             "| run | step (wall) | kernels | " + " | ".join(kinds) + " |", "| --- " * (len(kinds) + 3) + "|"]
    for r in profiled:
        p = r["profile"]
        cells = " | ".join(f"{p['kinds_ms'].get(kind, 0.0):.1f}" for kind in kinds)
        lines.append(f"| {r['name']} | {p['step_ms']:.1f} | {p['kernels_ms']:.1f} | {cells} |")
    for r in profiled:
        lines += ["", f"{r['name']}, top kernels (ms per step):", ""]
        lines += [f"- {ms:.2f} {name[:140]}" for name, ms in r["profile"]["top_ms"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: the path, not figures")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    parser.add_argument("--only", help="comma-separated run names to run, in that order (default: all)")
    parser.add_argument("--wide", action="store_true", help="a model of width 4096 (8 blocks, batch 8) instead")
    parser.add_argument("--hf-part", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--xtrain-part", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("settings", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape, block, batch = (SMOKE, 32, 4) if args.smoke else (WIDE, BLOCK, 8) if args.wide else (SHAPE, BLOCK, BATCH)
    if args.hf_part:
        hf_trainer(args.compile, shape, args.steps, block, batch, args.hf_part, args.smoke)
        return
    if args.xtrain_part:
        xtrain_profiled(args.xtrain_part, args.steps, args.settings)
        return
    chosen = args.only.split(",") if args.only else None
    unknown = [name for name in chosen or [] if name not in XTRAIN_RUNS and name not in HF_RUNS]
    if unknown:
        parser.error(f"--only: no run named {', '.join(map(repr, unknown))}; the runs: {', '.join([*XTRAIN_RUNS, *HF_RUNS])}")
    peak = sheet = None
    if not args.smoke:
        import torch

        peak = matmul_peak()
        name = torch.cuda.get_device_name()
        print(f"{name}: bf16 matmul {peak / 1e12:.0f} TFLOP/s; model {shape}, block {block}, batch {batch}", flush=True)
        sheet = next((p[0] * 1e12 for key, p in _sheet().items() if key in name), None)
    # all: the quick ones first (a time limit cuts the slowest); --only: in the order given
    order = chosen or ["xtrain defaults", "HF Trainer defaults", "xtrain compile", "HF Trainer torch_compile",
                       "xtrain fp8 (torchao) + compile"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in order:
            if args.smoke and ("fp8" in name or "torch_compile" in name or "tuned" in name):  # (GPU only)
                continue
            if name in XTRAIN_RUNS:
                extra = XTRAIN_RUNS[name] + (["trainer.compile=false"] if args.smoke else [])
                rows.append(run_xtrain(name, extra, shape, args.steps, block, batch, work, args.smoke))
            else:
                rows.append(run_hf(name, HF_RUNS[name], shape, args.steps, block, batch, work, args.smoke))
            print(json.dumps(rows[-1]), flush=True)
    text = table(rows, peak, flops_per_token(shape, block), sheet)
    ratios = {r["name"]: r["tokens_per_s"] for r in rows if "error" not in r}
    sizes = {r["name"]: r["parameters"] for r in rows if "parameters" in r}
    notes = [f"every run trains the same model: {next(iter(sizes.values())):,} parameters" if len(set(sizes.values())) == 1
             else "the runs' models differ: " + ", ".join(f"{name} {n:,}" for name, n in sizes.items())] if sizes else []
    for a, b in (("xtrain defaults", "HF Trainer defaults"), ("xtrain compile", "HF Trainer torch_compile"),
                 ("xtrain fp8 (torchao) + compile", "xtrain compile"), ("xtrain fp8 MLP only + compile", "xtrain compile"),
                 ("xtrain fp8 rowwise + compile", "xtrain compile"), ("xtrain compile + tuned kernels", "xtrain compile"),
                 ("xtrain fp8 (torchao) + compile + tuned kernels", "xtrain compile + tuned kernels"),
                 ("xtrain fp8 (torchao) + compile + tuned kernels", "xtrain compile")):
        if a in ratios and b in ratios:
            notes.append(f"{a} / {b}: {ratios[a] / ratios[b]:.2f}x")
    for r in rows:
        if "windows" in r and r["windows"]:
            notes.append(f"{r['name']}: result.json's steady rate / median of its windows after the first: "
                         f"{r['reported_tokens_per_s'] / statistics.median(r['windows']):.3f}")
    text += "\n\n" + "\n".join(f"- {n}" for n in notes) + breakdown(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def _sheet() -> dict:
    """xtrain's data-sheet table (bf16 column first), read from its source file, so this file imports no xtrain."""
    import ast

    source = (Path(__file__).resolve().parents[1] / "xtrain" / "engine" / "speed.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PEAK_TFLOPS":
            return ast.literal_eval(node.value)
    return {}


if __name__ == "__main__":
    main()
