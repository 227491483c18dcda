"""Checkpoints written behind training (trainer.async_save) and where a run's time goes (goodput): the same files
and weights as a synchronous save, a kill or a stop while a save is in flight, the plan's staging memory, the
refusals, and save_every=auto's choice."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import (FSDP_ON_CPU, PACED, SHARDED, assert_equal_weights, compose_run, logged,
                      read_metrics, read_result, refusal, run_xtrain, seams, start_xtrain, xtrain_in_process)
from xtrain.engine import goodput, staging

SHORT = ["trainer.max_steps=12", "trainer.warmup_steps=2", "trainer.log_every=4", "trainer.eval_every=6",
         "trainer.save_every=4", "trainer.batch_size=4"]
FILES = ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl")


# ---------------------------------------------------------------- unit: the arithmetic, the settings, the staging


def test_young_daly_interval():
    """τ = √(2δM)·(1 + √(δ/2M)/3 + δ/18M) − δ, in steps; τ = M where δ ≥ 2M."""
    tau = (2 * 10 * 86400) ** 0.5 * (1 + (10 / 172800) ** 0.5 / 3 + 10 / (18 * 86400)) - 10
    assert goodput.interval(10.0, 86400.0, 1.0) == round(tau) == 1308
    assert goodput.interval(10.0, 86400.0, 4.0) == round(tau / 4)
    assert goodput.interval(100.0, 40.0, 2.0) == 20  # a save longer than the failures' spacing: every M
    assert goodput.interval(1e-9, 3600.0, 10.0) == 1  # (at least one step)


def test_goodput_parts_add_up_to_the_span_across_a_restart():
    first = goodput.Goodput.of({}, started_at=1000.0)
    first.startup = 5.0
    first.timed("evals", 2.0, 0.5)
    for _ in range(10):
        first.timed("steps", 1.0, 0.0)
    before = first.figures(now=1020.0, waits=1.0)
    assert before["goodput_span_s"] == 20.0 and before["goodput"] == 0.5
    assert before["goodput_breakdown"] == {"startup_s": 5.0, "compile_s": 0.5, "evals_s": 1.5, "checkpoint_waits_s": 1.0,
                                           "lost_s": 0.0, "down_s": 0.0, "training_s": 10.0, "other_s": 2.0}
    # killed at 1030 (10 s after its last record), restarted at 1050, redoing 3 of its steps
    second = goodput.Goodput.of(before, started_at=1050.0, redo=3)
    second.startup = 4.0
    for _ in range(5):
        second.timed("steps", 2.0, 0.0)
    after = second.figures(now=1070.0, waits=0.0)
    parts = after["goodput_breakdown"]
    assert after["goodput_span_s"] == 70.0 and after["first_started_at"] == 1000.0
    assert parts["down_s"] == 30.0 and parts["lost_s"] == 6.0 and parts["training_s"] == 14.0
    assert sum(parts.values()) == pytest.approx(70.0) and after["goodput"] == pytest.approx(14 / 70, abs=1e-4)
    assert goodput.observed_mtbf_s({**after, "restarts": [{"ended": "running"}, {"ended": "interrupted"}]}) == 70.0


@pytest.mark.parametrize("value", ["often", 0, -3])
def test_bad_async_and_save_every_settings_are_one_line(value):
    what = "async_save" if value == "often" else "save_every"
    line = refusal(f"trainer.{what}={value}")
    assert line.startswith(f"trainer.{what}={value}:") and ("auto" in line)


def test_async_save_resolves_per_strategy_and_zero_refuses_it():
    assert compose_run().trainer.async_save is True
    assert compose_run("strategy=fsdp").trainer.async_save is True
    assert compose_run("strategy=zero2").trainer.async_save is False
    assert compose_run("trainer.async_save=false").trainer.async_save is False
    assert "DeepSpeed's engine writes ZeRO checkpoints itself" in refusal("strategy=zero3", "trainer.async_save=true")
    assert "use strategy.fsdp_version=2" in refusal("strategy=fsdp", "strategy.fsdp_version=1", "trainer.async_save=true")


def test_save_every_auto_needs_a_failure_rate():
    assert refusal("trainer.save_every=auto").startswith(
        "trainer.save_every=auto: needs the failure rate it plans for; set cluster.mtbf_hours")


def test_the_plan_counts_the_staging_copy():
    from xtrain.launch import plan

    asynchronous, synchronous = (plan.for_this_machine(compose_run(*more)) for more in ([], ["trainer.async_save=false"]))
    m = asynchronous.memory
    assert asynchronous.staging == m.params + m.optimizer and synchronous.staging == 0
    assert "staging" in plan.render(asynchronous) and "staging" not in plan.render(synchronous)
    sharded = plan.for_this_machine(compose_run("strategy=fsdp", "cluster.num_processes=2"))
    assert sharded.staging == 2 * (sharded.memory.params + sharded.memory.optimizer)  # each rank its shards


def test_staging_keeps_ties_and_views_and_writes_what_torch_save_writes(tmp_path):
    import numpy as np
    from safetensors.torch import load_file

    weight = torch.randn(6, 4)
    state = {"a": weight, "tied": weight, "view": weight[2:], "step": torch.tensor(3.0), "lr": 0.1}
    rng = {"numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    buffers = staging.Buffers()
    with staging.deferred(buffers) as staged:
        torch.save(state, tmp_path / "state.bin")
        torch.save(rng, tmp_path / "rng.pkl")
        torch.save({"order": {3, 1, 2}}, tmp_path / "other.bin")  # (not a tensor tree: its bytes, now)
        import accelerate.utils.other as other

        other.safe_save_file({"w": weight}, tmp_path / "w.safetensors", metadata={"format": "pt"})
    assert not any(tmp_path.iterdir())  # nothing written yet
    expected = weight.clone()
    weight.add_(1.0)  # training goes on
    staged.write()
    loaded = torch.load(tmp_path / "state.bin", weights_only=True)
    assert torch.equal(loaded["a"], expected) and torch.equal(loaded["view"], expected[2:])
    assert loaded["tied"].untyped_storage().data_ptr() == loaded["a"].untyped_storage().data_ptr()
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], expected)
    (tmp_path / "direct").mkdir()
    torch.save(rng, tmp_path / "direct" / "rng.pkl")  # (the file's name is in its archive)
    assert (tmp_path / "rng.pkl").read_bytes() == (tmp_path / "direct" / "rng.pkl").read_bytes()
    assert torch.load(tmp_path / "other.bin", weights_only=False) == {"order": {1, 2, 3}}
    held = buffers.nbytes()
    assert held >= expected.numel() * 4
    with staging.deferred(buffers):  # the next save copies into the same host buffers
        torch.save(state, tmp_path / "state.bin")
    assert buffers.nbytes() == held


# ---------------------------------------------------------------- component: one process, in this process


def test_async_and_sync_saves_write_the_same_files_and_train_the_same_weights(tmp_path):
    runs = {}
    for mode in ("true", "false"):
        runs[mode] = tmp_path / mode
        proc = xtrain_in_process(f"run_dir={runs[mode]}", *SHORT, f"trainer.async_save={mode}")
        assert f"step 12 | checkpoint saved: {runs[mode] / 'checkpoints' / 'step_00000012'} (training waited" in proc.stdout
    for step in ("step_00000008", "step_00000012"):
        for name in FILES:
            a, b = (runs[mode] / "checkpoints" / step / name for mode in runs)
            assert a.read_bytes() == b.read_bytes(), (step, name)
    assert_equal_weights(runs["true"], runs["false"])
    for mode in runs:
        result = read_result(runs[mode])
        assert result["checkpoint_saves"] == 3 and result["checkpoint_blocked_s"] > 0
        assert sorted(p.name for p in (runs[mode] / "checkpoints").iterdir()) == ["step_00000008", "step_00000012"]
    assert "written in" in xtrain_in_process(f"run_dir={tmp_path / 'again'}", *SHORT).stdout  # (behind training)


def test_goodput_is_in_the_result_the_last_line_status_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    proc = xtrain_in_process(f"run_dir={run_dir}", *SHORT, "tracker=tensorboard")
    result = read_result(run_dir)
    parts = result["goodput_breakdown"]
    assert sum(parts.values()) == pytest.approx(result["goodput_span_s"], abs=0.01)
    assert result["goodput"] == pytest.approx(parts["training_s"] / result["goodput_span_s"], abs=1e-3)
    assert parts["startup_s"] > 0 and parts["evals_s"] > 0 and parts["training_s"] > 0 and parts["down_s"] == 0
    assert parts["checkpoint_waits_s"] == pytest.approx(result["checkpoint_blocked_s"], abs=1e-3)
    assert result["first_started_at"] <= result["first_step_at"] and result["step_s"] > 0
    assert f"| {goodput.text(result)} |" in proc.stdout.splitlines()[-1]
    status = xtrain_in_process(str(run_dir), command="xtrain.status").stdout
    assert f"goodput          {result['goodput']:.0%} of" in status
    events = EventAccumulator(str(run_dir / "tensorboard" / "xtrain"))
    events.Reload()
    assert [e.value for e in events.Scalars("goodput")] == [pytest.approx(result["goodput"], abs=1e-6)]
    assert not any("goodput" in row for row in read_metrics(run_dir))  # (metrics.jsonl: steps and evals)


def test_save_every_auto_chooses_records_and_chooses_again_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    auto = ["trainer.max_steps=30", "trainer.warmup_steps=2", "trainer.log_every=4", "trainer.eval_every=30",
            "trainer.batch_size=4", "trainer.save_every=auto", "cluster.mtbf_hours=0.005"]
    proc = xtrain_in_process(f"run_dir={run_dir}", *auto)
    result = read_result(run_dir)
    chosen = [line for line in proc.stdout.splitlines() if "checkpoints every" in line]
    assert len(chosen) == 1 and "step 8 | checkpoints every" in chosen[0]  # (after the second log window's save)
    every = int(chosen[0].split("checkpoints every ")[1].split()[0])
    blocked, step_s = result["checkpoint_blocked_s"], result["step_s"]
    assert 1 <= every < 22
    text = (run_dir / "run.yaml").read_text()
    assert text.startswith(f"# save_every=auto: {every} steps, chosen at step 8 (") and f"save_every: {every}\n" in text
    saves = [int(line.split("step_")[1][:8]) for line in proc.stdout.splitlines() if "checkpoint saved" in line]
    assert saves[0] == 8 and saves[-1] == 30 and all(b - a == every for a, b in zip(saves[:-2], saves[1:-1]))
    # a resume with more steps chooses again at once, from what the run measured (no probe save)
    proc = xtrain_in_process(f"run_dir={run_dir}", *auto[1:], "trainer.max_steps=40", "resume=auto",
                             "resume_changes=apply")
    again = [line for line in proc.stdout.splitlines() if "checkpoints every" in line]
    assert len(again) == 1 and "step 30 | checkpoints every" in again[0]
    assert f"a save blocks training {blocked / result['checkpoint_saves']:.3g} s, a step takes {step_s:.3g} s" in again[0]


# ---------------------------------------------------------------- end to end: a kill and a stop while a save is in flight

SLOW_WRITES = {**seams("timings"), "XTRAIN_TEST_WRITE_DELAY_S": "3"}
PACED_RUN = ["trainer.max_steps=24", "trainer.warmup_steps=2", "trainer.log_every=2", "trainer.eval_every=12",
             "trainer.save_every=6", "trainer.batch_size=4", *PACED]


def wait_for(condition, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


def test_a_kill_while_a_save_is_written_keeps_the_one_before_and_resumes_bitwise(tmp_path):
    """Step 12's files are still being written (3 s behind training) when the run is killed: step 6 stays the newest
    checkpoint, the next start removes the partial one and resumes from step 6 along the unbroken run."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    reference = start_xtrain(f"run_dir={whole}", *PACED_RUN, quiet=True)
    proc = start_xtrain(f"run_dir={killed}", *PACED_RUN, env=SLOW_WRITES, quiet=True)
    checkpoints = killed / "checkpoints"
    wait_for(lambda: (checkpoints / ".tmp-step_00000012").is_dir() and read_result(killed).get("checkpoint_step") == 6,
             proc)  # (step 6 recorded as what a kill resumes from; step 12's files still on their way)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (checkpoints / "step_00000012").exists() and (checkpoints / "step_00000006" / "xtrain_state.json").is_file()
    run_xtrain(f"run_dir={killed}", *PACED_RUN, "resume=auto")
    assert reference.wait(timeout=600) == 0
    result = read_result(killed)
    assert result["resumed_from"].endswith("step_00000006") and not (checkpoints / ".tmp-step_00000012").exists()
    assert_equal_weights(whole, killed)
    assert logged(killed) == logged(whole)
    parts = result["goodput_breakdown"]  # the steps after step 6 trained twice, the killed attempt's tail lost
    assert parts["lost_s"] > 0 and parts["down_s"] > 0 and result["restarts"][0]["steps_lost"] >= 6
    assert sum(parts.values()) == pytest.approx(result["goodput_span_s"], abs=0.01)


def test_a_stop_waits_for_the_save_in_flight_and_its_own(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_xtrain(f"run_dir={run_dir}", *PACED_RUN, env=SLOW_WRITES)
    wait_for(lambda: (run_dir / "checkpoints" / ".tmp-step_00000006").is_dir(), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    result = read_result(run_dir)
    stopped = result["stop"]["step"]
    assert stopped > 6 and result["checkpoint_step"] == stopped
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000006", f"step_{stopped:08d}"]  # both whole, nothing partial
    assert result["checkpoint_blocked_s"] >= 3  # the stop waited for the writes
    assert f"step {stopped} | checkpoint saved" in out + err


def test_fsdp2_async_and_sync_checkpoints_hold_the_same_shards(tmp_path):
    """Two processes, FSDP2's sharded state through torch's distributed checkpoint, written behind training or in
    step: every shard, RNG and schedule file the same bytes (DCP's .metadata names its own save)."""
    runs = {mode: tmp_path / mode for mode in ("true", "false")}
    for mode, run_dir in runs.items():
        run_xtrain(f"run_dir={run_dir}", "strategy=fsdp", *SHARDED, f"trainer.async_save={mode}", env=FSDP_ON_CPU)
    final = Path("checkpoints") / "step_00000020"
    files = sorted(p.relative_to(runs["true"] / final) for p in (runs["true"] / final).rglob("*") if p.is_file())
    assert any(f.suffix == ".distcp" for f in files)
    for name in files:
        if name.name not in (".metadata", "xtrain_state.json"):
            assert (runs["true"] / final / name).read_bytes() == (runs["false"] / final / name).read_bytes(), name
    assert_equal_weights(runs["true"], runs["false"])
    state = json.loads((runs["true"] / final / "xtrain_state.json").read_text())
    assert set(state["files"]) == {str(f) for f in files if f.name != "xtrain_state.json"}


def test_a_sweep_summary_shows_each_points_goodput_and_their_total(tmp_path):
    """From the points' result.json alone: a column per point, and the points' parts summed over their spans."""
    from xtrain.sweeps import summary

    entries = []
    for num, (training, down) in enumerate([(30.0, 0.0), (10.0, 20.0)]):
        point = tmp_path / f"{num}_lr={num}"
        point.mkdir()
        parts = {f"{part}_s": 0.0 for part in goodput.PARTS} | {"training_s": training, "down_s": down, "startup_s": 10.0}
        span = sum(parts.values())
        (point / "result.json").write_text(json.dumps({"status": "completed", "goodput": round(training / span, 4),
                                                       "goodput_span_s": span, "goodput_breakdown": parts}))
        entries.append({"num": num, "dir": point.name, "overrides": [f"trainer.lr={num}"]})
    (tmp_path / "sweep.json").write_text(json.dumps({"points": entries}))
    table = summary.rows(tmp_path)
    assert [row["goodput"] for row in table] == [0.75, 0.25]
    assert "Goodput 50% of the points' 1m20s: startup 25%, down 25%" in summary.markdown(tmp_path, table)
