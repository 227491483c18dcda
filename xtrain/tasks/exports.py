"""`xtrain.load_model(run_dir)`: the trained model a run dir's `model/` holds, as its task exported it."""

from __future__ import annotations

from pathlib import Path


def load_model(run_dir: str | Path):
    """The trained module: a model by `_target_` built from its recorded node with the trained weights loaded;
    a transformers model through `AutoModelFor{SequenceClassification,ImageClassification,CausalLM}.from_pretrained`
    as its config names it."""
    from xtrain.core import rundir
    from xtrain.tasks import custom

    path = Path(run_dir) / rundir.MODEL
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
