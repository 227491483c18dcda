"""`python -m xtrain.eval RUN_DIR [split=val|test|train] [predictions=FILE] [prompts=FILE] [num_processes=N]
[SETTING=VALUE ...]`: a trained run's `model/` evaluated with the run's own task, loss and metrics.

It reads the run dir's run.yaml (with the settings given, `data.*` say, applied over it), loads `model/` as
`xtrain.load_model` does, evaluates the split on this machine (in one process, or N under torchrun as a run would),
prints the values and writes them into the run dir's `eval.json` (by split). `predictions=FILE` writes one JSON line
per example: its index, prediction, scores (classifiers) and target; a language model's are its greedy answers to
`prompts=FILE` (a prompt per line). A run that has not completed is refused unless `incomplete=true`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from xtrain.commands import cli
from xtrain.config import schema
from xtrain.core import rundir, runlock
from xtrain.core.errors import ConfigError, LaunchFailed
from xtrain.core.files import write_atomic
from xtrain.tasks.exports import NotCompleted

EVAL_FILE = "eval.json"
SPLITS = ("val", "test", "train")
OPTIONS = {"split": "val", "predictions": None, "prompts": None, "num_processes": "1", "incomplete": "false"}
USAGE = __doc__.split("\n\n")[0].removeprefix('"""')


def parse(argv: list[str]) -> tuple[Path, dict, list[str]]:
    """(the run dir, the command's options, the settings to apply over run.yaml)."""
    if not argv or "=" in argv[0]:
        raise ConfigError("give the run dir first: python -m xtrain.eval RUN_DIR [split=test] ...")
    options, overrides = dict(OPTIONS), []
    for arg in argv[1:]:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"{arg}: give KEY=VALUE (split=test, predictions=FILE, or a run setting)")
        if key in OPTIONS:
            options[key] = value
        else:
            overrides.append(arg)
    if options["split"] not in SPLITS:
        raise ConfigError(f"split={options['split']}: choose {', '.join(SPLITS)}")
    if not options["num_processes"].isdigit() or int(options["num_processes"]) < 1:
        raise ConfigError(f"num_processes={options['num_processes']}: must be a whole number >= 1")
    return Path(argv[0]), options, overrides


def run_config(run_dir: Path, overrides: list[str]):
    """run.yaml, with `overrides` (`key=value`, `+key=value`) applied and the whole checked again."""
    import yaml
    from omegaconf import OmegaConf

    path = run_dir / rundir.RUN_CONFIG
    if not path.is_file():
        raise ConfigError(f"{run_dir}: {'no such directory' if not run_dir.exists() else 'not a run dir (no run.yaml)'}")
    from omegaconf.errors import OmegaConfBaseException

    try:
        config = OmegaConf.load(path)
    except (yaml.YAMLError, UnicodeDecodeError, OmegaConfBaseException) as err:
        raise rundir.unreadable(path, err) from None
    if not OmegaConf.is_dict(config):
        raise rundir.unreadable(path, "not a run config")
    for override in overrides:
        key, _, value = override.partition("=")
        if not key.startswith("+") and OmegaConf.select(config, key, default=KeyError) is KeyError:
            raise ConfigError(f"{override}: the run has no setting {key}; add one with +{key}=...")
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{override}: not a value (a number, a word, [a list] or {{a: mapping}})") from None
        group = OmegaConf.select(config, key.lstrip("+"))
        if OmegaConf.is_dict(group) and not isinstance(value, dict):  # `precision=bf16`: run.yaml holds it resolved
            raise ConfigError(f"{override}: the run's {key} is its settings ({', '.join(list(group)[:3])}, ...), not "
                              f"an option to choose; set one of them, e.g. {key}.{next(iter(group))}=...")
        OmegaConf.update(config, key.lstrip("+"), value, force_add=True)
    try:
        return schema.from_container(config)
    except OmegaConfBaseException as err:
        raise ConfigError(schema.explained(err)) from None


def evaluate_here(run_dir: Path, cfg, options: dict) -> dict | None:
    """The split's values (on the main process; None on the others), eval.json and the predictions written."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from xtrain.engine import evaluation
    from xtrain.tasks.registry import task_for

    from xtrain.core import machine

    machine.name_deepspeed_accelerator()
    split = options["split"]
    task = task_for(cfg)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # (loading a model's shards: a bar in the middle of the output)
    model = checked_model(run_dir, options["incomplete"] == "true")
    if options["prompts"]:
        return answer(accelerator, task, model, run_dir, options)
    data = task.data()
    dataset = {"train": data.train_set, "val": data.val_set, "test": data.test_set}[split]
    if dataset is None:
        raise ConfigError("split=test: the run has no test split; give one (data.test._target_=... for task=custom, "
                          "data.test=[files] for seq_cls and image_cls)")
    loader = DataLoader(dataset, batch_size=cfg.trainer.batch_size, collate_fn=data.collate)
    model, loader = accelerator.prepare(model, loader)
    values, outputs = evaluation.evaluate(accelerator, task, model, loader, keep_outputs=bool(options["predictions"]))
    if not accelerator.is_main_process:
        return None
    result = rundir.read_result(run_dir)
    record = {"step": result.get("model_step"), "examples": len(dataset),
              **{name: value for name, value in values.items()}}
    done = json.loads((run_dir / EVAL_FILE).read_text()) if (run_dir / EVAL_FILE).exists() else {}
    write_atomic(run_dir / EVAL_FILE, json.dumps({**done, split: record}, indent=2) + "\n")
    if options["predictions"]:
        write_predictions(Path(options["predictions"]), outputs, getattr(task, "label_names", None))
    return record


def checked_model(run_dir: Path, incomplete: bool):
    """`load_model`'s model, where model/ matches the digests its export recorded; one line where it does not, or
    where it cannot be loaded."""
    from xtrain.core import owned
    from xtrain.core.errors import one_line
    from xtrain.tasks.exports import load_model

    folder = run_dir if (run_dir / owned.MANIFEST).is_file() else run_dir / rundir.MODEL
    damage = owned.manifest_damage(folder) if folder.is_dir() else None
    if damage:
        raise ConfigError(f"{folder}: {damage}; the model was not loaded: write it again from a checkpoint (python -m "
                          f"xtrain.export {run_dir}), or resume the run")
    try:
        return load_model(run_dir, incomplete=incomplete)
    except (NotCompleted, ConfigError):
        raise
    except Exception as err:  # (transformers, safetensors and json raise many kinds for a damaged model folder)
        raise ConfigError(f"{folder}: cannot be loaded ({type(err).__name__}: {one_line(err)[:160]}); write it "
                          f"again from a checkpoint (python -m xtrain.export {run_dir}), or resume the run") from None


def write_predictions(path: Path, outputs, label_names) -> None:
    """One JSON line per example, in the split's order."""
    from xtrain.tasks import metrics

    if outputs is None:
        raise ConfigError("predictions=...: this task's eval gives no per-example outputs; for a language model give "
                          "prompts=FILE (a prompt per line)")
    preds = outputs.preds().tolist()
    scores = outputs.probs(per_class=True).tolist() if outputs.problem in metrics.CLASSIFICATION else None
    lines = []
    for i, (pred, target) in enumerate(zip(preds, outputs.targets.tolist())):
        row = {"index": i, "prediction": pred}
        if label_names and isinstance(pred, int):
            row["label"] = label_names[pred]
        if scores is not None:
            row["scores"] = scores[i]
        lines.append(json.dumps({**row, "target": target}))
    write_atomic(path, "\n".join(lines) + "\n")


def answer(accelerator, task, model, run_dir: Path, options: dict) -> dict:
    """A language model's greedy answers to each prompt of `prompts=FILE`, as predictions."""
    prompts = [line for line in Path(options["prompts"]).read_text().splitlines() if line.strip()]
    task.data()  # (its tokenizer)
    model = accelerator.prepare(model)
    model.eval()
    answers = task.samples(accelerator.unwrap_model(model), prompts, task.cfg.trainer.sample_max_tokens)
    if options["predictions"] and accelerator.is_main_process:
        write_atomic(Path(options["predictions"]), "".join(
            json.dumps({"index": i, "prompt": p, "answer": a}) + "\n" for i, (p, a) in enumerate(zip(prompts, answers))))
    return {"prompts": len(prompts), "answered": options["predictions"] or "(no predictions=FILE given)"}


def launch(run_dir: Path, processes: int, argv: list[str]) -> None:
    """N processes under torchrun, each evaluating its share (the sampler's), the main one writing."""
    from xtrain.launch import supervisor

    workdir = run_dir / "logs" / "eval"
    topology = supervisor.Topology(1, 0, processes, "127.0.0.1", None)
    code = supervisor.supervise(topology, workdir, ["xtrain.commands.evaluate", "--worker", *argv], {})
    if code != 0:
        error = rundir.first_rank_error(workdir)
        if error is not None and error["config_error"]:
            raise ConfigError(error["summary"])
        raise LaunchFailed(f"eval failed: {error['summary'] if error else f'exit code {code}'} (see {workdir})", 1)


PRELOAD = ("xtrain.engine.loop", "transformers.modeling_utils")  # what each rank imports: once, by the agent


def run(argv: list[str]) -> None:
    """One of `launch`'s ranks (`--worker ...`), started by the launcher's agent."""
    main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = cli.command_argv(__doc__, argv)
    if argv is None:
        return
    worker = argv[:1] == ["--worker"]
    argv = argv[1:] if worker else argv
    try:
        run_dir, options, overrides = parse(argv)
        cfg = run_config(run_dir, overrides)
        with runlock.holding(run_dir, take=not worker):  # (it writes eval.json: never while the run trains)
            if int(options["num_processes"]) > 1 and not worker:
                launch(run_dir, int(options["num_processes"]), argv)
                record = json.loads((run_dir / EVAL_FILE).read_text())[options["split"]]
            else:
                from xtrain.launch.worker import configure_logging

                configure_logging()
                record = evaluate_here(run_dir, cfg, options)
    except NotCompleted as err:
        cli.fail(str(err))
    except ConfigError as err:
        if worker:
            from xtrain.launch.worker import write_error

            write_error(run_dir / "logs" / "eval", int(__import__("os").environ.get("RANK", 0)), err, None)
        cli.fail(str(err))
    except LaunchFailed as err:
        print(f"xtrain.eval: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    if worker:  # a fork of the launcher's agent: it ends without the interpreter's teardown
        return
    if record is not None and "answered" in record:
        print(f"answered {record['prompts']} prompt(s): {record['answered']}")
    elif record is not None:
        shown = " | ".join(f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}"
                           for key, value in record.items() if not isinstance(value, list))
        print(f"{options['split']}: {shown}")
        print(f"written: {run_dir / EVAL_FILE}" + (f", {options['predictions']}" if options["predictions"] else ""))


if __name__ == "__main__":
    main()
