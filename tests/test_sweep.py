"""Sweeps through the real CLI (`python -m xtrain -m ...`): every point validated first, failures recorded and
the sweep goes on, a summary after every point, resume that skips finished points and continues the rest."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from conftest import (PACED, REPO, SMALL, assert_equal_weights, assert_one_line_error, compose_run, read_metrics,
                      read_result, run_xtrain, start_xtrain, xtrain_in_process)

# Small points: a few seconds each, in the driver.
TINY = ["trainer.max_steps=6", "trainer.warmup_steps=2", "trainer.log_every=2", "trainer.eval_every=3",
        "trainer.save_every=3"]


def sweep(sweep_dir: Path, *overrides: str, check: bool = True, env: dict | None = None):
    return run_xtrain("-m", f"run_dir={sweep_dir}", *overrides, check=check, env=env)


def csv_rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "sweep.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    sweep_dir = tmp_path_factory.mktemp("grid") / "sweep"
    proc = sweep(sweep_dir, "trainer.batch_size=4,8", "trainer.grad_accum=1,2", *TINY)
    return sweep_dir, proc


def test_a_grid_runs_every_point_into_its_own_run_dir(grid):
    sweep_dir, proc = grid
    names = ["0_batch_size=4,grad_accum=1", "1_batch_size=4,grad_accum=2", "2_batch_size=8,grad_accum=1",
             "3_batch_size=8,grad_accum=2"]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == names
    for name in names:
        point = sweep_dir / name
        assert {"run.yaml", "metrics.jsonl", "result.json", "checkpoints", "model"} <= {p.name for p in point.iterdir()}
        assert read_result(point)["status"] == "completed"
    assert "batch_size: 8" in (sweep_dir / names[3] / "run.yaml").read_text()
    assert "grad_accum: 2" in (sweep_dir / names[3] / "run.yaml").read_text()
    assert "sweep done: 4 points" in proc.stdout


def test_the_summary_has_a_row_per_point_and_marks_the_best(grid):
    sweep_dir, _ = grid
    rows = csv_rows(sweep_dir)
    assert [r["point"] for r in rows] == [p["dir"] for p in json.loads((sweep_dir / "sweep.json").read_text())["points"]]
    assert [(r["trainer.batch_size"], r["trainer.grad_accum"]) for r in rows] == [("4", "1"), ("4", "2"), ("8", "1"),
                                                                                 ("8", "2")]
    for r in rows:
        assert r["status"] == "completed" and r["steps"] == "6" and r["world_size"] == "1" and r["error"] == ""
        result = read_result(sweep_dir / r["point"])
        assert float(r["val_loss"]) == pytest.approx(result["val_loss"])
        sequences = int(r["trainer.batch_size"]) * int(r["trainer.grad_accum"])
        assert (int(r["batch_sequences"]), int(r["batch_tokens"])) == (sequences, sequences * 128)
    best = min(rows, key=lambda r: float(r["val_loss"]))
    markdown = (sweep_dir / "summary.md").read_text()
    assert f"**{best['point']}** (best)" in markdown and "4 points: 4 completed" in markdown


def test_the_picture_is_a_real_png_with_curves_and_a_heatmap(grid):
    import matplotlib.image

    sweep_dir, _ = grid
    image = matplotlib.image.imread(sweep_dir / "sweep.png")
    assert image.shape[0] >= 400 and image.shape[1] >= 1200  # two panels side by side


def test_status_prints_a_sweep_and_a_run(grid, tmp_path):
    sweep_dir, _ = grid
    (sweep_dir / "sweep.csv").unlink()
    proc = xtrain_in_process(str(sweep_dir), command="xtrain.status")
    assert "trainer.batch_size" in proc.stdout.splitlines()[0] and proc.stdout.count("completed") == 4
    assert "best: " in proc.stdout and (sweep_dir / "sweep.csv").exists()  # regenerated
    one = xtrain_in_process(str(sweep_dir / "0_batch_size=4,grad_accum=1"), command="xtrain.status")
    assert "completed, step 6 of 6" in one.stdout and "val_loss" in one.stdout
    bad = xtrain_in_process(str(tmp_path), check=False, command="xtrain.status")
    assert bad.returncode == 2 and "neither a run dir" in bad.stderr


def test_experiment_presets_sweep_with_glob(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # (2 steps at half the width: one preset trains in bf16, ~8x fp32's time a step on a CPU without bf16 units)
    sweep(sweep_dir, "experiment=glob(*)", *TINY, "trainer.max_steps=2", "trainer.warmup_steps=1",
          "trainer.eval_every=2", "trainer.save_every=2", "model.hidden_size=64")
    points = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    assert points == ["0_experiment=gpt2_deeper", "1_experiment=tiny_llama_bf16"]
    deeper, llama = (read_result(sweep_dir / p) for p in points)
    assert llama["precision"] == "bf16" and "arch: llama" in (sweep_dir / points[1] / "run.yaml").read_text()
    assert "num_layers: 8" in (sweep_dir / points[0] / "run.yaml").read_text()
    assert deeper["status"] == llama["status"] == "completed" and deeper["steps"] == llama["steps"] == 2


@pytest.mark.parametrize("overrides,expected", [
    (["trainer.batch_size=8,0"], "point 1 (trainer.batch_size=0): trainer.batch_size=0: must be > 0"),
    # caught while Hydra composes, before xtrain sees the points: the setting and its swept values
    (["trainer.batch_size=8,16", "trainer.bacth_size=1,2"],
     "trainer.bacth_size=1,2: no such setting; did you mean trainer.batch_size?"),
    (["trainer.lr=1e-3,fast"], "trainer.lr=1e-3,fast: not a valid float"),
    (["trainer.batch_size=8,16", "trainer.max_steps=5", "resume=runs/elsewhere"],
     "resume=runs/elsewhere: a sweep resumes with resume=auto"),
    # config groups sweep; the preflight of every point runs first (no GPU here: ZeRO is refused)
    pytest.param(["strategy=ddp,zero2", "precision=fp32,bf16"],
                 "point 2 (strategy=zero2 precision=fp32): strategy=zero2: DeepSpeed ZeRO needs CUDA GPUs",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="ZeRO runs on a GPU")),
])
def test_a_bad_point_stops_the_sweep_before_anything_runs(tmp_path, overrides, expected):
    sweep_dir = tmp_path / "sweep"
    assert_one_line_error(xtrain_in_process("-m", f"run_dir={sweep_dir}", *overrides, *TINY, check=False), expected)
    assert not sweep_dir.exists()


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, "trainer.batch_size=2000,8", *TINY, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    # the block count depends on the corpus, which is this interpreter's bundled documentation
    assert re.fullmatch(r"xtrain: error: point 0 \(trainer.batch_size=2000\) failed: trainer.batch_size=2000: larger "
                        r"than the \d+ training blocks; use a smaller batch", lines[0]), lines[0]
    assert "1 of 2 points failed" in lines[-1]
    rows = csv_rows(sweep_dir)
    assert [r["status"] for r in rows] == ["failed", "completed"] and "trainer.batch_size=2000: larger than the" in rows[0]["error"]
    assert read_result(sweep_dir / rows[0]["point"])["status"] == "failed"


def test_a_diverging_run_stops_at_once_with_one_line(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, "trainer.lr=1e6,2e-3", "trainer.max_grad_norm=0", *TINY, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    diverged = read_result(sweep_dir / "0_lr=1000000.0")
    assert diverged["status"] == "failed" and diverged["steps"] < 6
    assert "the loss is nan" in diverged["error"] and "lower trainer.lr (now 1e+06)" in diverged["error"]
    assert read_result(sweep_dir / "1_lr=0.002")["status"] == "completed"
    # a single run says the same in one line
    run_dir = tmp_path / "run"
    single = run_xtrain(f"run_dir={run_dir}", "trainer.lr=1e6", "trainer.max_grad_norm=0", *TINY, check=False)
    assert single.returncode == 1 and "Traceback" not in single.stderr
    assert single.stderr.strip().splitlines() == [f"xtrain: error: {read_result(run_dir)['error'][len('Diverged: '):]}"]


RESUMABLE = ["trainer.batch_size=4,8,16", "trainer.max_steps=12", "trainer.warmup_steps=2", "trainer.log_every=2",
             "trainer.eval_every=4", "trainer.save_every=4"]


def test_a_killed_sweep_resumes_to_the_unbroken_sweeps_weights(tmp_path):
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    sweep(unbroken, *RESUMABLE, *SMALL)
    paced = [*RESUMABLE, *PACED]  # (its steps' sleeps change no number)
    proc = subprocess.Popen([sys.executable, "-m", "xtrain", "-m", f"run_dir={broken}", *paced], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    middle = broken / "1_batch_size=8" / "checkpoints" / "step_00000004" / "xtrain_state.json"
    deadline = time.time() + 300
    while not middle.exists() and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = broken / "0_batch_size=4"
    before = {p: p.stat().st_mtime_ns for p in first.rglob("*")}
    killed = xtrain_in_process(str(broken), command="xtrain.status").stdout
    assert "pending" in killed and "completed" in killed  # point 2 never started, point 0 done

    # a changed setting is refused, and so is a new start over the sweep
    assert_one_line_error(xtrain_in_process("-m", f"run_dir={broken}", *paced, "trainer.lr=1e-3", "resume=auto",
                                            check=False),
                          "point 0 (trainer.batch_size=4): run_dir=", "holds a run with other settings", "trainer.lr")
    assert_one_line_error(xtrain_in_process("-m", f"run_dir={broken}", *paced, check=False), "already holds a run")

    resumed = sweep(broken, *paced, "resume=auto")
    assert "2 to run" in resumed.stdout
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*")} == before  # the finished point is untouched
    assert read_result(broken / "1_batch_size=8")["resumed_from"] is not None
    for name in ("0_batch_size=4", "1_batch_size=8", "2_batch_size=16"):
        assert_equal_weights(broken / name, unbroken / name)
    assert [r["status"] for r in csv_rows(broken)] == ["completed"] * 3


def test_ctrl_c_interrupts_the_current_point_and_stops(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "xtrain", "-m", f"run_dir={sweep_dir}", "trainer.batch_size=4,8",
                             "trainer.max_steps=2000", "trainer.log_every=1"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in proc.stdout:
        if "step 3 |" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "sweep interrupted; continue it with" in err
    assert read_result(sweep_dir / "0_batch_size=4")["status"] == "interrupted"
    assert [r["status"] for r in csv_rows(sweep_dir)] == ["interrupted", "pending"]
    assert not psutil.pid_exists(proc.pid)


def test_points_in_parallel_each_get_their_share_of_the_cores(tmp_path):
    sweep_dir = tmp_path / "sweep"
    sweep(sweep_dir, "trainer.batch_size=4,8", "hydra.launcher.n_jobs=2", *TINY)
    cores = len(os.sched_getaffinity(0))
    for name in ("0_batch_size=4", "1_batch_size=8"):
        result = read_result(sweep_dir / name)
        assert result["status"] == "completed" and result["cpu_threads"] == [max(1, cores // 2)]
        assert "done: 6 steps" in (sweep_dir / name / "logs" / "point.log").read_text()
    assert [r["status"] for r in csv_rows(sweep_dir)] == ["completed", "completed"]


def test_parallel_points_split_the_gpus_this_process_was_given(monkeypatch):
    """Under a parent limited to some GPUs (a shared box, a SLURM binding; ids, UUIDs or MIG instances), the
    points' slots split that list, never 0..k; `cluster.num_processes=auto` is each slot's share."""
    from xtrain.core import machine
    from xtrain.launch import hardware
    from xtrain.backends import local

    monkeypatch.setattr(machine, "visible_gpus", lambda: 4)  # (no GPU here: the count CUDA would give)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,GPU-8c1d,MIG-2f0e")
    assert local._slots(2) == [{"gpus": ["4", "5"]}, {"gpus": ["GPU-8c1d", "MIG-2f0e"]}]
    assert local._slots(4) == [{"gpus": ["4"]}, {"gpus": ["5"]}, {"gpus": ["GPU-8c1d"]}, {"gpus": ["MIG-2f0e"]}]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert local._slots(2) == [{"gpus": ["0", "1"]}, {"gpus": ["2", "3"]}]
    cfg = compose_run()
    auto = replace(cfg, cluster=replace(cfg.cluster, num_processes="auto"))
    assert hardware.resolve_processes(auto, parallel=2).cluster.num_processes == "2"
    assert hardware.resolve_processes(auto).cluster.num_processes == "4"


def peak_rss_mb(*args: str) -> float:
    """The peak resident memory of `python -m xtrain ARGS`, measured by a parent that runs only that."""
    code = ("import resource, subprocess, sys; subprocess.run([sys.executable, '-m', 'xtrain', *sys.argv[1:]], "
            "check=True, capture_output=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, check=True)
    return int(out.stdout) / 1024


def test_points_in_the_driver_release_their_memory(tmp_path):
    """Three points of a 26 M-parameter model: the driver peaks at about one point's memory, not three."""
    big = ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8", "model.intermediate_size=2048",
           "trainer.batch_size=2", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.save_every=2",
           "data.block_size=64", "data.max_val_tokens=256", "trainer.warmup_steps=1"]
    one = peak_rss_mb(f"run_dir={tmp_path / 'one'}", *big)
    peak_rss_mb("-m", f"run_dir={tmp_path / 'three'}", "trainer.seed=1,2,3", *big)
    # Each point resets the kernel's high-water mark as it starts (so the parent's ru_maxrss sees only the last
    # point); what an earlier point left behind is still resident then, so it shows in the later points' peaks.
    table = list(csv.DictReader(open(tmp_path / "three" / "sweep.csv")))
    points = sorted((tmp_path / "three").glob("[0-9]_*"))
    peaks = [json.loads((point / "result.json").read_text())["peak_rss_bytes"] for point in points]
    three = max(peak for rank in peaks for peak in rank) / 2**20
    print(f"peak RSS: one run {one:.0f} MB, the largest of a 3-point sweep's points {three:.0f} MB")
    assert len(points) == 3 and three < one * 1.25
    # the summary's column is the largest rank's
    for row, point_peaks in zip(table, peaks):
        assert len(point_peaks) == 1 and int(row["peak_rss_mb"]) == round(point_peaks[0] / 2**20)
    assert table[0]["peak_device_mb"] == ""  # no GPU


def test_the_peak_memory_a_run_records_starts_at_the_run():
    """memory.reset_peaks: the peak RSS measured after it ignores what the process held before."""
    from xtrain.core import memory

    import mmap

    # fresh pages of their own, written (resident), then unmapped: a heap allocation could reuse memory this
    # long-lived worker already holds (freed by earlier runs, still resident) and never move the peak
    held = mmap.mmap(-1, 400 * 2**20)
    held.write(b"\x01" * len(held))
    before = memory.peak_rss()
    held.close()
    memory.reset_peaks()
    assert memory.peak_rss() < before - 300 * 2**20


DISCOVER = ("from xtrain.commands.cli import register_schemas; register_schemas(); "
            "from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher; "
            "from hydra.plugins.sweeper import Sweeper; import hydra_plugins.xtrain_launcher.launcher as m; "
            "print(m.__file__, [c.__name__ for c in Plugins.instance().discover(Launcher)], "
            "[c.__name__ for c in Plugins.instance().discover(Sweeper)])")


def test_hydra_finds_the_launcher_in_this_editable_install(tmp_path):
    """A setuptools editable install hides namespace packages from Hydra's scan: xtrain makes them visible."""
    out = subprocess.run([sys.executable, "-c", DISCOVER], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "'LocalLauncher'" in out.stdout and "'OptunaSweeper'" in out.stdout and str(REPO / "launchers") in out.stdout


def test_a_wheel_installed_in_a_fresh_environment_trains_sweeps_and_studies(tmp_path):
    """The wheel `pip install .` builds, in a new virtual environment outside the checkout (its dependencies from this
    one's site-packages, by a path entry: nothing is downloaded), trains a sweep (xtrain's launcher: its points are runs) and a
    study (its Optuna sweeper): every package a run needs is in the wheel, and Hydra finds both plugins."""
    import sysconfig
    import venv

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(REPO)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("xtrain-*.whl")
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after the env's own
    work = tmp_path / "elsewhere"
    work.mkdir()

    def xtrain(*overrides: str) -> str:
        proc = subprocess.run([str(python), "-m", "xtrain", *overrides, *TINY], cwd=work, capture_output=True,
                              text=True, timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    where = subprocess.run([str(python), "-c", "import xtrain, hydra_plugins.xtrain_launcher as p; print(xtrain.__file__,"
                            " p.__file__)"], cwd=work, capture_output=True, text=True, check=True).stdout
    assert where.count(str(site)) == 2 and str(REPO) not in where  # the wheel's, not this checkout's
    found = subprocess.run([str(python), "-c", DISCOVER], cwd=work, capture_output=True, text=True, check=True).stdout
    assert "'LocalLauncher'" in found and "'SlurmLauncher'" in found and "'OptunaSweeper'" in found
    assert "sweep done: 2 points" in xtrain("-m", "run_dir=sweep", "trainer.lr=1e-3,2e-3")
    assert [read_result(point)["status"] for point in sorted((work / "sweep").glob("[0-9]_*"))] == ["completed"] * 2
    assert "study done: 2 trials" in xtrain("-m", "run_dir=study", "hydra/sweeper=xtrain_optuna",
                                            "hydra.sweeper.n_trials=2", "trainer.lr=interval(1e-3,2e-3)")


def test_parallel_points_on_gpus_get_their_own_share_or_are_refused():
    """Pure check, any machine: N points at once on G GPUs get G // N each; never fewer than they ask for."""
    from xtrain.backends.local import check_parallel
    from xtrain.core.errors import ConfigError
    from xtrain.config.point import Point

    points = [Point(0, ["trainer.seed=1"], compose_run("cluster.num_processes=4")),
              Point(1, ["trainer.seed=2"], compose_run("cluster.num_processes=2"))]
    check_parallel(points, 2, gpus=8)
    check_parallel(points, 3, gpus=0)  # CPU points share the cores
    with pytest.raises(ConfigError, match=r"point 0 \(trainer.seed=1\): cluster.num_processes=4: with "
                                          r"hydra.launcher.n_jobs=4 each point gets 2 of the 8 GPUs"):
        check_parallel(points, 4, gpus=8)
    with pytest.raises(ConfigError, match=r"hydra.launcher.n_jobs=3: this machine has 2 GPU\(s\)"):
        check_parallel(points, 3, gpus=2)
    with pytest.raises(ConfigError, match=r"hydra.launcher.n_jobs=0: must be >= 1"):
        check_parallel(points, 0, gpus=0)


def test_a_parallel_point_whose_process_is_killed_is_recorded_and_the_sweep_goes_on(tmp_path):
    """Point 0's own process is killed (-9) while it trains: its result.json says so (not `running` for ever), the
    summary counts it failed, and the other point completes."""
    sweep_dir = tmp_path / "sweep"
    proc = start_xtrain("-m", f"run_dir={sweep_dir}", "trainer.max_steps=3000,6", "trainer.log_every=1",
                        "trainer.save_every=1000", "hydra.launcher.n_jobs=2")
    long_point = sweep_dir / "0_max_steps=3000"
    deadline = time.time() + 300
    while not ((long_point / "metrics.jsonl").exists() and len(read_metrics(long_point)) >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    [victim] = [p for p in psutil.process_iter(["cmdline"])
                if "xtrain.backends.local" in (p.info["cmdline"] or []) and str(long_point) in p.info["cmdline"]]
    victim.kill()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    result = read_result(long_point)
    assert result["status"] == "failed"
    assert result["error"] == "its process was killed by SIGKILL before the run recorded an end"
    assert [r["status"] for r in csv_rows(sweep_dir)] == ["failed", "completed"]
    assert "point 0 (trainer.max_steps=3000) failed: its process was killed by SIGKILL" in err


def test_a_gpu_slot_is_free_only_once_the_points_process_has_exited(tmp_path):
    """A point whose run recorded its end frees a slot of CPU cores at once, a slot of GPUs only when its process has
    exited: until then that process holds the GPUs' memory, and the next point would start beside it."""
    from xtrain.core import rundir
    from xtrain.backends.local import slot_is_free
    from xtrain.config.point import Point

    point = Point(0, [], compose_run(f"run_dir={tmp_path / 'point'}"))
    point.path.mkdir()
    rundir.update_result(point.path, {"status": "completed"})
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert slot_is_free(exiting, point, {"cores": [0]})
        assert not slot_is_free(exiting, point, {"gpus": ["0"]})
    finally:
        exiting.kill()
        exiting.wait()
    assert slot_is_free(exiting, point, {"gpus": ["0"]})
