"""A `hydra.callbacks` entry that records every call (tests.hydra_calls.Recorder: a run started from the repository
finds it, in a process of its own too), and what the tests check of the calls a sweep's jobs got."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.experimental.callback import Callback


class Recorder(Callback):
    """A `hydra.callbacks` entry: every call, as a JSON line in `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, **record) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_multirun_start(self, config, **kwargs) -> None:
        self.write(hook="on_multirun_start")

    def on_job_start(self, config, task_function=None, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig

        self.write(hook="on_job_start", num=config.hydra.job.num, run_dir=config.run_dir, seed=config.trainer.seed,
                   output_dir=HydraConfig.get().runtime.output_dir, task=task_function.__module__)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        value = job_return._return_value
        self.write(hook="on_job_end", num=config.hydra.job.num, status=job_return.status.name,
                   value=value if isinstance(value, float) else str(value), overrides=job_return.overrides,
                   cfg_keys=sorted(job_return.cfg), cfg_run_dir=job_return.cfg.run_dir,
                   hydra_num=job_return.hydra_cfg.hydra.job.num,
                   output_dir=job_return.hydra_cfg.hydra.runtime.output_dir)

    def on_multirun_end(self, config, **kwargs) -> None:
        self.write(hook="on_multirun_end")


def recorded(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def recording(path: Path) -> list[str]:
    """The overrides that record Hydra's callbacks into `path` (the class found from the repository's root too)."""
    return ["+hydra.callbacks.record._target_=tests.hydra_calls.Recorder", f"+hydra.callbacks.record.path={path}"]


def check_jobs(calls: list[dict], sweep_dir: Path, names: list[str], seeds: list[int]) -> None:
    """Each point's `on_job_start` and `on_job_end`, in turn, with its number, run dir, seed and JobReturn."""
    assert [c["hook"] for c in calls] == ["on_multirun_start", *["on_job_start", "on_job_end"] * len(names),
                                          "on_multirun_end"]
    for num, (start, end) in enumerate(zip(calls[1:-1:2], calls[2:-1:2])):
        point = str(sweep_dir / names[num])
        assert start == {"hook": "on_job_start", "num": num, "run_dir": point, "seed": seeds[num], "output_dir": point,
                         "task": "xtrain.commands.cli"}
        assert end["num"] == end["hydra_num"] == num and end["status"] == "COMPLETED"
        assert end["value"] == pytest.approx(json.loads((Path(point) / "result.json").read_text())["val_loss"])  # what Hydra's sweepers optimise
        assert "hydra" not in end["cfg_keys"] and {"trainer", "model", "data"} <= set(end["cfg_keys"])
        assert end["cfg_run_dir"] == end["output_dir"] == point


