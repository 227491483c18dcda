"""`xtrain.load_model(run_dir)`: the trained model a run dir's `model/` holds, as its task exported it."""

from __future__ import annotations

from pathlib import Path


class NotCompleted(RuntimeError):
    """The run dir's run has not completed: its `model/` (if any) is not what the run set out to train."""


def load_model(run_dir: str | Path, incomplete: bool = False):
    """The trained module: a model by `_target_` built from its recorded node with the trained weights loaded;
    a transformers model through `AutoModelFor{SequenceClassification,ImageClassification,CausalLM}.from_pretrained`
    as its config names it. A run that has not completed (failed, stopped, pruned, still running) is refused in one
    line; `incomplete=True` loads what its `model/` holds (with `trainer.export=best`, the best eval's so far).
    `run_dir` may be a model directory itself (`python -m xtrain.export`'s)."""
    from xtrain.core import rundir
    from xtrain.tasks import custom

    path = Path(run_dir) / rundir.MODEL
    if any((Path(run_dir) / name).is_file() for name in (custom.MODEL_NODE, "config.json")):  # a model dir itself
        path, incomplete = Path(run_dir), True  # (`python -m xtrain.export`'s: no run to have completed)
    result = rundir.read_result(Path(run_dir))
    status = rundir.shown_status(Path(run_dir)) if result else "no result.json"
    if status != rundir.Status.completed and not incomplete:
        why = f": {result['error']}" if result.get("error") else ""
        held = (f"; its model/ holds step {result['model_step']}'s model: load it with "
                "xtrain.load_model(run_dir, incomplete=True)") if path.is_dir() and "model_step" in result else ""
        raise NotCompleted(f"{run_dir}: the run has not completed ({status}{why}){held}")
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no trained model (the run has not completed)")
    if (path / custom.MODEL_NODE).is_file():
        return custom.load(path)
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSequenceClassification

    architectures = json.loads((path / "config.json").read_text()).get("architectures") or [""]
    if architectures[0].endswith("ForSequenceClassification"):
        return AutoModelForSequenceClassification.from_pretrained(path)
    if architectures[0].endswith("ForImageClassification"):
        return AutoModelForImageClassification.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path)
