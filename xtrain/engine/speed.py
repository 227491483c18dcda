"""How fast a run trains, as it reports it.

- **The steady rate** (result.json's `tokens_per_s` / `examples_per_s`): what the logged windows after this
  attempt's first trained, over their time. A window's time is its optimizer steps' alone (evals, checkpoints and
  sample answers are never in one), and the first window, where start-up ends, kernels compile and caches warm,
  is left out (a run of one window reports that one). The whole attempt's rate, from the process's start to the
  end with everything in it, is beside it as `<unit>_per_s_whole_run`.
- **MFU** (model FLOPs utilisation): the model's training FLOPs per token (or example) times the rate, over the
  dense peak of the run's GPUs for its precision (`PEAK_TFLOPS`, by device name; fp8 against the fp8 peak, fp32
  against TF32's where matmuls may use it). A causal LM's FLOPs per token are 6N + 12·L·d·T (N parameters,
  L layers, width d, T the block); any other model's are counted by torch's FLOP counter on one batch (forward
  × 3). A device with no known peak (a CPU) reports none, and says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from xtrain.core import seams

log = logging.getLogger("xtrain")

# Dense (not sparse) TFLOP/s per GPU from the vendors' data sheets: (bf16/fp16, fp8, tf32, fp32). The first name
# found in the device's name wins: more specific names first.
PEAK_TFLOPS = {
    "H100 PCIe": (756.0, 1513.0, 378.0, 51.2),
    "H100 NVL": (835.0, 1671.0, 418.0, 60.0),
    "H100": (989.4, 1978.9, 494.7, 66.9),  # SXM (80GB HBM3)
    "H800": (989.4, 1978.9, 494.7, 66.9),
    "H200": (989.4, 1978.9, 494.7, 66.9),
    "GH200": (989.4, 1978.9, 494.7, 66.9),
    "B200": (2250.0, 4500.0, 1100.0, 80.0),
    "A100": (312.0, None, 156.0, 19.5),
    "L40S": (362.1, 733.0, 183.0, 91.6),
    "L4": (121.0, 242.0, 60.0, 30.3),
    "A10G": (70.0, None, 35.0, 31.2),
}
COLUMN = {"bf16": 0, "fp16": 0, "fp8": 1, "tf32": 2, "fp32": 3}


def peak(device: torch.device, precision: str) -> tuple[float | None, dict]:
    """(one device's dense peak in FLOP/s, what it is: device, precision, TFLOP/s), or (None, why there is none)."""
    if device.type != "cuda":
        if seam := seams.first("peak_tflops"):  # (the suite's, for a CPU: so MFU runs)
            return seam * 1e12, {"device": device.type, "precision": precision, "tflops": seam, "source": "seam"}
        return None, {"unavailable": f"no dense peak is known for a {device.type.upper()}: MFU is reported on GPUs"}
    name = torch.cuda.get_device_name(device)
    kind = "tf32" if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32 else precision
    return dense_peak(name, kind)


def dense_peak(name: str, kind: str) -> tuple[float | None, dict]:
    """`peak` for a GPU by its name and the matmuls' kind (bf16, fp16, fp8, tf32, fp32)."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            tflops = peaks[COLUMN[kind]]
            if tflops is None:
                return None, {"unavailable": f"{name} has no {kind} peak"}
            return tflops * 1e12, {"device": name, "precision": kind, "tflops": tflops}
    return None, {"unavailable": f"no dense peak is known for {name}: add it to xtrain/engine/speed.py's PEAK_TFLOPS"}


def causal_lm_flops(config, n_params: int, block_size: int) -> float | None:
    """6N + 12·L·d·T training FLOPs per token (the parameters' matmuls forward and backward, and attention's)."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not layers or not width:
        return None
    return 6.0 * n_params + 12.0 * layers * width * block_size


def counted_flops(task, model, batch) -> float | None:
    """Training FLOPs per unit (example, token) of `batch`, counted by torch on its forward (× 3: the backward
    is twice the forward's)."""
    from torch.utils.flop_counter import FlopCounterMode

    units = task.count(batch)
    if not units:
        return None
    counter = FlopCounterMode(display=False)
    model.eval()  # (no dropout: the count draws nothing from the generators training uses)
    with torch.no_grad(), counter:
        task.eval_losses(model, batch)
    model.train()
    total = counter.get_total_flops()
    return 3.0 * total / units if total else None


@dataclass
class Speed:
    """The rate and MFU of a run's attempt: its windows, the model's FLOPs per unit and its GPUs' peak."""

    flops_per_unit: float | None = None
    peak_flops: float | None = None  # every rank's together
    peak_info: dict | None = None
    windows: int = 0
    first: tuple[int, float] = (0, 0.0)
    count: int = 0
    seconds: float = 0.0

    def add(self, count: int, seconds: float) -> None:
        """A logged window (in the task's unit, every rank's together)."""
        if self.windows == 0:
            self.first = (count, seconds)
        else:
            self.count += count
            self.seconds += seconds
        self.windows += 1

    def steady(self) -> float:
        count, seconds = (self.count, self.seconds) if self.seconds > 0 else self.first
        return count / seconds if seconds > 0 else 0.0

    def mfu(self, per_s: float) -> float | None:
        if not self.flops_per_unit or not self.peak_flops:
            return None
        return self.flops_per_unit * per_s / self.peak_flops

    def figures(self, unit: str, seen: int, whole_s: float) -> dict:
        """The attempt's figures, as result.json has them."""
        steady = self.steady()
        mfu = self.mfu(steady)
        out = {f"{unit}_per_s": steady, f"{unit}_per_s_whole_run": seen / whole_s if whole_s > 0 else 0.0,
               "mfu": None if mfu is None else round(mfu, 4), "mfu_peak": self.peak_info}
        if self.flops_per_unit:
            out[f"flops_per_{unit.rstrip('s')}"] = self.flops_per_unit
        return out


def measure_speed(cfg, accelerator, c, n_params: int) -> Speed:
    """The model's FLOPs per unit and the world's peak, where MFU can be reported (a GPU with a known peak)."""
    precision = cfg.precision.name.value
    one, info = peak(accelerator.device, precision)
    speed = Speed(peak_info=info)
    if one is None:
        return speed
    speed.peak_flops = one * accelerator.num_processes
    speed.peak_info = {**info, "gpus": accelerator.num_processes}
    config = getattr(accelerator.unwrap_model(c.model), "config", None)
    if c.task.throughput_unit == "tokens" and config is not None:
        speed.flops_per_unit = causal_lm_flops(config, n_params, cfg.data.block_size)
    if speed.flops_per_unit is None:
        batch = next(iter(c.val_loader), None)
        speed.flops_per_unit = None if batch is None else counted_flops(c.task, c.model, batch)
    return speed
