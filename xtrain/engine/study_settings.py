"""A study's Optuna side, shared by the sweeper that asks and tells (sweeps/study.py) and the trial that reports
from inside training (pruning.py): its settings, storage, sampler and pruner.

The storage is Optuna's journal file in the sweep dir (`study.journal`, its lock a file beside it: safe
across processes and across SLURM nodes on a shared filesystem, where SQLite is not), or the URL the user
gives. A trial's run dir holds `trial.json`, what its trainer needs to report to the study and ask the
pruner: the storage, the study, the trial, the pruner and the objective.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xtrain.config import habits
from xtrain.config.optuna_names import PRUNERS, SAMPLERS
from xtrain.config.task import known_direction
from xtrain.core.errors import ConfigError
from xtrain.core.files import write_atomic

JOURNAL = "study.journal"
STUDY_FILE = "study.json"  # the study as the summary and xtrain.status show it
TRIAL_FILE = "trial.json"

PLOTS = {"history.png": "plot_optimization_history", "importances.png": "plot_param_importances",
         "parallel_coordinate.png": "plot_parallel_coordinate", "slice.png": "plot_slice",
         "intermediate_values.png": "plot_intermediate_values"}  # Optuna's, drawn into the sweep dir at the end
OBJECTIVES = ("val_loss", "val_ppl", "train_loss")  # in result.json at the end, and known at every eval
DIRECTIONS = ("minimize", "maximize")


@dataclass
class StudySettings:
    """`hydra.sweeper.*` of `hydra/sweeper=xtrain_optuna`, checked."""

    storage: str  # a URL, or the journal file's absolute path
    study_name: str
    direction: str = "minimize"
    objective: str = "val_loss"
    pruner: str = "median"
    pruner_settings: dict = field(default_factory=dict)
    sampler: dict = field(default_factory=dict)  # {"_target_": "optuna.samplers.X", **kwargs}
    n_trials: int = 20
    n_jobs: int = 1
    max_retries: int = 0
    examples_per_step: int | None = None  # derived: the smallest effective batch of the space's corners, the unit
    # of the steps a trial reports at (pruning.py)


def validated(s: StudySettings) -> StudySettings:
    """Every setting a study can refuse before anything runs: one line each (an objective in Lightning's form,
    `val/accuracy`, as xtrain names it)."""
    s = dataclasses.replace(s, objective=habits.eval_value(s.objective))
    if s.n_trials < 1:
        raise ConfigError(f"hydra.sweeper.n_trials={s.n_trials}: must be >= 1")
    if s.n_jobs < 1:
        raise ConfigError(f"hydra.sweeper.n_jobs={s.n_jobs}: must be >= 1")
    if s.max_retries < 0:
        raise ConfigError(f"hydra.sweeper.max_retries={s.max_retries}: must be >= 0")
    if s.direction not in DIRECTIONS:
        raise ConfigError(f"hydra.sweeper.direction={s.direction}: must be one of {', '.join(DIRECTIONS)}")
    if s.objective not in OBJECTIVES and not s.objective.startswith("val_"):
        raise ConfigError(f"hydra.sweeper.objective={s.objective}: must be one of {', '.join(OBJECTIVES)}, or "
                          "val_<metric> of the task's metrics (task.metrics)")
    known = known_direction(s.objective)
    if known is not None and s.direction != known:
        better = "higher" if known == "maximize" else "lower"
        raise ConfigError(f"hydra.sweeper.direction={s.direction}: {s.objective} is better when {better}; "
                          f"use hydra.sweeper.direction={known}")
    make_pruner(s.pruner, s.pruner_settings)
    return s


def _build(kind: str, setting: str, class_name: str, kwargs: dict):
    import optuna

    cls = getattr(getattr(optuna, kind), class_name)
    accepted = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise ConfigError(f"{setting}: {class_name} takes no setting {unknown[0]}; it takes {', '.join(accepted)}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, ImportError) as err:
        raise ConfigError(f"{setting}: {class_name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}): "
                          f"{str(err).splitlines()[0]}") from None


def make_pruner(name: str, settings: dict):
    if name not in PRUNERS:
        raise ConfigError(f"hydra.sweeper.pruner={name}: not a pruner; choose one of {', '.join(PRUNERS)}")
    return _build("pruners", "hydra.sweeper.pruner_settings", PRUNERS[name], dict(settings))


def sampler_spec(value, seed) -> dict:
    """hydra.sweeper.sampler as a name (`tpe`, with `hydra.sweeper.seed`) or as hydra-optuna-sweeper writes
    it ({_target_: optuna.samplers.TPESampler, seed: ...}, which Hydra instantiates), as one dict."""
    if hasattr(value, "sample_relative"):  # a sampler Hydra built from its _target_
        return {"_target_": f"optuna.samplers.{type(value).__name__}", "built": value}
    if isinstance(value, str):
        if value not in SAMPLERS:
            raise ConfigError(f"hydra.sweeper.sampler={value}: not a sampler; choose one of {', '.join(SAMPLERS)} "
                              "(or give {_target_: optuna.samplers.<Name>, ...})")
        spec = {"_target_": f"optuna.samplers.{SAMPLERS[value]}"}
        return {**spec, "seed": seed} if seed is not None else spec
    spec = dict(value or {})  # (hydra/sweeper/sampler=tpe's node: {_target_, seed})
    if seed is not None and spec.get("seed") is None:
        spec["seed"] = seed
    return spec


def make_sampler(spec: dict):
    if "built" in spec:
        return spec["built"]
    target = str(spec.get("_target_", ""))
    prefix = "optuna.samplers."
    name = target[len(prefix):] if target.startswith(prefix) else ""
    if name not in SAMPLERS.values():
        raise ConfigError(f"hydra.sweeper.sampler._target_={target or '(none)'}: not a sampler; choose one of "
                          f"{', '.join(prefix + n for n in SAMPLERS.values())}")
    kwargs = {k: v for k, v in spec.items() if not k.startswith("_")}
    return _build("samplers", "hydra.sweeper.sampler", name, kwargs)


def storage_path(value: str | None, sweep_dir: Path) -> str:
    """The storage as trial.json records it: the journal file's absolute path, or the user's URL."""
    if not value:
        return str((Path(sweep_dir) / JOURNAL).resolve())
    if "://" not in value:  # a journal file of the user's
        return str(Path(value).expanduser().resolve())
    return value


def open_storage(storage: str):
    """Optuna's storage object for `storage_path`'s value; a URL that cannot be opened is a ConfigError."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    try:
        if "://" not in storage:
            Path(storage).parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.JournalStorage(JournalFileBackend(storage, lock_obj=JournalFileOpenLock(storage)))
        return optuna.storages.RDBStorage(storage)
    except Exception as err:  # SQLAlchemy's and the drivers' errors have no common base
        raise ConfigError(f"hydra.sweeper.storage={storage}: cannot be opened ({str(err).splitlines()[0]}); give "
                          "a database URL Optuna can open (sqlite:///path/study.db) or leave it unset: "
                          "a journal file in the sweep dir") from None


def load(s: StudySettings, sampler=None):
    """The study as stored, with its pruner; with a `sampler` (the sweeper's), created if it is not there yet.
    A trial's trainer loads it without one: it reports and asks the pruner, and never samples."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(s.storage)
    kwargs = dict(study_name=s.study_name, storage=storage, pruner=make_pruner(s.pruner, s.pruner_settings))
    if sampler is not None:
        return optuna.create_study(direction=s.direction, load_if_exists=True, sampler=sampler, **kwargs)
    return optuna.load_study(**kwargs)


def write_trial_file(run_dir: Path, s: StudySettings, trial_id: int, number: int) -> None:
    record = {"trial_id": trial_id, "number": number, "study": public(s)}
    write_atomic(Path(run_dir) / TRIAL_FILE, json.dumps(record, indent=2) + "\n")


def public(s: StudySettings) -> dict:
    """The settings as files record them (a sampler Hydra built is named, not kept)."""
    record = asdict(s)
    record["sampler"] = {k: v for k, v in s.sampler.items() if k != "built"}
    return record


def read_trial_file(run_dir: Path) -> dict | None:
    path = Path(run_dir) / TRIAL_FILE
    return json.loads(path.read_text()) if path.exists() else None
