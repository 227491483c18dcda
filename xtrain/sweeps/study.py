"""A study (`hydra/sweeper=xtrain_optuna`): trials asked from Optuna one at a time, each a sweep point.

Before anything runs, the corners of the search space are composed and preflighted (search_space.py). Then,
whenever a slot is free (`n_jobs` at once, in the backend's `run_points`), the next trial is asked, its
point composed, checked and written (with `trial.json`, so that its trainer reports to the study and asks
the pruner at each eval: engine/pruning.py), and run. When a point ends its trial is told, once: `completed` with its
objective, `pruned`, or `failed` once its retries (`max_retries`, each resuming its own run dir) are spent.
Every trial counts towards `n_trials`. The sweep dir is a sweep dir like any other (sweep.json, the
summary files), plus the study's journal, `study.json` and Optuna's own plots.

Resumed (`run_dir=<sweep dir> resume=auto`): finished trials are kept; a trial that was running continues
from its newest checkpoint in its own run dir (or is only told, where its run had ended); then new trials
until `n_trials`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
from pathlib import Path
from typing import Callable

import yaml

from xtrain.config import schema
from xtrain.config.point import Point
from xtrain.core import owned, rundir
from xtrain.core.errors import ConfigError, SweepFailed
from xtrain.core.files import write_atomic
from xtrain.core.rundir import Status
from xtrain.parallel import dims
from xtrain.engine import study_settings
from xtrain.sweeps import search_space, summary, sweep
from xtrain.sweeps import sweep_dir as sweep_dir_kept

log = logging.getLogger("xtrain")

OPTUNA_BEST_FILE = "optimization_results.yaml"  # hydra-optuna-sweeper's file: the best trial's params and value
AGAIN = "again"  # the study's user attribute: trials to run before new ones are asked
TOLD = {Status.completed: "COMPLETE", Status.pruned: "PRUNED", Status.failed: "FAIL"}


class Study:
    def __init__(self, settings: study_settings.StudySettings, space: search_space.Space, sweep_dir: Path,
                 compose: Callable[[list[str], int], tuple[dict, str | None]], backend, resume: bool,
                 hooks=None) -> None:
        self.s, self.space, self.sweep_dir, self.compose, self.backend = settings, space, sweep_dir, compose, backend
        self.hooks = hooks  # Hydra's callbacks for each trial (`start(point)`, `end(point)`), as for a job
        self.resume = resume
        self.on_slurm = backend.__name__.endswith(".slurm.backend")
        self.corners: list[Point] = []
        self.plans: list[str] = []  # a dry run's: each corner's
        self.claiming = contextlib.nullcontext  # (a lock where several workers ask: study_on_slurm.py)
        self.optuna = None

    # ------------------------------------------------------------ before anything runs

    def held_study(self) -> bool:
        return (self.sweep_dir / study_settings.STUDY_FILE).exists()

    def check(self) -> None:
        """Refuse a space whose corners cannot run, and a sweep dir that holds another run, before writing."""
        owned.check_sweep_dir(self.sweep_dir)
        if rundir.is_sweep_dir(self.sweep_dir) and not self.held_study():
            raise ConfigError(f"run_dir={self.sweep_dir}: holds a grid sweep, not a study; choose a new run_dir")
        if self.held_study() and not self.resume:
            raise ConfigError(f"run_dir={self.sweep_dir}: already holds a study; continue it with resume=auto, "
                              "or choose a new run_dir")
        corners, points = search_space.corners(self.space), []
        for swept in corners:
            try:
                points.append(self.plan(-1, swept, probe=True))
                if points[-1].cfg.dry_run:  # its plan, after every check but this machine's hardware
                    self.plans.append(self.backend.describe(points[-1].cfg, script=False))
                else:
                    sweep.check_point(points[-1], self.backend)
            except ConfigError as err:
                raise ConfigError(f"the search space's corner {' '.join(swept)} cannot run: "
                                  f"{str(err).split(': ', 1)[-1]}") from None
        self.corners = points
        self.s.examples_per_step = min(dims.effective_batch(p.cfg) for p in points)
        objective = self.s.objective
        if objective.startswith("val_"):
            from xtrain.config.task import check_one_number
            from xtrain.tasks.registry import task_for

            setting, task = f"hydra.sweeper.objective={objective}", task_for(points[0].cfg)
            check_one_number(setting, objective, points[0].cfg.task)
            if objective not in ("val_loss", "val_ppl"):  # a metric: one number only where its probe gives one
                check_one_number(setting, objective, points[0].cfg.task, task.check())
            known = task.directions().get(objective)
            if known is not None and known != self.s.direction:
                better = "higher" if known == "maximize" else "lower"
                raise ConfigError(f"hydra.sweeper.direction={self.s.direction}: {objective} is better when {better}; "
                                  f"use hydra.sweeper.direction={known}")
        if not self.on_slurm:
            self.backend.check_points(points, n_jobs=self.s.n_jobs, setting="hydra.sweeper.n_jobs")
        log.info("study: %d trials, %s %s, sampler %s, pruner %s; the space's %d corner(s) checked",
                 self.s.n_trials, self.s.direction, self.s.objective, self.s.sampler["_target_"].split(".")[-1],
                 self.s.pruner, len(corners))

    def dry_run(self) -> None:
        """What the study would do: its settings, its space, the plan of each of its corners (on SLURM, the workers'
        sbatch script). Nothing is asked, written or started."""
        s = self.s
        print(f"study {s.study_name} in {self.sweep_dir}: {s.n_trials} trials, {s.n_jobs} at a time; {s.direction} "
              f"{s.objective}; sampler {s.sampler['_target_'].split('.')[-1]}, pruner {s.pruner}; storage {s.storage}")
        for key, distribution in self.space.distributions.items():
            print(f"  {key}: {distribution}")
        print(f"  the pruner compares trials at equal examples seen: each reports its evals at the steps of a trial of "
              f"{s.examples_per_step} examples a step (the space's smallest effective batch)")
        for point, text in zip(self.corners, self.plans):
            print(f"\ncorner ({point.label}):\n{text}")
        if self.on_slurm:
            from xtrain.backends.slurm.submit import sbatch_script

            count = min(s.n_jobs, s.n_trials)
            script = sbatch_script(self.corners[0].cfg, self.sweep_dir / "logs", array=count, array_parallelism=count)
            print(f"\nsbatch script of the {count} worker(s) (nothing submitted):\n{script}")
        print("study: dry run: nothing was asked, written or started")
        sweep_dir_kept.restore()

    def plan(self, num: int, swept: list[str], probe: bool = False) -> Point:
        """A trial's point: `swept` as sampled; its name and label with 4 significant digits."""
        overrides = [*self.space.fixed, *swept, "resume=auto"]
        # (on SLURM and Ray each trial has nodes of its own; here they share this machine)
        parallel = self.s.n_jobs if self.backend.__name__ == "xtrain.backends.local" else 1
        point = sweep.plan_point(num, overrides, [short(o) for o in swept], self.compose, self.sweep_dir, parallel)
        if probe:  # never written or resumed: a name no trial has
            point.cfg.run_dir, point.cfg.resume = str(self.sweep_dir / ".corner"), "none"
        return point

    # ------------------------------------------------------------ the study

    def open(self, worker: int = 0) -> None:
        """The study, created or loaded; resumed, its running trials queued to continue. Each of a study's
        SLURM `worker`s opens it with a sampler of its own."""
        spec = self.s.sampler
        if (self.resume or worker) and "seed" in spec and "built" not in spec:
            # a sampler seeded as at the start (or as another worker's) would draw the same parameters again
            import numpy as np

            asked = len(study_settings.load(self.s).get_trials(deepcopy=False)) if self.held_study() else 0
            spec = {**spec, "seed": int(np.random.SeedSequence([spec["seed"], asked, worker]).generate_state(1)[0])}
        sampler = study_settings.make_sampler(spec)
        if (self.resume or worker) and "built" in spec:
            sampler.reseed_rng()
        self.optuna = study_settings.load(self.s, sampler=sampler)
        if worker:
            return
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        rundir.add_sweep_points(self.sweep_dir, [])  # sweep.json: the trials join it as they are asked
        if self.resume:
            self.continue_running()

    def continue_running(self) -> None:
        """Trials that were running when the study stopped: continue their points (or tell how they ended)."""
        import optuna

        self.optuna.set_user_attr(AGAIN, [])
        for trial in self.optuna.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            name = trial.user_attrs.get("point")
            path = self.sweep_dir / name if name else None
            if path is None or not (path / rundir.RUN_CONFIG).exists():  # asked, never written: never ran
                self.optuna.tell(trial.number, state=optuna.trial.TrialState.FAIL)
                continue
            point = self.point_of(trial.number)
            status = rundir.read_result(path).get("status")
            if status in (Status.completed, Status.pruned):
                self.tell(point)
            else:
                log.info("trial %d continues from its checkpoint: %s", trial.number, point.label)
                self.queue_again(point.num)

    def point_of(self, number: int) -> Point:
        """A trial's point as written: its run dir's run.yaml."""
        attrs = self.optuna.get_trials(deepcopy=False)[number].user_attrs
        return Point(number, attrs["overrides"], schema.load(str(self.sweep_dir / attrs["point"] / rundir.RUN_CONFIG)))

    def queue_again(self, number: int) -> None:
        """A trial to run (continue, retry) before new ones are asked: kept in the study, for every worker. The
        queue is read and written back under the lock `next_point` takes, or one worker's entry could be lost."""
        with self.claiming():
            self.optuna.set_user_attr(AGAIN, [*self.optuna.user_attrs.get(AGAIN, []), number])

    def next_point(self) -> Point | None:
        """A point to retry or continue, or a new trial's, written and ready; None when every trial is asked."""
        with self.claiming():  # by one worker at a time: what to run next, a new trial asked, sweep.json
            while True:
                again = self.optuna.user_attrs.get(AGAIN, [])
                if again:
                    self.optuna.set_user_attr(AGAIN, again[1:])
                    return self.starting(self.point_of(again[0]))
                if len(self.optuna.get_trials(deepcopy=False)) >= self.s.n_trials:
                    return None
                trial = self.optuna.ask(fixed_distributions=self.space.distributions)
                swept = [search_space.as_override(k, trial.params[k]) for k in self.space.distributions]
                try:
                    point = self.plan(trial.number, swept)
                    sweep.prepare_all([point], self.sweep_dir, self.backend)
                except ConfigError as err:  # this trial's point only (the corners ran): the study goes on
                    log.info("trial %d cannot run: %s", trial.number, err)
                    self.optuna.tell(trial.number, state=study_state("FAIL"))
                    continue
                trial.set_user_attr("point", point.path.name)
                trial.set_user_attr("overrides", point.swept)
                study_settings.write_trial_file(point.path, self.s, trial._trial_id, trial.number)
                self.write_record()  # (xtrain.status counts the running trial)
                return self.starting(point)

    def starting(self, point: Point) -> Point:
        if self.hooks:
            self.hooks.start(self.composed(point))
        return point

    def composed(self, point: Point) -> Point:
        """The trial's job config composed in this process (a continued trial's, for Hydra's callbacks)."""
        if not self.hooks.knows(point):
            params = self.optuna.get_trials(deepcopy=False)[point.num].params
            self.compose([*self.space.fixed, *(search_space.as_override(k, params[k]) for k in self.space.distributions),
                          "resume=auto"], point.num)
        return point

    def on_end(self, point: Point) -> None:
        result = rundir.read_result(point.path)
        status = result.get("status")
        if status == Status.failed:
            trial = self.trial(point.num)
            retries = trial.user_attrs.get("retries", [])  # in the study: each attempt rewrites result.json
            if len(retries) < self.s.max_retries:
                log.info("trial %d failed (%s); retry %d of %d from its newest checkpoint", point.num,
                         result.get("error"), len(retries) + 1, self.s.max_retries)
                trial.set_user_attr("retries", [*retries, result.get("error")])
                self.queue_again(point.num)
                return
        if status in TOLD:
            self.tell(point)
        sweep.report(point)
        self.write_summary(picture=False)  # a slot waits for this: its ~0.5 s picture is drawn at the end
        if self.hooks:
            self.hooks.end(self.composed(point))

    def trial(self, number: int):
        """The running trial `number`, to set its attributes."""
        import optuna

        return optuna.trial.Trial(self.optuna, self.optuna.get_trials(deepcopy=False)[number]._trial_id)

    def tell(self, point: Point) -> None:
        result = rundir.read_result(point.path)
        state = TOLD[result["status"]]
        value = rundir.kept_value(result, self.s.objective) if state == "COMPLETE" else None
        if state == "COMPLETE" and value is None:
            state = "FAIL"
        self.optuna.tell(point.num, value, state=study_state(state))

    # ------------------------------------------------------------ what it leaves

    def write_summary(self, picture: bool = True) -> None:
        self.write_record()
        summary.write(self.sweep_dir, picture)

    def write_record(self) -> None:
        """study.json: the settings, how many trials are in each state, the best so far."""
        best = None
        try:
            trial = self.optuna.best_trial
            best = {"trial": trial.number, "value": trial.value, "params": trial.params,
                    "point": trial.user_attrs.get("point")}
        except ValueError:  # no completed trial yet
            pass
        counts = collections.Counter(t.state.name.lower() for t in self.optuna.get_trials(deepcopy=False))
        record = {**study_settings.public(self.s), "trials": dict(counts), "best": best, "space": list(self.space.distributions)}
        write_atomic(self.sweep_dir / study_settings.STUDY_FILE, json.dumps(record, indent=2, default=str) + "\n")
        if best:  # hydra-optuna-sweeper's record of the best, as it writes it
            write_atomic(self.sweep_dir / OPTUNA_BEST_FILE, yaml.safe_dump(
                {"name": "optuna", "best_params": best["params"], "best_value": best["value"]}, sort_keys=False))

    def run(self) -> None:
        """The trials on this machine, `n_jobs` at a time (on SLURM: study_on_slurm.run)."""
        log.info("study %s in %s (%s)", self.s.study_name, self.sweep_dir, self.s.storage)
        self.write_summary()
        try:
            self.backend.run_points(self.next_point, self.sweep_dir, self.on_end, n_jobs=self.s.n_jobs)
        except KeyboardInterrupt:
            self.write_summary()
            raise SweepFailed([f"study interrupted; continue it with run_dir={self.sweep_dir} resume=auto"], 130) from None
        self.finish()
        self.outcome()

    def finish(self) -> None:
        """Optuna's pictures and the summary, once no trial is left to ask."""
        plots(self.optuna, self.sweep_dir)
        self.write_summary()

    def outcome(self) -> None:
        """The study's last line; SweepFailed where every trial failed."""
        trials = self.optuna.get_trials(deepcopy=False)
        failed = [t for t in trials if t.state.name == "FAIL"]
        best = json.loads((self.sweep_dir / study_settings.STUDY_FILE).read_text())["best"]
        if best:
            log.info("study done: %d trials; best trial %d (%s %.4f): %s", len(trials), best["trial"],
                     self.s.objective, best["value"], best["point"])
        if failed and not best:
            raise SweepFailed([f"all {len(failed)} trials failed; summary: {self.sweep_dir / summary.MARKDOWN}"], 1)


def short(override: str) -> str:
    key, _, value = override.partition("=")
    try:
        number = float(value)
    except ValueError:
        return override
    return override if number == int(number) and "." not in value else f"{key}={number:.4g}"


def study_state(name: str):
    import optuna

    return optuna.trial.TrialState[name]


def plots(optuna_study, sweep_dir: Path) -> list[str]:
    """Optuna's own pictures of the study (its matplotlib backend), in the sweep dir: those its trials allow."""
    import io
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as views

    made = []
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # (its notes on categorical axes are not the user's)
    for name, function in study_settings.PLOTS.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "experimental" warnings of the matplotlib backend
                axes = getattr(views, function)(optuna_study)
        except (ValueError, RuntimeError) as err:  # e.g. importances need 2 completed trials
            log.info("study plot %s: not drawn (%s)", name, str(err).splitlines()[0])
            continue
        if hasattr(axes, "flat"):  # several panels (slice): laid out with their colour bar already
            figure = axes.flat[0].figure
            figure.set_size_inches(4 * len(axes.flat) + 2, 5)
        else:
            figure = axes.figure
            figure.set_size_inches(8, 5)
            figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100)
        plt.close(figure)
        write_atomic(sweep_dir / name, buffer.getvalue())
        made.append(name)
    return made
