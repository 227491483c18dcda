"""Goodput: where a run's paid time went, from its first start to its end, every attempt and the time down between
them included; and `trainer.save_every=auto`, the checkpoint interval that loses the least of it.

The span is cut into parts that add up to it:

| part | what |
| --- | --- |
| `startup` | each attempt's start until its first eval or step: imports, the model, the data, a checkpoint loaded |
| `compile` | torch.compile's graphs, wherever they were compiled (a step's, an eval's) |
| `evals` | evals, sample answers and test splits |
| `checkpoint_waits` | what the steps waited for checkpoints (all of a synchronous save; an asynchronous one's copy) |
| `lost` | steps trained again after a restart: the training time of the steps a kill lost |
| `down` | between attempts: from the last the run recorded of one until the next started (a requeued job's wait) |
| `training` | optimizer steps, once each |
| `other` | the rest: log lines, exports, callbacks, the end |

`goodput` is `training` over the span. Young and Daly's interval between checkpoints, from what a save blocks (δ) and
the mean time between failures (M): τ = √(2δM)·(1 + √(δ/2M)/3 + δ/18M) − δ (τ = M where δ ≥ 2M), in steps of the run's
measured time a step.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

PARTS = ("startup", "compile", "evals", "checkpoint_waits", "lost", "down", "training", "other")


def compile_seconds() -> float:
    """torch.compile's time in this process so far (its graphs' forward and backward)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0
    metrics = utils.compilation_time_metrics
    return sum(sum(times) for key, times in metrics.items()
               if key == "_compile.compile_inner" or key.endswith("bw_compiler"))


@dataclass
class Goodput:
    """The run's time, part by part: the attempts before this one (`before`, result.json's breakdown, with this
    restart's time down added) and this one's own, measured as it goes."""

    first_started_at: float  # the run's first attempt's start
    started_at: float  # this attempt's
    before: dict[str, float] = field(default_factory=dict)
    redo: int = 0  # steps this attempt trains again (its restart's steps lost)
    startup: float | None = None
    compile: float = 0.0
    evals: float = 0.0
    steps_s: float = 0.0  # this attempt's optimizer steps (their compile left out)
    steps: int = 0

    @classmethod
    def of(cls, previous: dict, started_at: float, redo: int = 0) -> Goodput:
        """This attempt's, continuing the run's record in `previous` (result.json as the last attempt left it; {} for
        a fresh start)."""
        breakdown = previous.get("goodput_breakdown")
        if not breakdown or "first_started_at" not in previous:
            return cls(first_started_at=started_at, started_at=started_at)
        recorded_until = previous["first_started_at"] + previous["goodput_span_s"]
        before = {part: breakdown.get(f"{part}_s", 0.0) for part in PARTS}
        before["down"] += max(0.0, started_at - recorded_until)
        return cls(previous["first_started_at"], started_at, before, redo)

    def timed(self, part: str, seconds: float, compiled: float) -> None:
        """`seconds` of `part` ("steps" or "evals"), of which `compiled` went to compiling."""
        self.compile += compiled
        if part == "steps":
            self.steps_s += seconds - compiled
            self.steps += 1
        else:
            self.evals += seconds - compiled

    def figures(self, now: float, waits: float) -> dict:
        """result.json's goodput, as of `now` (`waits`: this attempt's checkpoint waits)."""
        per_step = self.steps_s / self.steps if self.steps else 0.0
        lost = min(self.redo, self.steps) * per_step
        own = {"startup": self.startup if self.startup is not None else now - self.started_at,
               "compile": self.compile, "evals": self.evals, "checkpoint_waits": waits, "lost": lost, "down": 0.0,
               "training": self.steps_s - lost}
        own["other"] = max(0.0, (now - self.started_at) - sum(own.values()))
        parts = {part: self.before.get(part, 0.0) + own.get(part, 0.0) for part in PARTS}
        span = now - self.first_started_at
        parts["other"] += span - sum(parts.values())  # (the rounding of the records before: the parts sum to the span)
        return {"goodput": round(parts["training"] / span, 4) if span > 0 else None, "goodput_span_s": round(span, 3),
                "goodput_breakdown": {f"{part}_s": round(parts[part], 3) for part in PARTS},
                "first_started_at": self.first_started_at, "step_s": round(per_step, 6) if self.steps else None}


def duration(seconds: float) -> str:
    """`45s`, `12m05s`, `3h07m`."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def shown(parts: dict[str, float], span: float) -> str:
    """`startup 9%, evals 6%, down 11%`: the parts besides training at 0.5 % of `span` or more."""
    return ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {seconds / span:.0%}" for name, seconds in parts.items()
                     if name != "training_s" and seconds / span >= 0.005)


def text(result: dict) -> str:
    """`goodput 71% of 12m05s (startup 9%, evals 6%, checkpoint waits 1%, down 11%)`, from result.json."""
    span, parts = result.get("goodput_span_s"), result.get("goodput_breakdown") or {}
    if not span or result.get("goodput") is None:
        return "goodput unknown"
    rest = shown(parts, span)
    return f"goodput {result['goodput']:.0%} of {duration(span)}" + (f" ({rest})" if rest else "")


def interval(blocked_s: float, mtbf_s: float, step_s: float) -> int:
    """Young/Daly's checkpoint interval in optimizer steps: what maximises the expected goodput where a save blocks
    `blocked_s`, failures come every `mtbf_s` on average and a step takes `step_s`."""
    d, m = max(blocked_s, 1e-6), mtbf_s
    tau = m if d >= 2 * m else math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (18 * m)) - d
    return max(1, round(tau / max(step_s, 1e-9)))


def observed_mtbf_s(result: dict) -> float | None:
    """The run's own mean time between failures: its span over the restarts that a failure or a kill caused (a stop
    at a step boundary, with its checkpoint, loses nothing and is not one)."""
    failures = sum(r.get("ended") in ("running", "failed") for r in result.get("restarts", []))
    span = result.get("goodput_span_s")
    return span / failures if failures and span else None
