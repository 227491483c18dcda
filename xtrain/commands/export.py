"""`python -m xtrain.export RUN_DIR [step=N] [out=DIR]`: a checkpoint of a run as a whole model directory.

Any checkpoint (the newest, or `step=N`) of any strategy (DDP, FSDP2 sharded or full, ZeRO-1/2/3), in one process, no
GPU needed: the model is built as run.yaml describes it, the checkpoint's weights set on it whole (engine/reshard.py),
and the task exports it as the run's `model/` is exported: a Hugging Face model directory (`from_pretrained`), a
custom model's safetensors and its node (`xtrain.load_model(DIR)`); a LoRA run's merged model, with its PEFT
adapter in `DIR/adapter`. `out` (default `RUN_DIR/exports/step_N`) must not exist yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import tempfile
from pathlib import Path

from xtrain.commands import cli
from xtrain.core import owned, rundir
from xtrain.core.errors import ConfigError

OPTIONS = ("step", "out")
EXPORTS = "exports"


def parse(argv: list[str]) -> tuple[Path, dict]:
    if not argv or "=" in argv[0]:
        raise ConfigError("give the run dir first: python -m xtrain.export RUN_DIR [step=N] [out=DIR]")
    options = {}
    for arg in argv[1:]:
        key, sep, value = arg.partition("=")
        if not sep or key not in OPTIONS:
            raise ConfigError(f"{arg}: python -m xtrain.export takes step=N and out=DIR")
        options[key] = value
    if "step" in options and not options["step"].isdigit():
        raise ConfigError(f"step={options['step']}: a step number, as checkpoints/step_N has it")
    return Path(argv[0]), options


def checkpoint_at(run_dir: Path, step: str | None) -> Path:
    """The newest complete checkpoint, or step N's."""
    if not (run_dir / rundir.RUN_CONFIG).is_file():
        raise ConfigError(f"{run_dir}: {'no such directory' if not run_dir.exists() else 'not a run dir (no run.yaml)'}")
    found = rundir.complete_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"{run_dir}: no checkpoint to export (its model/ is the final model, if it completed)")
    path = found[-1] if step is None else rundir.checkpoints_dir(run_dir) / rundir.checkpoint_name(int(step))
    if path not in found:
        steps = ", ".join(str(int(p.name.removeprefix("step_"))) for p in found)
        raise ConfigError(f"step={step}: no checkpoint at that step in {run_dir}; it has step {steps}")
    from xtrain.engine.checkpoint import failure

    why = failure(path)
    if why:
        raise ConfigError(f"{path} fails its check: {why}; give another with step=N")
    return path


@contextlib.contextmanager
def held(run_dir: Path, step: str | None, beside: Path):
    """The checkpoint to export (`checkpoint_at`) as a hard-linked snapshot in `beside`, checked against its digests:
    pruning by a run that trains now cannot remove it under the export (a copy where links cannot be made). A
    checkpoint pruned while it was linked gives way to the newest one (`step` not given)."""
    beside.mkdir(parents=True, exist_ok=True)
    for attempt in range(5):
        checkpoint = checkpoint_at(run_dir, step)
        snapshot = Path(tempfile.mkdtemp(prefix=f".tmp-{checkpoint.name}-", dir=beside))
        try:
            for source in sorted(checkpoint.rglob("*")):
                target = snapshot / source.relative_to(checkpoint)
                if source.is_dir():
                    target.mkdir(exist_ok=True)
                    continue
                try:
                    os.link(source, target)
                except OSError as err:
                    if err.errno == errno.ENOENT:
                        raise
                    shutil.copy2(source, target)
        except FileNotFoundError:  # pruned as it was linked
            shutil.rmtree(snapshot, ignore_errors=True)
            if step is not None:
                raise ConfigError(f"step={step}: the run pruned that checkpoint as it was read; give a newer step") from None
            continue
        try:
            from xtrain.engine.checkpoint import failure

            why = failure(snapshot)
            if why:
                raise ConfigError(f"{checkpoint} fails its check: {why}; give another with step=N")
            yield checkpoint, snapshot
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)
        return
    raise ConfigError(f"{run_dir}: its checkpoints were pruned faster than they could be read; export it again")


def export(run_dir: Path, checkpoint: Path, out: Path) -> None:
    """The model at `checkpoint`, exported into `out` (written aside, then renamed into place)."""
    from accelerate import Accelerator

    from xtrain.config import schema
    from xtrain.config.schema import DdpConfig, LocalConfig
    from xtrain.core import machine
    from xtrain.engine import reshard
    from xtrain.tasks.registry import task_for

    machine.name_deepspeed_accelerator()
    cfg = schema.load(str(run_dir / rundir.RUN_CONFIG))
    # built whole, in this process: as a one-process DDP run builds it
    cfg = dataclasses.replace(cfg, strategy=DdpConfig(), cluster=LocalConfig(num_processes="1"))
    task = task_for(cfg)
    model = task.build(Accelerator(cpu=True)).model
    with reshard.readable(checkpoint, True, lambda: None) as source:
        weights = reshard.with_tied(reshard.model_state(source), model)
    lora = cfg.model.lora.enabled  # (its checkpoint holds the adapter: the base is the pretrained model's)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if unexpected or (missing and not lora) or (lora and trained & set(missing)):
        raise ConfigError(f"{checkpoint}: its weights do not fit the model run.yaml describes "
                          f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        task.export(model, model.state_dict(), tmp)
        made = tmp / rundir.MODEL
        if (tmp / "adapter").is_dir():
            (tmp / "adapter").rename(made / "adapter")
        owned.write_manifest(made)
        made.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    argv = cli.command_argv(__doc__, argv)
    if argv is None:
        return
    try:
        run_dir, options = parse(argv)
        checkpoint = checkpoint_at(run_dir, options.get("step"))
        out = Path(options.get("out") or run_dir / EXPORTS / checkpoint.name)
        if out.exists():
            raise ConfigError(f"out={out}: exists already; give a new directory")
        from xtrain.launch.worker import configure_logging

        configure_logging()
        from xtrain.engine.accelerator import library_notes_quieted

        with library_notes_quieted(), held(run_dir, options.get("step"), out.parent) as (checkpoint, snapshot):
            out = Path(options.get("out") or run_dir / EXPORTS / checkpoint.name)
            if out.exists():
                raise ConfigError(f"out={out}: exists already; give a new directory")
            export(run_dir, snapshot, out)
    except ConfigError as err:
        cli.fail(str(err))
    print(f"exported {checkpoint} to {out}")


if __name__ == "__main__":
    main()
