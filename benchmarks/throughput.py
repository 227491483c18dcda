"""xtrain's trainer vs a minimal hand-written Accelerate loop: same model, data, batch, seed, one process.

Both loops run `--steps` optimizer steps; throughput is timed over the second half (the first half
warms up allocators and caches). The two alternate `--repeats` times and the medians are compared.
MFU is model FLOPs (6 N + 12 L d T per token, the PaLM formula) over the fp32 matrix-multiply peak
measured here on the same threads (the best of 3 rounds before and 3 after the runs).

    python benchmarks/throughput.py [--steps 120] [--repeats 7] [model=tiny_llama ...]

`--levers` compares xtrain with itself instead: eager, `trainer.compile=true`, and compile with
`trainer.fused_optimizer=true` (on a GPU, e.g. a ~1 B model in bf16: `--levers model.hidden_size=2048
model.num_layers=16 ... precision=bf16`; MFU is then against the GPU's matmul peak in the run's dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

from xtrain.backends.registry import resolve_auto
from xtrain.commands import cli
from xtrain.config import schema
from xtrain.core import rundir
from xtrain.tasks.causal_lm.task import CausalLM
from xtrain.engine.loop import train
from xtrain.engine.optim import build_optimizer, lr_factor
from xtrain.launch import preflight
from xtrain.tasks.causal_lm import model as models


def compose_config(overrides: list[str], run_path: Path, steps: int) -> schema.RunConfig:
    cli.register_schemas()
    with initialize_config_module(config_module="xtrain.conf", version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                f"run_dir={run_path}", f"trainer.max_steps={steps}", f"trainer.log_every={steps // 2}",
                f"trainer.eval_every={steps}", f"trainer.save_every={steps}", *overrides,
            ],
        )
    return resolve_auto(schema.from_container(cfg))


def matmul_peak_gflops(n: int = 2048, dtype=torch.float32, reps: int = 10) -> float:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 8192 if device == "cuda" else n
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def raw_loop_tokens_per_s(cfg: schema.RunConfig, steps: int) -> float:
    """What a user would write by hand with Accelerate, on xtrain's cached data."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(cfg.trainer.seed)
    prepared = CausalLM(cfg).prepare()
    tokenizer, (train_set, _) = prepared.tokenizer, prepared.splits()
    model = models.build(cfg.model, tokenizer, cfg.data.block_size)
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.trainer))
    loader = torch.utils.data.DataLoader(train_set, batch_size=cfg.trainer.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    batches = iter(loader)
    start = None
    for step in range(1, steps + 1):
        if step == steps // 2 + 1:
            start = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), cfg.trainer.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    loss.item()
    elapsed = time.perf_counter() - start
    return (steps - steps // 2) * cfg.trainer.batch_size * cfg.data.block_size / elapsed


def xtrain_tokens_per_s(cfg: schema.RunConfig) -> tuple[float, int]:
    """xtrain's own log window over the second half of the steps (the log at steps/2 starts it)."""
    path = preflight.create_run_dir(cfg)
    result = train(path)
    rows = [json.loads(line) for line in (path / rundir.METRICS).read_text().splitlines()]
    last = [r for r in rows if "train/tokens_per_s" in r][-1]
    assert last["step"] == cfg.trainer.max_steps
    return last["train/tokens_per_s"], result["model_parameters"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--levers", action="store_true", help="eager vs trainer.compile vs compile + fused AdamW")
    parser.add_argument("overrides", nargs="*", help="config overrides, as on the xtrain command line")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.levers:
        return levers(args)

    # the peak is what the machine can do: the best of several rounds, before and after the runs
    peak = max(matmul_peak_gflops() for _ in range(3))
    raw, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            cfg = compose_config(args.overrides, Path(tmp) / f"run{i}", args.steps)
            raw.append(raw_loop_tokens_per_s(cfg, args.steps))
            tokens_per_s, n_params = xtrain_tokens_per_s(cfg)
            ours.append(tokens_per_s)
    peak = max(peak, *(matmul_peak_gflops() for _ in range(3)))
    m = cfg.model
    flops_per_token = 6 * n_params + 12 * m.num_layers * m.hidden_size * cfg.data.block_size
    med_raw, med_ours = statistics.median(raw), statistics.median(ours)
    print(f"model {n_params / 1e6:.2f}M params, batch {cfg.trainer.batch_size} x {cfg.data.block_size} tokens, "
          f"{torch.get_num_threads()} threads, {args.repeats} alternating repeats of {args.steps} steps")
    print(f"hand-written Accelerate loop: {med_raw:8.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in raw)})")
    print(f"xtrain trainer:               {med_ours:8.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in ours)})")
    print(f"ratio xtrain / hand-written:  {med_ours / med_raw:8.3f}")
    print(f"fp32 matmul peak (2048^2):    {peak:8.1f} GFLOP/s")
    print(f"MFU xtrain: {med_ours * flops_per_token / 1e9 / peak:.1%}   hand-written: "
          f"{med_raw * flops_per_token / 1e9 / peak:.1%}")


LEVERS = {"eager": [], "compile": ["trainer.compile=true"],
          "compile + fused AdamW": ["trainer.compile=true", "trainer.fused_optimizer=true"]}


def levers(args) -> None:
    """The speed levers against eager xtrain, alternating; the compile is in the untimed first half."""
    runs: dict[str, list[float]] = {name: [] for name in LEVERS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, overrides in LEVERS.items():
                torch._dynamo.reset()  # each run compiles afresh: dynamo's per-code cache has a size limit
                cfg = compose_config([*args.overrides, *overrides], Path(tmp) / f"{i}-{len(runs[name])}-{len(overrides)}",
                                     args.steps)
                tokens_per_s, n_params = xtrain_tokens_per_s(cfg)
                runs[name].append(tokens_per_s)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.name.value, torch.float32)
    peak = max(matmul_peak_gflops(dtype=dtype) for _ in range(3))
    m = cfg.model
    flops_per_token = 6 * n_params + 12 * m.num_layers * m.hidden_size * cfg.data.block_size
    eager = statistics.median(runs["eager"])
    print(f"model {n_params / 1e6:.2f}M params, batch {cfg.trainer.batch_size} x {cfg.data.block_size} tokens, "
          f"{cfg.precision.name.value}, {args.repeats} alternating repeats of {args.steps} steps; "
          f"{dtype} matmul peak {peak:.0f} GFLOP/s")
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"{name:22s} {median:10.0f} tokens/s  {median / eager:5.2f}x  MFU {median * flops_per_token / 1e9 / peak:6.1%}"
              f"  (runs: {', '.join(f'{x:.0f}' for x in values)})")


if __name__ == "__main__":
    sys.exit(main())
