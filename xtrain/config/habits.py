"""The names other tools give xtrain's settings: PyTorch Lightning's Trainer (`trainer.*`, as lightning-hydra-template
composes it), lightning-hydra-template's own top-level keys, and the HF Trainer's `TrainingArguments`. One table,
read by the refusal of a setting xtrain does not have and by the configuration reference."""

from __future__ import annotations

from dataclasses import dataclass, field

PRECISIONS = {"16-mixed": "fp16", "16": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16": "bf16",
              "bf16-true": "bf16", "32": "fp32", "32-true": "fp32", "transformer-engine": "fp8"}
STRATEGIES = {"ddp": "ddp", "ddp_spawn": "ddp", "auto": "ddp", "fsdp": "fsdp", "deepspeed_stage_1": "zero1",
              "deepspeed_stage_2": "zero2", "deepspeed_stage_3": "zero3", "deepspeed": "zero2"}
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "none": "none", "csv": "none", "null": "none"}
TRUE = ("true", "1", "yes")
METRICS = {"acc": "accuracy"}  # Lightning modules' usual short names of the metrics xtrain computes


@dataclass(frozen=True)
class Habit:
    setting: str  # xtrain's setting (a group, where the value picks an option)
    tool: str  # whose name it is
    values: dict[str, str] = field(default_factory=dict)  # their value -> xtrain's, where they differ
    closed: bool = False  # `values` is every value that maps (others are refused, listing xtrain's)
    flag: bool = False  # a switch: `bf16=true` is `precision=bf16`
    note: str = ""  # what differs beyond the name


LIGHTNING, LHT, HF = "Lightning's", "lightning-hydra-template's", "the HF Trainer's"

HABITS: dict[str, Habit] = {
    "seed": Habit("trainer.seed", LHT),
    "logger": Habit("tracker", LHT, TRACKERS, closed=True, note="metrics.jsonl is written whatever the tracker"),
    "ckpt_path": Habit("resume", LHT, {"last": "auto"}, note="a checkpoint dir, or auto: the run dir's newest"),
    "callbacks": Habit("trainer.callbacks", LHT),
    "data.batch_size": Habit("trainer.batch_size", LHT, note="per process, before trainer.grad_accum"),
    "trainer.gradient_clip_val": Habit("trainer.max_grad_norm", LIGHTNING),
    "trainer.accumulate_grad_batches": Habit("trainer.grad_accum", LIGHTNING),
    "trainer.precision": Habit("precision", LIGHTNING, PRECISIONS, closed=True),
    "trainer.devices": Habit("cluster.num_processes", LIGHTNING, {"-1": "auto"}, note="processes on each node"),
    "trainer.num_nodes": Habit("cluster.nodes", LIGHTNING),
    "trainer.strategy": Habit("strategy", LIGHTNING, STRATEGIES, closed=True),
    "trainer.accelerator": Habit("", LIGHTNING, note="xtrain trains on the GPUs it finds, and on the CPU where there "
                                                     "are none: drop it"),
    "trainer.min_epochs": Habit("", LIGHTNING, note="xtrain trains trainer.max_epochs or trainer.max_steps, with no "
                                                    "minimum before trainer.early_stop_patience may stop it: drop it"),
    "trainer.fast_dev_run": Habit("debug", LIGHTNING, {"true": "fdr", "1": "fdr"}, closed=True,
                                  note="a few steps on a few batches, evals and a checkpoint included"),
    "num_train_epochs": Habit("trainer.max_epochs", HF),
    "trainer.log_every_n_steps": Habit("trainer.log_every", LIGHTNING),
    "trainer.val_check_interval": Habit("trainer.eval_every", LIGHTNING, note="in optimizer steps"),
    "trainer.check_val_every_n_epoch": Habit("trainer.eval_every", LIGHTNING, note="in optimizer steps"),
    "trainer.default_root_dir": Habit("run_dir", LIGHTNING),
    "trainer.logger": Habit("tracker", LIGHTNING, TRACKERS, closed=True),
    "learning_rate": Habit("trainer.lr", HF),
    "per_device_train_batch_size": Habit("trainer.batch_size", HF),
    "gradient_accumulation_steps": Habit("trainer.grad_accum", HF),
    "max_steps": Habit("trainer.max_steps", HF),
    "warmup_steps": Habit("trainer.warmup_steps", HF),
    "weight_decay": Habit("trainer.weight_decay", HF),
    "max_grad_norm": Habit("trainer.max_grad_norm", HF),
    "logging_steps": Habit("trainer.log_every", HF),
    "eval_steps": Habit("trainer.eval_every", HF),
    "save_steps": Habit("trainer.save_every", HF),
    "save_total_limit": Habit("trainer.keep_checkpoints", HF),
    "output_dir": Habit("run_dir", HF),
    "resume_from_checkpoint": Habit("resume", HF, {"true": "auto"}),
    "metric_for_best_model": Habit("trainer.monitor", HF, note="eval metrics are named val_<name>, e.g. val_loss"),
    "load_best_model_at_end": Habit("trainer.export", HF, {"true": "best", "false": "last"}, closed=True),
    "bf16": Habit("precision", HF, {"true": "bf16"}, closed=True, flag=True),
    "fp16": Habit("precision", HF, {"true": "fp16"}, closed=True, flag=True),
    "torch_compile": Habit("trainer.compile", HF),
    "report_to": Habit("tracker", HF, TRACKERS, closed=True),
    "lr_scheduler_type": Habit("trainer.scheduler", HF, note="xtrain's default is warmup then cosine decay to "
                                                              "trainer.min_lr_ratio; a schedule of your own by _target_"),
    "optim": Habit("trainer.optimizer", HF, note="AdamW by default; an optimizer of your own by _target_"),
}


def _lookup(name: str) -> Habit | None:
    """A table entry for `name`; the HF Trainer's flat names are also taken under `trainer.`."""
    habit = HABITS.get(name)
    if habit is None and name.startswith("trainer."):
        flat = HABITS.get(name[len("trainer."):])
        habit = flat if flat is not None and flat.tool == HF else None
    return habit


def choices(setting: str) -> list[str]:
    """A config group's options (its YAML files), where `setting` is a group."""
    from importlib.resources import files

    folder = files("xtrain.conf").joinpath(setting)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml")) if folder.is_dir() else []


def refusal(name: str, value: str | None) -> str | None:
    """The one line for `name=value`, another tool's name for one of xtrain's settings: xtrain's name, and the
    override that does what was meant where the value maps. None where `name` is no tool's known name."""
    habit = _lookup(name)
    if habit is None:
        return None
    given = f"{name}{'' if value is None else '=' + value}"
    if not habit.setting:
        return f"{given}: {habit.tool} setting; {habit.note}"
    said = f"{given}: {habit.tool} name for xtrain's {habit.setting}"
    if habit.flag and str(value).lower() not in TRUE:
        return f"{said}; drop it (xtrain's default is precision=fp32)"
    mapped = habit.values.get(str(value).lower(), None if habit.closed else value)
    shown = mapped if value is not None and mapped is not None else "|".join(choices(habit.setting)) or "VALUE"
    return f"{said}; give {habit.setting}={shown}" + (f" ({habit.note})" if habit.note else "")


def rows() -> list[tuple[str, str, str]]:
    """The table as the configuration reference shows it: (their name, whose, xtrain's setting and note)."""
    out = []
    for name, habit in HABITS.items():
        means = f"`{habit.setting}`" if habit.setting else ""
        if habit.values:
            means += " (" + ", ".join(f"{k} → {v}" for k, v in habit.values.items()) + ")"
        if habit.note:
            means += ("; " if means else "") + habit.note
        out.append((f"`{name}`", habit.tool.removesuffix("'s"), means))
    return out


def eval_value(name: str) -> str:
    """An eval value's name as xtrain records it: Lightning's `val/acc` is `val_accuracy`, `val/loss` `val_loss`."""
    split, slash, metric = name.partition("/")
    if not slash or "/" in metric or not split:
        return name
    return f"{split}_{METRICS.get(metric, metric)}"
