"""Studies through the real CLI (`python -m xtrain -m hydra/sweeper=xtrain_optuna ...`): trials pruned at a step
boundary from inside training, two at a time without a batch barrier, a killed study resumed with its running
trial continued from its checkpoint, and every bad input refused before anything is written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import (PACED, REPO, SMALL, assert_equal_weights, assert_one_line_error, read_metrics, read_result,
                      run_xtrain, xtrain_in_process)

STUDY = ["hydra/sweeper=xtrain_optuna", "hydra.sweeper.seed=0"]
# Batches of 4 blocks: a trial's steps are what its pruner judges, not what they learn (a study of 6 such trials
# takes 26 s against 76 s at the default 16).
STEPS = ["trainer.max_steps=30", "trainer.warmup_steps=2", "trainer.log_every=5", "trainer.eval_every=5",
         "trainer.save_every=5", "trainer.batch_size=4"]


def study_trials(sweep_dir: Path) -> list:
    import optuna

    from xtrain.engine import study_settings

    return optuna.load_study(study_name=sweep_dir.name, storage=study_settings.open_storage(str(sweep_dir / study_settings.JOURNAL))).trials


def point_dirs(sweep_dir: Path) -> list[Path]:
    return [sweep_dir / p["dir"] for p in json.loads((sweep_dir / "sweep.json").read_text())["points"]]


@pytest.fixture(scope="module")
def pruned_study(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """8 trials over a learning rate range whose top end diverges; the median pruner after 2 finished trials."""
    sweep_dir = tmp_path_factory.mktemp("study") / "lr"
    proc = run_xtrain("-m", f"run_dir={sweep_dir}", *STUDY, "hydra.sweeper.n_trials=8",
                      "hydra.sweeper.pruner_settings.n_startup_trials=2", "hydra.sweeper.pruner_settings.n_warmup_steps=10",
                      "trainer.lr=tag(log,interval(1e-4,3.0))", *STEPS, *SMALL)
    return sweep_dir, proc


def test_bad_trials_are_pruned_at_a_step_boundary_with_a_checkpoint(pruned_study):
    sweep_dir, _ = pruned_study
    trials = study_trials(sweep_dir)
    assert len(trials) == 8
    states = {t.number: t.state.name for t in trials}
    pruned = [p for p in point_dirs(sweep_dir) if read_result(p)["status"] == "pruned"]
    assert pruned, states
    for path in pruned:
        result = read_result(path)
        number = int(path.name.split("_")[0])
        assert states[number] == "PRUNED"
        stop = result["stop"]["step"]
        assert 10 <= stop < 30 and result["steps"] == stop and stop % 5 == 0  # after the warm-up, at an eval
        assert (path / "checkpoints" / f"step_{stop:08d}" / "xtrain_state.json").exists()
        assert not (path / "model").exists()
        # what the trial reported is what it evaluated, step by step, up to the step it was pruned at
        evals = {r["step"]: r["val/loss"] for r in read_metrics(path) if "val/loss" in r and r["step"] > 0}
        assert trials[number].intermediate_values == pytest.approx(evals)
        assert max(evals) == stop
    for path in point_dirs(sweep_dir):
        result = read_result(path)
        number = int(path.name.split("_")[0])
        expected = {"completed": "COMPLETE", "pruned": "PRUNED", "failed": "FAIL"}[result["status"]]
        assert states[number] == expected
        if expected == "COMPLETE":
            assert trials[number].value == result["val_loss"] and result["steps"] == 30


def test_the_study_marks_the_best_trial_and_draws_its_pictures(pruned_study):
    import matplotlib.image

    sweep_dir, proc = pruned_study
    record = json.loads((sweep_dir / "study.json").read_text())
    completed = {p.name: read_result(p)["val_loss"] for p in point_dirs(sweep_dir) if read_result(p)["status"] == "completed"}
    best = min(completed, key=completed.get)
    assert record["best"]["point"] == best and record["best"]["value"] == completed[best]
    official = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())  # hydra-optuna-sweeper's file
    assert official == {"name": "optuna", "best_params": record["best"]["params"], "best_value": completed[best]}
    assert f"best trial {record['best']['trial']}" in proc.stdout
    summary = (sweep_dir / "summary.md").read_text()
    assert f"**{best}** (best)" in summary and "pruned" in summary and "8 trials; minimize val_loss" in summary
    rows = [line for line in summary.splitlines() if line.startswith("| ") and "_lr=" in line]
    assert len(rows) == 8
    for name in ("sweep.png", "history.png", "importances.png", "parallel_coordinate.png", "slice.png",
                 "intermediate_values.png"):
        image = matplotlib.image.imread(sweep_dir / name)
        assert image.shape[0] > 300 and image.shape[1] > 500 and image.std() > 0.01, name
    status = xtrain_in_process(str(sweep_dir), command="xtrain.status").stdout
    assert "study lr: 8 of 8 trials asked" in status and f"best: {best}" in status


def test_hyperband_prunes_at_its_rungs(tmp_path):
    sweep_dir = tmp_path / "hyperband"
    run_xtrain("-m", f"run_dir={sweep_dir}", *STUDY, "hydra.sweeper.n_trials=6", "hydra.sweeper.pruner=hyperband",
               "hydra.sweeper.pruner_settings.min_resource=5", "hydra.sweeper.pruner_settings.max_resource=30",
               "hydra.sweeper.pruner_settings.reduction_factor=3", "trainer.lr=tag(log,interval(1e-4,3.0))", *STEPS,
               *SMALL)
    steps = {p.name: read_result(p)["steps"] for p in point_dirs(sweep_dir) if read_result(p)["status"] == "pruned"}
    assert steps and set(steps.values()) <= {5, 15}, steps  # min_resource x reduction_factor^k
    assert sum(t.state.name == "PRUNED" for t in study_trials(sweep_dir)) == len(steps)


def test_two_jobs_keep_two_trials_running_until_the_last_is_asked(tmp_path):
    sweep_dir = tmp_path / "parallel"
    run_xtrain("-m", f"run_dir={sweep_dir}", *STUDY, "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2",
               "hydra.sweeper.pruner=none", "trainer.lr=tag(log,interval(1e-3,1e-1))", "trainer.max_steps=10",
               "trainer.eval_every=5", "trainer.log_every=5")
    spans = []
    for path in point_dirs(sweep_dir):
        result = read_result(path)
        start = result["first_step_at"] - result["time_to_first_step_s"]  # the point's process started
        spans.append((start, start + result["wall_time_s"]))
    spans.sort()
    assert len(spans) == 4
    # At most two at once, and each of the 2 trials after the first two started as soon as a slot was free and
    # the driver, which starts its trials one at a time, had started the one before it. Its wait is judged
    # against a trial's length, which a loaded machine stretches alike (measured: 1.2-2.5 s waits for 15-26 s
    # trials, 3.3 s after the slot freed where two slots freed together); a driver that waits for every running
    # trial leaves a slot empty for about a trial's length.
    shortest = min(end - start for start, end in spans)
    for i, (start, _) in enumerate(spans[2:], 2):
        running = [s for s in spans[:i] if s[1] > start + 0.5]
        assert len(running) <= 1, spans
        freed = sorted(end for _, end in spans[:i])[i - 2]  # the slot this one took
        ready = max(freed, spans[i - 1][0])
        assert start - ready < 0.25 * shortest, f"trial {i} started {start - ready:.2f} s after it could ({spans})"


def test_a_killed_study_continues_its_running_trial_from_its_checkpoint(tmp_path):
    sweep_dir = tmp_path / "killed"
    args = ["-m", f"run_dir={sweep_dir}", *STUDY, "hydra.sweeper.n_trials=3", "hydra.sweeper.pruner=none",
            "hydra.sweeper.sampler=random", "trainer.lr=tag(log,interval(1e-3,1e-1))", *STEPS, *PACED]
    proc = subprocess.Popen([sys.executable, "-m", "xtrain", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not list(sweep_dir.glob("1_*/checkpoints/step_00000010/xtrain_state.json")) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    [second] = sweep_dir.glob("1_*")
    assert read_result(second)["status"] == "running"
    assert [t.state.name for t in study_trials(sweep_dir)] == ["COMPLETE", "RUNNING"]
    status = xtrain_in_process(str(sweep_dir), command="xtrain.status").stdout
    assert "study killed: 2 of 3 trials asked (1 complete, 1 running)" in status

    run_xtrain(*args, "resume=auto")
    trials = study_trials(sweep_dir)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    assert len({t.params["trainer.lr"] for t in trials}) == 3  # the resumed sampler did not draw trial 0's again
    restarts = read_result(second)["restarts"]
    assert len(restarts) == 1 and restarts[0]["at_step"] >= 10
    assert trials[1].value == read_result(second)["val_loss"]

    # the continued trial is the run its parameters give unbroken
    lr = trials[1].params["trainer.lr"]
    unbroken = tmp_path / "unbroken"
    run_xtrain(f"run_dir={unbroken}", f"trainer.lr={lr!r}", *STEPS, *SMALL)  # (unpaced: the same numbers)
    assert_equal_weights(second, unbroken)


LR = "trainer.lr=interval(1e-4,1e-2)"
BAD = [
    ([LR, "hydra.sweeper.sampler=annealing"], "hydra.sweeper.sampler=annealing: not a sampler; choose one of tpe"),
    ([LR, "hydra.sweeper.pruner=early"], "hydra.sweeper.pruner=early: not a pruner; choose one of median"),
    ([LR, "hydra.sweeper.pruner_settings.min_resource=2"], "MedianPruner takes no setting min_resource"),
    ([LR, "hydra.sweeper.n_trials=0"], "hydra.sweeper.n_trials=0: must be >= 1"),
    ([LR, "hydra.sweeper.direction=down"], "hydra.sweeper.direction=down: must be one of minimize, maximize"),
    ([LR, "hydra.sweeper.objective=accuracy"], "hydra.sweeper.objective=accuracy: must be one of val_loss"),
    ([LR, "hydra.sweeper.storage=sqlite:////no/such/dir/study.db"],
     "hydra.sweeper.storage=sqlite:////no/such/dir/study.db: cannot be opened"),
    (["trainer.warmup=interval(1,2)"],
     "trainer.warmup names no setting of xtrain's run config; did you mean trainer.warmup_steps?"),
    (["+hydra.sweeper.params.trainer.batch_size='choice(8,'"],
     "hydra.sweeper.params: 'trainer.batch_size=choice(8,' does not parse"),
    (["trainer.batch_size=choice(8,0)"],
     "the search space's corner trainer.batch_size=0 cannot run: trainer.batch_size=0: must be > 0"),
    (["+hydra.sweeper.params.trainer.lr=1e-3"], "hydra.sweeper.params: no search space"),
    (["+hydra.sweeper.params.trainer.lr=interval(1e-4,1e-2)"],
     "+hydra.sweeper.params.trainer.lr=interval(1e-4,1e-2): Hydra reads a sweep here as a sweep of its own settings; "
     "quote the value (\"+hydra.sweeper.params.trainer.lr='interval(1e-4,1e-2)'\") or give it as "
     "trainer.lr=interval(1e-4,1e-2)"),
    (["trainer.lr=interval(1e-2,1e-4)"],
     "hydra.sweeper.params: trainer.lr=interval(1e-2,1e-4): `low <= high` must hold, but got (low=0.01, high=0.0001)"),
    (["trainer.batch_size=range(16,8)"], "trainer.batch_size=range(16,8): the range is empty (a study's range runs "
                                         "from start to stop, stop included)"),
]


@pytest.mark.parametrize("bad", BAD, ids=[b[0][-1].split("=")[0] for b in BAD])
def test_bad_study_input_is_one_line_and_writes_nothing(tmp_path, bad):
    overrides, expected = bad
    proc = xtrain_in_process("-m", f"run_dir={tmp_path / 'study'}", *STUDY, *overrides, check=False)
    assert_one_line_error(proc, expected)
    assert not (tmp_path / "study").exists()


def test_a_study_over_a_grid_sweeps_dir_is_refused(tmp_path):
    sweep_dir = tmp_path / "grid"
    sweep_dir.mkdir()
    (sweep_dir / "sweep.json").write_text('{"points": []}\n')
    proc = xtrain_in_process("-m", f"run_dir={sweep_dir}", *STUDY, "trainer.lr=interval(1e-4,1e-2)", "resume=auto",
                             check=False)
    assert_one_line_error(proc, f"run_dir={sweep_dir}: holds a grid sweep, not a study")


def test_the_search_space_takes_hydra_optuna_sweepers_syntax():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from xtrain.sweeps import search_space

    space = search_space.parse(["trainer.lr=tag(log,interval(1e-5,1e-2))", "trainer.batch_size=choice(8,16,32)",
                                "model.n_layer=range(2,8,2)", "trainer.warmup_steps=tag(int,interval(0,10))",
                                "trainer.max_steps=50"])
    assert space.distributions == {
        "trainer.lr": FloatDistribution(1e-5, 1e-2, log=True),
        "trainer.batch_size": CategoricalDistribution([8, 16, 32]),
        "model.n_layer": IntDistribution(2, 8, step=2),  # as hydra-optuna-sweeper: the stop included
        "trainer.warmup_steps": IntDistribution(0, 10),
    }
    assert space.fixed == ["trainer.max_steps=50"]
    corners = search_space.corners(space)
    assert len(corners) == 2 * 3 * 2 * 2
    assert ["trainer.lr=1e-05", "trainer.batch_size=8", "model.n_layer=2", "trainer.warmup_steps=0"] in corners


# hydra-optuna-sweeper 1.2's distributions for the same overrides (its _impl.py,
# create_optuna_distribution_from_override), in Optuna 3's classes: IntUniformDistribution(low, high, step) is
# IntDistribution, IntLogUniformDistribution IntDistribution(log=True), DiscreteUniformDistribution(low, high, q)
# FloatDistribution(step=q), UniformDistribution and LogUniformDistribution FloatDistribution (log=True).
OFFICIAL = [
    ("choice(1,2,3)", "CategoricalDistribution", dict(choices=(1, 2, 3))),
    ("range(1,3)", "IntDistribution", dict(low=1, high=3, step=1)),  # range's stop: Optuna's inclusive high
    ("range(1,9,2)", "IntDistribution", dict(low=1, high=9, step=2)),
    ("range(0.5,5.5,step=1)", "FloatDistribution", dict(low=0.5, high=5.5, step=1.0)),
    ("shuffle(range(1,3))", "CategoricalDistribution", None),  # (its order is shuffled: the choices are {1, 2})
    ("interval(1,5)", "FloatDistribution", dict(low=1.0, high=5.0, log=False)),  # Hydra's interval: floats
    ("int(interval(1,5))", "IntDistribution", dict(low=1, high=5, log=False)),
    ("tag(log,interval(1e-4,1e-1))", "FloatDistribution", dict(low=1e-4, high=1e-1, log=True)),
    ("tag(log,int(interval(1,64)))", "IntDistribution", dict(low=1, high=64, log=True)),
]


@pytest.mark.parametrize("override,kind,fields", OFFICIAL, ids=[o[0] for o in OFFICIAL])
def test_a_study_samples_the_space_hydra_optuna_sweeper_samples(override, kind, fields):
    from xtrain.sweeps import search_space

    found = search_space.parse([f"trainer.lr={override}"]).distributions["trainer.lr"]
    assert type(found).__name__ == kind
    if fields is None:
        assert sorted(found.choices) == [1, 2]
    for name, value in (fields or {}).items():
        got = getattr(found, name)
        assert (tuple(got) if name == "choices" else got) == value, name


def guide_commands() -> list[list[str]]:
    """The tuning guide's study commands as written (its code blocks' `python -m xtrain -m` lines, continuations
    joined, comments dropped; not the elided `...` ones, nor SLURM's, which its own tests run), and each inline
    `hydra.sweeper.params` form after the guide's first command."""
    import shlex

    text = (REPO / "docs" / "guides" / "tuning.md").read_text()
    blocks = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)).replace("\\\n", " ")
    commands = [shlex.split(line.split("#")[0])[3:] for line in blocks.splitlines()
                if line.strip().startswith("python -m xtrain -m") and "..." not in line and "cluster=slurm" not in line]
    inline = [shlex.split(form)[0] for form in re.findall(r"`(\"\+hydra\.sweeper\.params\.[^`]+)`", text)]
    return commands + [["-m", *commands[0][1:3], form] for form in inline]


def test_hydra_optuna_sweepers_sampler_forms_and_the_sweepers_settings(tmp_path):
    """`hydra/sweeper/sampler=NAME` with `hydra.sweeper.sampler.seed`, as the official plugin takes them; an unknown
    setting of the sweeper, with or without a plus, is one line listing its settings."""
    proc = xtrain_in_process("-m", f"run_dir={tmp_path / 's'}", "hydra/sweeper=xtrain_optuna", "dry_run=true",
                             "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=123", LR)
    assert "sampler RandomSampler" in proc.stdout
    from xtrain.engine import study_settings

    assert study_settings.sampler_spec({"_target_": "optuna.samplers.TPESampler", "seed": None}, 0)["seed"] == 0
    for given in ("hydra.sweeper.samplr=random", "+hydra.sweeper.samplr=random"):
        proc = xtrain_in_process("-m", f"run_dir={tmp_path / 's'}", *STUDY, LR, given, check=False)
        assert_one_line_error(proc, "hydra.sweeper.samplr", "no such setting", "sampler, seed, direction, objective")
    proc = xtrain_in_process("-m", f"run_dir={tmp_path / 's'}", *STUDY, LR, "hydra/sweeper/sampler=grid", check=False)
    assert_one_line_error(proc, "hydra/sweeper/sampler=grid: no such option; choose one of cmaes, gp, nsgaii, qmc, "
                                "random, tpe")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("command", guide_commands(), ids=lambda c: " ".join(c)[:60])
def test_the_tuning_guides_commands_run_as_written(tmp_path, command):
    proc = xtrain_in_process(*[a for a in command if not a.startswith("run_dir=")], f"run_dir={tmp_path / 's'}",
                             "dry_run=true")
    assert "study: dry run: nothing was asked, written or started" in proc.stdout
    assert "corner (trainer.lr=0.0001" in proc.stdout  # (the lr is the space's, in every form)


def test_every_rank_of_a_two_process_trial_stops_where_the_pruner_said(tmp_path):
    """Random sampler, seed 0, draws lr 1e-6, 0.01, 1e-6: the third trial repeats the first (bad) one's curve,
    above the median of the two before it at the first eval, and is pruned there."""
    sweep_dir = tmp_path / "ranks"
    run_xtrain("-m", f"run_dir={sweep_dir}", *STUDY, "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler=random",
               "hydra.sweeper.pruner_settings.n_startup_trials=1", "trainer.lr=choice(0.01,1e-6)",
               "cluster.num_processes=2", "trainer.max_steps=15", "trainer.warmup_steps=0", "trainer.eval_every=5",
               "trainer.log_every=5", "trainer.save_every=15", *SMALL)
    first, second, third = point_dirs(sweep_dir)
    assert [read_result(p)["status"] for p in (first, second, third)] == ["completed", "completed", "pruned"]
    result = read_result(third)
    assert result["world_size"] == 2 and result["stop"]["step"] == 5 and result["stop"]["signal"] == "the pruner"
    saved = third / "checkpoints" / "step_00000005"
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in saved.iterdir()}  # both ranks saved it
    assert [t.state.name for t in study_trials(sweep_dir)] == ["COMPLETE", "COMPLETE", "PRUNED"]


def test_a_failed_trial_is_retried_then_told_failed(tmp_path):
    sweep_dir = tmp_path / "retried"
    proc = run_xtrain("-m", f"run_dir={sweep_dir}", *STUDY, "hydra.sweeper.n_trials=1", "hydra.sweeper.max_retries=1",
                      "trainer.lr=interval(50.0,60.0)", "trainer.warmup_steps=0", "trainer.max_steps=20", check=False)
    assert proc.returncode == 1 and "all 1 trials failed" in proc.stderr
    [trial] = study_trials(sweep_dir)
    assert trial.state.name == "FAIL"
    assert len(trial.user_attrs["retries"]) == 1 and "training diverged" in trial.user_attrs["retries"][0]
    assert proc.stdout.count("retry 1 of 1") == 1
    [point] = point_dirs(sweep_dir)
    assert read_result(point)["status"] == "failed"


def _queue_again_twenty(sweep_dir: str, worker: int, start) -> None:
    """One of a study's SLURM workers putting trials back in the study's queue, under the workers' lock."""
    from xtrain.engine import study_settings
    from xtrain.sweeps import search_space, study, study_on_slurm
    from xtrain.backends import local

    settings = study_settings.StudySettings(storage=str(Path(sweep_dir) / study_settings.JOURNAL), study_name="queue")
    run = study.Study(settings, search_space.parse(["trainer.lr=interval(1e-4,1e-2)"]), Path(sweep_dir), None, local,
                     resume=True)
    run.claiming = lambda: study_on_slurm.claiming(Path(sweep_dir))
    run.optuna = study_settings.load(settings, sampler=study_settings.make_sampler({"_target_": "optuna.samplers.RandomSampler"}))
    start.wait(120)  # all four at once
    for i in range(20):
        run.queue_again(worker * 100 + i)


def test_workers_putting_trials_back_at_once_lose_none(tmp_path):
    """Four processes, as a study's SLURM workers do when their trials fail, each queue 20 trials to run again at
    the same time: the study's queue holds all 80 (read and rewritten under the lock, none is lost)."""
    import multiprocessing

    from xtrain.engine import study_settings
    from xtrain.sweeps import study

    settings = study_settings.StudySettings(storage=str(tmp_path / study_settings.JOURNAL), study_name="queue")
    study_settings.load(settings, sampler=study_settings.make_sampler({"_target_": "optuna.samplers.RandomSampler"}))  # created
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(4)
    workers = [ctx.Process(target=_queue_again_twenty, args=(str(tmp_path), w, start)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
        assert w.exitcode == 0
    queued = study_settings.load(settings).user_attrs[study.AGAIN]
    assert sorted(queued) == sorted(w * 100 + i for w in range(4) for i in range(20))


def test_the_other_nodes_of_a_multi_node_trial_end_when_the_first_nodes_process_does(tmp_path, monkeypatch):
    """Where a study's trials span nodes, the other nodes follow the first (which asks for the trials): while its
    process beats they wait, and end `completed` once it says the study is done; once its beat stops changing for
    SILENT_S (it died without saying so) they end `failed`, not wait out the job's time limit."""
    import threading

    from xtrain.core import rundir
    from xtrain.sweeps import study_on_slurm

    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(study_on_slurm, "BEAT_S", 0.05)
    monkeypatch.setattr(study_on_slurm, "SILENT_S", 1.0)
    done = json.dumps({"job": "7", "restart": 0, "trial": None, "done": True})
    stop = study_on_slurm.beating(tmp_path)
    threading.Timer(3.0, lambda: (tmp_path / rundir.WORKER_TRIAL).write_text(done)).start()
    began = time.monotonic()
    try:
        assert study_on_slurm.trials_named(tmp_path) == {"status": "completed", "trials": []}
        assert time.monotonic() - began >= 3.0  # (waited past SILENT_S while the first node beat)
    finally:
        stop.set()
    (tmp_path / rundir.WORKER_TRIAL).unlink()
    began = time.monotonic()
    ended = study_on_slurm.trials_named(tmp_path)  # (the beat's file is there, no longer changing)
    assert 1.0 <= time.monotonic() - began < 5.0
    assert ended["status"] == "failed" and ended["trials"] == [], ended
    assert ended["error"] == (f"the first node of this worker ({tmp_path}) has not been heard from for 1 s (its process "
                              "ended without saying the study is done); this node stops")
