"""Your own loop, complete: on a user project of scikit-learn tables (examples/tabular, copied outside the package),
an optimizer and a schedule of your own, a loss with arguments from the command line, a test split, `xtrain.eval`
and its predictions, callbacks (one that stops the run on every rank), a collate of your own, a Ctrl-C that stops at
a step boundary, workers that never outlive their driver, summaries ranked by the monitor, and one line for each
mistake."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from conftest import (assert_equal_weights, assert_one_line_error, example_project, read_metrics, read_result,
                      run_xtrain, start_xtrain, xtrain_in_process)

EXTRA = '''import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate


def smoothed_ce(outputs, targets, smoothing=0.0):
    return F.cross_entropy(outputs, targets, label_smoothing=smoothing, reduction="none")


def as_dict(items):
    """A collate of the user's: (features, target) pairs as {"features", "target"}; it leaves a mark it ran."""
    open("collated", "a").close()
    features, targets = default_collate(items)
    return {"features": features, "target": targets}


class Slow:
    """The first 20 steps take a while: time to signal before the run ends, and for a second Ctrl-C before the
    first one's step boundary."""

    def on_train_batch_end(self, state, loss):
        import time

        if state.step < 20:
            time.sleep(0.3)


class Failing:
    def on_validation_end(self, state, metrics):
        if state.step > 0:
            raise ValueError("no room for the matrix")


class LightningNamed:
    """A hook xtrain calls, and one only Lightning does."""

    def on_validation_end(self, state, metrics):
        pass

    def on_validation_epoch_end(self, state):
        pass


class Narrow:
    def on_validation_end(self, state):
        pass


class LightningArguments:
    """A Lightning callback's hook: its arguments are Lightning's trainer and module."""

    def on_validation_end(self, trainer, pl_module):
        pass


class Quiet:
    """No hook at all."""


def make_noted() -> Quiet:
    return Quiet()


class Watch:
    """The error on_exception is given, in <run dir>/exception.txt."""

    def on_exception(self, state, error):
        (state.run_dir / "exception.txt").write_text(f"{type(error).__name__}: {error}")


class Noted:
    """Every hook, in order, in <run dir>/hooks.jsonl (on every rank: each writes its own file)."""

    every_rank = True

    def __init__(self):
        self.rank = os.environ.get("RANK", "0")

    def _note(self, state, hook, extra=None):
        with open(state.run_dir / f"hooks{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"hook": hook, "step": state.step, **(extra or {})}) + "\\n")

    def on_train_start(self, state):
        self._note(state, "on_train_start")

    def on_validation_end(self, state, metrics):
        self._note(state, "on_validation_end", {"val_loss": metrics["val_loss"]})

    def on_save_checkpoint(self, state, path):
        self._note(state, "on_save_checkpoint", {"path": str(path)})

    def on_train_end(self, state):
        self._note(state, "on_train_end")
'''

WINE = ["--config-dir", "conf", "experiment=wine"]
SGD = ["trainer.optimizer._target_=torch.optim.SGD", "+trainer.optimizer.momentum=0.9",
       "trainer.scheduler._target_=torch.optim.lr_scheduler.OneCycleLR", "+trainer.scheduler.max_lr=0.1"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return example_project(tmp_path_factory, "tabular", {"extra.py": EXTRA})


@pytest.fixture(scope="module")
def sgd_run(project, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sgd") / "run"
    run_xtrain(*WINE, f"run_dir={run_dir}", *SGD, "trainer.log_every=1", "trainer.save_every=10",
               "data.test._target_=tables.table", "+data.test.name=wine", "+data.test.split=test",
               "trainer.export=best", "trainer.monitor=val_accuracy", cwd=project)
    return run_dir


def test_sgd_with_momentum_on_a_one_cycle_schedule_trains_as_torch_steps_it(sgd_run):
    """Each logged lr is OneCycleLR's at that step (fed trainer.max_steps as total_steps), and the optimizer's
    momentum is the one asked for."""
    import yaml

    recorded = yaml.safe_load((sgd_run / "run.yaml").read_text())["trainer"]
    assert recorded["optimizer"] == {"_target_": "torch.optim.SGD", "momentum": 0.9}
    assert recorded["scheduler"] == {"_target_": "torch.optim.lr_scheduler.OneCycleLR", "max_lr": 0.1}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3, momentum=0.9)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=60)
    expected = []
    for _ in range(60):
        expected.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    logged = [row["train/lr"] for row in read_metrics(sgd_run) if "train/lr" in row]
    assert logged == pytest.approx(expected, rel=1e-9)
    result = read_result(sgd_run)
    assert result["status"] == "completed" and result["val_accuracy"] > 0.9


def test_trainer_lr_is_the_peak_rate_of_a_schedule_that_takes_one(project, tmp_path):
    """OneCycleLR and CyclicLR take their peak as `max_lr`: left unset, it is trainer.lr (as total_steps is
    trainer.max_steps); set, trainer.lr does nothing, so a sweep over it is refused before any point runs and a
    single run says so."""
    from xtrain.config.schema import TrainerConfig
    from xtrain.engine import optim

    for node in ({"_target_": "torch.optim.lr_scheduler.OneCycleLR"},
                 {"_target_": "torch.optim.lr_scheduler.CyclicLR", "base_lr": 0.001, "step_size_up": 10}):
        trainer = TrainerConfig(lr=0.2, max_steps=60, scheduler=node)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.01, momentum=0.9)
        schedule, rates = optim.build_scheduler(optimizer, trainer), []
        for _ in range(60):
            rates.append(schedule.get_last_lr()[0])
            optimizer.step()
            schedule.step()
        assert max(rates) == pytest.approx(0.2) and optim.lr_unused(trainer) is None, node
        assert optim.lr_unused(TrainerConfig(lr=0.2, scheduler={**node, "max_lr": 0.1})) == (
            "trainer.scheduler.max_lr=0.1 sets the peak rate")
    assert optim.lr_unused(TrainerConfig(optimizer={"_target_": "torch.optim.SGD", "lr": 0.1})) == (
        "trainer.optimizer.lr=0.1 sets the rate")
    sweep_dir = tmp_path / "grid"
    proc = run_xtrain("-m", *WINE, f"run_dir={sweep_dir}", *SGD, "trainer.lr=0.05,0.2", check=False, cwd=project)
    assert_one_line_error(proc, "point 0 (trainer.lr=0.05): trainer.lr=0.05: swept, but trainer.scheduler.max_lr=0.1 "
                                "sets the peak rate, so every point would train alike; sweep trainer.scheduler.max_lr "
                                "instead, or leave it unset so that it takes trainer.lr")
    assert not sweep_dir.exists()
    proc = run_xtrain(*WINE, f"run_dir={tmp_path / 'one'}", *SGD, "trainer.lr=0.05", "dry_run=true", cwd=project)
    assert ("trainer.lr=0.05 is not used: trainer.scheduler.max_lr=0.1 sets the peak rate"
            in (proc.stdout + proc.stderr))


def test_a_killed_sgd_one_cycle_run_resumes_bitwise(project, sgd_run, tmp_path):
    run_dir = tmp_path / "run"
    args = [*WINE, f"run_dir={run_dir}", *SGD, "trainer.log_every=1", "trainer.save_every=10",
            "data.test._target_=tables.table", "+data.test.name=wine", "+data.test.split=test",
            "trainer.export=best", "trainer.monitor=val_accuracy"]
    checkpoints = run_dir / "checkpoints"
    proc = start_xtrain(*args, "trainer.max_steps=60", quiet=True, cwd=project)
    deadline = time.monotonic() + 300
    while not (checkpoints / "step_00000010" / "xtrain_state.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if (checkpoints / "step_00000060").exists():
        pytest.fail("the run ended before it could be killed")
    run_xtrain(*args, "resume=auto", cwd=project)
    assert_equal_weights(sgd_run, run_dir)
    assert read_result(run_dir)["test_accuracy"] == read_result(sgd_run)["test_accuracy"]


def test_the_test_split_is_evaluated_on_the_kept_model_and_xtrain_eval_agrees(project, sgd_run, tmp_path):
    """test_<name> are the model/'s (export=best: the best eval's), in result.json and metrics.jsonl;
    `xtrain.eval` on that model gives the run's own val values at the step model/ is from, and the test ones;
    its predictions are the model's, one line per example."""
    result = read_result(sgd_run)
    assert result["model_test"]["step"] == result["model_step"]
    assert {"test_loss", "test_accuracy", "test_auroc"} <= set(result)
    last = read_metrics(sgd_run)[-1]
    assert last["step"] == 60 and last["test/accuracy"] == result["test_accuracy"]
    predictions = tmp_path / "preds.jsonl"
    for split, expected in (("val", result["model_eval"]), ("test", result)):
        proc = xtrain_in_process(str(sgd_run), f"split={split}", f"predictions={predictions}", cwd=project,
                                 command="xtrain.eval")
        record = json.loads((sgd_run / "eval.json").read_text())[split]
        assert record["step"] == result["model_step"]
        for name in ("loss", "accuracy", "auroc"):
            assert record[name] == pytest.approx(expected[f"{split}_{name}"], rel=1e-6), (split, name)
        assert f"{split}: step {result['model_step']}" in proc.stdout
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(rows) == 36 and set(rows[0]) == {"index", "prediction", "scores", "target"}
    assert sum(r["prediction"] == r["target"] for r in rows) / len(rows) == pytest.approx(result["test_accuracy"])
    assert all(r["prediction"] == max(range(3), key=r["scores"].__getitem__) for r in rows)


def test_xtrain_eval_on_two_processes_gives_one_processs_values_and_bad_input_is_one_line(project, sgd_run, tmp_path):
    one = json.loads((sgd_run / "eval.json").read_text())["val"] if (sgd_run / "eval.json").exists() else None
    xtrain_in_process(str(sgd_run), "num_processes=2", cwd=project, command="xtrain.eval")
    two = json.loads((sgd_run / "eval.json").read_text())["val"]
    assert two["loss"] == pytest.approx(read_result(sgd_run)["model_eval"]["val_loss"], rel=1e-6)
    assert two["accuracy"] == read_result(sgd_run)["model_eval"]["val_accuracy"]
    assert one is None or two["accuracy"] == one["accuracy"]
    for args, expected in (([str(sgd_run), "split=dev"], "split=dev: choose val, test, train"),
                           ([str(tmp_path / "nowhere")], f"{tmp_path / 'nowhere'}: no such directory"),
                           ([str(sgd_run), "data.nope=1"], "data.nope=1: the run has no setting data.nope"),
                           ([str(sgd_run), "trainer.lr=fast"], "trainer.lr=fast: not a valid float"),
                           ([str(sgd_run), "trainer.lr=["], "trainer.lr=[: not a value"),
                           ([str(sgd_run), "precision=bf16"], "precision=bf16: the run's precision is its settings "
                                                              "(name, fp8_backend, fp8_recipe, ...), not an option to "
                                                              "choose; set one of them, e.g. precision.name=...")):
        assert_one_line_error(xtrain_in_process(*args, check=False, cwd=project, command="xtrain.eval"), expected)


def test_callbacks_see_every_hook_and_one_that_stops_ends_every_rank_at_a_step_boundary(project, tmp_path):
    """A callback stops the run once val accuracy reaches 0.9: both ranks stop at that eval's step (the main
    process's request, broadcast), each saving its part of the checkpoint; the run is complete, its model exported;
    an every-rank callback saw each hook on both ranks; the user's ConfusionMatrix wrote one file per eval."""
    run_dir = tmp_path / "run"
    run_xtrain(*WINE, f"run_dir={run_dir}", "cluster.num_processes=2", "trainer.batch_size=8",
               "trainer.callbacks=[{_target_: mycallbacks.StopWhen, at: 0.9}, {_target_: extra.Noted}, "
               "{_target_: mycallbacks.ConfusionMatrix}]", cwd=project)
    result = read_result(run_dir)
    stop = result["callback_stop"]
    assert result["status"] == "completed" and result["steps"] == stop["step"] < 60 and stop["step"] % 15 == 0
    assert stop["reason"].startswith("val_accuracy ") and result["model_step"] == stop["step"]
    saved = run_dir / "checkpoints" / f"step_{stop['step']:08d}"
    assert {p.name for p in saved.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    for rank in (0, 1):
        hooks = [json.loads(line) for line in (run_dir / f"hooks{rank}.jsonl").read_text().splitlines()]
        assert hooks[0] == {"hook": "on_train_start", "step": 0} and hooks[-1]["hook"] == "on_train_end"
        assert [h["step"] for h in hooks if h["hook"] == "on_validation_end"] == list(range(0, stop["step"] + 1, 15))
        assert [h["path"] for h in hooks if h["hook"] == "on_save_checkpoint"][-1] == str(saved)
    assert sorted(p.name for p in (run_dir / "confusion").iterdir()) == [
        f"step_{s}.json" for s in sorted(range(0, stop["step"] + 1, 15), key=str)]


def test_a_failing_callback_is_one_line_and_a_failed_run(project, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_xtrain(*WINE, f"run_dir={run_dir}", "trainer.callbacks=[{_target_: extra.Failing}]", check=False,
                      cwd=project)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("xtrain: error: trainer.callbacks[0] (extra.Failing)."
                                                    "on_validation_end raised ValueError: no room for the matrix")
    assert read_result(run_dir)["status"] == "failed"


@pytest.mark.parametrize("spelling", ["task.loss._target_=extra.smoothed_ce", "+task.loss._target_=extra.smoothed_ce",
                                      "++task.loss._target_=extra.smoothed_ce",
                                      "task.loss={_target_: extra.smoothed_ce}"])
def test_a_loss_and_a_collate_of_your_own_from_the_command_line(project, tmp_path, spelling):
    run_dir = tmp_path / "run"
    run_xtrain(*WINE, f"run_dir={run_dir}", spelling, "+task.loss.smoothing=0.1",
               "data.collate_fn._target_=extra.as_dict", "trainer.max_steps=5", "trainer.warmup_steps=1", cwd=project)
    import yaml

    recorded = yaml.safe_load((run_dir / "run.yaml").read_text())
    assert recorded["task"]["loss"] == {"_target_": "extra.smoothed_ce", "smoothing": 0.1}
    assert recorded["data"]["collate_fn"] == {"_target_": "extra.as_dict"}
    assert (project / "collated").exists() and read_result(run_dir)["status"] == "completed"
    # label smoothing keeps the loss of a right answer above 0: the untrained model's val loss is near ln 3 either way
    assert read_result(run_dir)["initial_val_loss"] == pytest.approx(math.log(3), abs=0.5)


def test_a_study_samples_a_keyword_argument_of_your_own_model(project, tmp_path):
    sweep_dir = tmp_path / "study"
    run_xtrain("-m", *WINE, f"run_dir={sweep_dir}", "hydra/sweeper=xtrain_optuna", "hydra.sweeper.n_trials=2",
               "hydra.sweeper.seed=0", "model.hidden=choice(8,16)", "trainer.max_steps=15", "trainer.eval_every=15",
               cwd=project)
    hidden = {json.loads((sweep_dir / p["dir"] / "trial.json").read_text())["number"]:
              __import__("yaml").safe_load((sweep_dir / p["dir"] / "run.yaml").read_text())["model"]["hidden"]
              for p in json.loads((sweep_dir / "sweep.json").read_text())["points"]}
    assert set(hidden.values()) <= {8, 16} and len(hidden) == 2


def test_ctrl_c_stops_at_a_step_boundary_and_the_run_resumes_bitwise(project, tmp_path):
    """The first Ctrl-C: the step's checkpoint, one line naming how to continue, exit 130; resumed, the run ends
    where an unbroken one ends. A second Ctrl-C stops at once, in one line."""
    long = ["trainer.max_steps=200", "trainer.log_every=1", "trainer.eval_every=200", "trainer.save_every=200"]
    slow = "trainer.callbacks=[{_target_: extra.Slow}, {_target_: extra.Watch}]"
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    run_xtrain(*WINE, f"run_dir={whole}", *long, cwd=project)
    proc = subprocess.Popen([sys.executable, "-m", "xtrain", *WINE, f"run_dir={stopped}", *long, slow], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(stopped, proc, 5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    step = read_result(stopped)["stop"]["step"]
    assert proc.returncode == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"xtrain: stopped by SIGINT at step {step} with a checkpoint; to continue, "
                                            f"run the same command with run_dir={stopped} resume=auto")
    assert (stopped / "checkpoints" / f"step_{step:08d}" / "xtrain_state.json").is_file()
    assert (stopped / "exception.txt").read_text() == (f"KeyboardInterrupt: stopped by SIGINT at step {step}; its "
                                                       "checkpoint is saved")
    run_xtrain(*WINE, f"run_dir={stopped}", *long, slow, "resume=auto", cwd=project)
    assert_equal_weights(whole, stopped)
    assert read_result(stopped)["restarts"][0]["steps_lost"] == 0

    twice = tmp_path / "twice"
    proc = subprocess.Popen([sys.executable, "-m", "xtrain", *WINE, f"run_dir={twice}", *long, slow], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(twice, proc, 3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)  # (two signals at once are one: the second must come after the first was taken)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("xtrain: stopped at once by a second SIGINT; to continue")
    assert (twice / "exception.txt").read_text().startswith("KeyboardInterrupt: ")


def wait_for_rows(run_dir, proc, rows: int) -> None:
    deadline = time.monotonic() + 300
    while not ((run_dir / "metrics.jsonl").exists() and
               len((run_dir / "metrics.jsonl").read_text().splitlines()) >= rows):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)


def test_the_workers_never_outlive_a_driver_killed_outright(project, tmp_path):
    """SIGKILL to the driver of 2 processes (an OOM killer, a scheduler killing the parent): its workers end too,
    leaving the run as its newest checkpoint has it (resume=auto continues it)."""
    run_dir = tmp_path / "run"
    args = [*WINE, f"run_dir={run_dir}", "cluster.num_processes=2", "trainer.batch_size=8", "trainer.save_every=5",
            "trainer.eval_every=100000", "trainer.warmup_steps=5"]
    driver = start_xtrain(*args, "trainer.max_steps=100000", "trainer.log_every=1", quiet=True, cwd=project)
    wait_for_rows(run_dir, driver, 8)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "step_00000005" / "xtrain_state.json").exists():  # (published behind training)
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    tree = [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(recursive=True)]
    agent_and_forks = [p for p in tree if "xtrain.launch.agent" in p.cmdline()]
    assert len([p for p in agent_and_forks if p.ppid() in {a.pid for a in agent_and_forks}]) == 2  # a fork per rank
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    gone, alive = psutil.wait_procs(tree[1:], timeout=30)
    assert alive == []
    from xtrain.core import rundir

    status, result = rundir.shown_status(run_dir), read_result(run_dir)
    assert status in ("interrupted", "lost") and rundir.complete_checkpoints(run_dir), (status, result)


def test_a_sweep_summary_ranks_best_first_says_ties_and_shows_the_tasks_columns(project, tmp_path):
    """Two points differ only in how often they log (the same training): a tie; the third trains worse. summary.md
    and xtrain.status list them best first; a classifier's table has no language-model columns."""
    sweep_dir = tmp_path / "sweep"
    run_xtrain("-m", *WINE, f"run_dir={sweep_dir}", "trainer.max_steps=15", "trainer.eval_every=15",
               "trainer.lr=1e-5,3e-3", "trainer.log_every=5,15", "trainer.monitor=val_loss", cwd=project)
    points = [p["dir"] for p in json.loads((sweep_dir / "sweep.json").read_text())["points"]]
    fast = [p for p in points if "lr=0.003" in p]
    assert len(fast) == 2 and read_result(sweep_dir / fast[0])["val_loss"] == read_result(sweep_dir / fast[1])["val_loss"]
    text = (sweep_dir / "summary.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    order = [line.split(" | ")[0].removeprefix("| ").replace(" (best)", "").strip("*") for line in table[1:]]
    assert order[:2] == fast and set(order[2:]) == set(points) - set(fast)
    assert f"tied with {fast[1]}" in text
    assert "tokens_per_s" not in table[0] and "val_ppl" not in table[0] and "batch_tokens" not in table[0]
    from xtrain.commands import status

    lines = status.sweep_status(sweep_dir).splitlines()
    assert lines[1].startswith(fast[0]) and lines[2].startswith(fast[1]) and f"tied with {fast[1]}" in lines[-2]


def test_the_log_says_where_a_run_stands_and_what_it_saved(project, tmp_path):
    proc = run_xtrain(*WINE, f"run_dir={tmp_path / 'run'}", "trainer.log_every=30", "trainer.save_every=30",
                      cwd=project)
    text = proc.stdout + proc.stderr
    assert "| 30/60 steps, eta " in text and "| 60/60 steps, eta 0s" in text
    # 106 train examples in steps of 16: 6 steps an epoch (each epoch's order leaves 10 out)
    assert "| effective batch 16 examples, 6 steps an epoch" in text and "| epoch 5.00 | 30/60 steps" in text
    rows = read_metrics(tmp_path / "run")
    assert [(row["step"], row["epoch"]) for row in rows if "train/loss" in row] == [(30, 5.0), (60, 10.0)]
    assert [row["epoch"] for row in rows if "val/loss" in row] == [0.0, 2.5, 5.0, 7.5, 10.0]
    assert read_result(tmp_path / "run")["epoch"] == 10.0 and read_result(tmp_path / "run")["steps_per_epoch"] == 6
    assert f"step 30 | checkpoint saved: {tmp_path / 'run' / 'checkpoints' / 'step_00000030'}" in text
    assert "step 60 | exporting model/" in text


@pytest.mark.parametrize("overrides,expected", [
    (["trainer.warmup_steps=100"], "trainer.warmup_steps=100: more than trainer.max_steps=60"),
    (["+trainer.optimizer.momentum=0.9"], "trainer.optimizer.momentum: an argument, but trainer.optimizer._target_ is "
                                          "not set"),
    (["trainer.optimizer._target_=torch.optim.SGD", "strategy=zero2", "strategy.offload_optimizer=cpu"],
     "trainer.optimizer._target_=torch.optim.SGD: with strategy.offload_optimizer=cpu DeepSpeed steps on the host"),
    (["trainer.scheduler._target_=torch.optim.lr_scheduler.Nope"],
     "trainer.scheduler._target_=torch.optim.lr_scheduler.Nope: module torch.optim.lr_scheduler has no Nope"),
    (["trainer.callbacks=[{_target_: extra.smoothed_ce}]"],
     "trainer.callbacks[0]._target_=extra.smoothed_ce: a function, whose result cannot be checked without calling it; "
     "give a class with hooks (or annotate the function's return type with one)"),
    (["data.collate_fn._target_=extra.nope"], "data.collate_fn._target_=extra.nope: module extra has no nope"),
    (["data.test._target_=extra.nope"], "data.test._target_=extra.nope: module extra has no nope"),
    (["trainer.callbacks=[{_target_: extra.LightningNamed}]"],
     "trainer.callbacks[0]._target_=extra.LightningNamed: on_validation_epoch_end is not a hook xtrain calls, so it "
     "would never run; did you mean on_validation_end? (the hooks: on_train_start, on_train_batch_end, "
     "on_validation_end, on_save_checkpoint, on_train_end, on_exception)"),
    (["trainer.callbacks=[{_target_: extra.Narrow}]"],
     "trainer.callbacks[0]._target_=extra.Narrow: on_validation_end cannot be called as on_validation_end(state, "
     "metrics), as xtrain calls it"),
    (["trainer.callbacks=[{_target_: extra.Slow, every: 2}]"],
     "trainer.callbacks[0].every=2: extra.Slow takes no argument every (it takes no keyword arguments)"),
    (["trainer.epochs=3"], "trainer.epochs=3: no such setting; did you mean trainer.max_epochs?"),
    (["trainer.optimizer._target_=torch.optim.SGD", "+trainer.optimizer.momentun=0.9"],
     "trainer.optimizer.momentun=0.9: torch.optim.SGD takes no argument momentun; did you mean "
     "trainer.optimizer.momentum?"),
])
def test_a_bad_piece_of_your_own_loop_is_one_line_and_writes_nothing(project, tmp_path, overrides, expected):
    run_dir = tmp_path / "run"
    assert_one_line_error(run_xtrain(*WINE, f"run_dir={run_dir}", *overrides, check=False, cwd=project), expected)
    assert not run_dir.exists()


def test_a_dry_run_checks_callbacks_without_building_them(project, tmp_path):
    """A callback is code that runs: a dry run imports it and checks its keywords and its class's hooks, and calls
    nothing. A function that would have to be called to be checked is refused by the dry run and the run alike, and
    neither calls it."""
    marker = tmp_path / "ran"
    called = [*WINE, f"run_dir={tmp_path / 'run'}", f"trainer.callbacks=[{{_target_: os.system, command: 'touch {marker}'}}]"]
    refused = "trainer.callbacks[0]._target_=os.system: a function, whose result cannot be checked without calling it"
    assert_one_line_error(run_xtrain(*called, "dry_run=true", check=False, cwd=project), refused)
    assert_one_line_error(run_xtrain(*called, check=False, cwd=project), refused)
    assert not marker.exists() and not (tmp_path / "run").exists()
    for node, expected in (("{_target_: extra.LightningNamed}", "on_validation_epoch_end is not a hook xtrain calls"),
                           ("{_target_: extra.Narrow}", "on_validation_end cannot be called as on_validation_end(state, "
                                                        "metrics)"),
                           ("{_target_: os.system, comand: ls}", "trainer.callbacks[0].comand=ls: os.system takes no "
                                                                 "argument comand; did you mean "
                                                                 "trainer.callbacks[0].command?"),
                           ("{_target_: extra.LightningArguments}", "on_validation_end(trainer, pl_module) takes "
                                                                    "Lightning's arguments; xtrain calls "
                                                                    "on_validation_end(state, metrics) (state: run_dir, "),
                           ("{_target_: extra.make_noted}", "has none of the hooks")):  # (its annotated class's)
        refused = run_xtrain(*WINE, f"run_dir={tmp_path / 'run'}", f"trainer.callbacks=[{node}]", "dry_run=true",
                             check=False, cwd=project)
        assert_one_line_error(refused, expected)


def test_mistakes_outside_the_run_config_are_one_line(project, tmp_path):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "empty.jsonl").write_text("")
    broken = tmp_path / "conf" / "experiment" / "broken.yaml"
    broken.parent.mkdir(parents=True)
    broken.write_text("# @package _global_\ntrainer:\n  lr: [1, 2\n  batch_size: 8\n")
    cases = [
        (["--config-dir", str(tmp_path / "conf"), "experiment=broken", f"run_dir={tmp_path / 'r'}"],
         f"{broken}: not valid YAML at line 4, column 13: expected ',' or ']', but got ':' (while parsing a flow "
         "sequence from line 3); fix the file"),
        ([f"run_dir={tmp_path / 'a_file'}"], f"run_dir={tmp_path / 'a_file'}: a file, not a directory"),
        (["-m", f"run_dir={tmp_path / 's'}", "hydra/sweeper=xtrain_optuna", "trainer.lr=intervl(1e-4,1e-2)"],
         "trainer.lr=intervl(1e-4,1e-2): no function intervl in Hydra's sweep grammar; did you mean interval?"),
        (["-m", f"run_dir={tmp_path / 's'}", "hydra/sweeper=xtrain_optuna", "hydra.sweeper.objective=val_los",
          "trainer.lr=interval(1e-4,1e-2)"], "hydra.sweeper.objective=val_los: the task does not compute it"),
        ([f"run_dir={tmp_path / 'r'}", "model._target_=nets.mlp"],
         "model._target_=nets.mlp: a model and datasets by _target_ are trained by task=custom; add task=custom"),
        ([f"run_dir={tmp_path / 'r'}", "data=text", f"data.files=[{tmp_path / 'empty.jsonl'}]"],
         f"data.files: {tmp_path / 'empty.jsonl'} is empty (no records); remove it or fill it"),
    ]
    for args, expected in cases:
        assert_one_line_error(run_xtrain(*args, check=False, cwd=project), expected)
    proc = xtrain_in_process(str(tmp_path / "missing"), check=False, command="xtrain.status")
    assert proc.returncode == 2 and proc.stderr.strip() == f"xtrain.status: error: {tmp_path / 'missing'}: no such directory"


def test_zero_partitions_your_own_optimizer():
    from conftest import compose_run
    from xtrain.parallel import plugins, zero

    cfg = compose_run("strategy=zero2", "trainer.optimizer._target_=torch.optim.SGD")
    assert zero.deepspeed_config(cfg, plugins.ModelFacts(hidden_size=64))["zero_allow_untested_optimizer"] is True
    assert "zero_allow_untested_optimizer" not in zero.deepspeed_config(compose_run("strategy=zero2"),
                                                                           plugins.ModelFacts(hidden_size=64))


def test_a_language_model_with_code_of_your_own_records_where_it_is_imported_from(project, tmp_path, monkeypatch):
    """Callbacks or an optimizer by `_target_` make run.yaml's task.code_dir the command's directory (as a model of
    your own does), and the optimizer imports from there when the command runs elsewhere (a resume, a SLURM node)."""
    from conftest import compose_run
    from xtrain.core.errors import ConfigError
    from xtrain.engine import optim

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(project)])  # (as in a fresh process)
    monkeypatch.chdir(project)
    assert compose_run().task.code_dir is None
    assert compose_run("trainer.callbacks=[{_target_: extra.Noted}]").task.code_dir == str(project)
    users_sgd = compose_run("trainer.optimizer._target_=torch.optim.SGD")
    assert users_sgd.task.code_dir == str(project)
    monkeypatch.chdir(tmp_path)
    (project / "extra_sgd.py").write_text("import torch\n\n\nclass SGD(torch.optim.SGD):\n    pass\n")
    elsewhere = compose_run("trainer.optimizer._target_=extra_sgd.SGD", "+trainer.optimizer.momentum=0.9")
    assert elsewhere.task.code_dir == str(tmp_path)
    with pytest.raises(ConfigError, match="trainer.optimizer._target_=extra_sgd.SGD: cannot import"):
        optim.check(elsewhere)
    elsewhere.task.code_dir = str(project)
    optim.check(elsewhere)
    model = torch.nn.Linear(3, 2)
    built = optim.build_optimizer(model, elsewhere)
    assert type(built).__module__ == "extra_sgd" and built.param_groups[0]["momentum"] == 0.9


def test_a_language_models_predictions_are_its_answers_to_prompts(short_run, tmp_path):
    prompts, answers = tmp_path / "prompts.txt", tmp_path / "answers.jsonl"
    prompts.write_text("The function\nA list is\n")
    proc = xtrain_in_process(str(short_run), f"prompts={prompts}", f"predictions={answers}", command="xtrain.eval")
    assert proc.stdout.strip().splitlines()[-1] == f"answered 2 prompt(s): {answers}"
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [(r["index"], r["prompt"]) for r in rows] == [(0, "The function"), (1, "A list is")]
    assert all(isinstance(r["answer"], str) for r in rows)
