"""The tools on damaged run dirs: one line naming the file, exit 2; `model/` checked against the digests its export
recorded; `xtrain.export` of a run that prunes its checkpoints as it trains."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import assert_one_line_error, xtrain_in_process
from xtrain.core import owned


@pytest.fixture
def run_dir(tmp_path, short_run):
    copy = tmp_path / "run"
    shutil.copytree(short_run, copy)
    return copy


def weights(run_dir):
    return run_dir / "model" / "model.safetensors"


def damage(run_dir, how: str) -> str:
    """Damage the run dir as `how` says; the file the tools must name."""
    if how == "flipped_bit":
        data = bytearray(weights(run_dir).read_bytes())
        data[len(data) // 2] ^= 0x10
        weights(run_dir).write_bytes(bytes(data))
        return "model.safetensors does not match the checksum it was written with"
    if how == "truncated_weights":
        size = weights(run_dir).stat().st_size
        os.truncate(weights(run_dir), size // 2)
        return f"model.safetensors holds {size // 2:,} bytes, {size:,} were written"
    if how == "missing_config":
        (run_dir / "model" / "config.json").unlink()
        return "config.json is missing"
    if how == "garbled_weights_no_manifest":  # (a model/ an earlier xtrain exported: no digests to check)
        (run_dir / "model" / owned.MANIFEST).unlink()
        weights(run_dir).write_bytes(b"\0garbage" * 1000)
        return f"{run_dir / 'model'}: cannot be loaded ("
    if how == "cut_result":
        text = (run_dir / "result.json").read_text()
        (run_dir / "result.json").write_text(text[: len(text) // 2])
        return f"{run_dir / 'result.json'}: cut short or garbled (JSONDecodeError: "
    if how == "cut_run_yaml":
        (run_dir / "run.yaml").write_text("trainer:\n  max_steps: 12\n  lr: [0.1\n")
        return f"{run_dir / 'run.yaml'}: cut short or garbled ("
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["flipped_bit", "truncated_weights", "missing_config", "garbled_weights_no_manifest",
                                 "cut_result", "cut_run_yaml"])
def test_xtrain_eval_on_a_damaged_run_dir_is_one_line(run_dir, how):
    expected = damage(run_dir, how)
    proc = xtrain_in_process(str(run_dir), command="xtrain.eval", check=False)
    line = assert_one_line_error(proc, expected)
    if how in ("flipped_bit", "truncated_weights", "missing_config"):
        assert line.endswith(f"the model was not loaded: write it again from a checkpoint (python -m xtrain.export "
                             f"{run_dir}), or resume the run")
    assert not (run_dir / "eval.json").exists()


@pytest.mark.parametrize("how", ["cut_result", "cut_run_yaml"])
def test_xtrain_status_and_export_on_a_cut_record_are_one_line(run_dir, how):
    expected = damage(run_dir, how)
    assert_one_line_error(xtrain_in_process(str(run_dir), command="xtrain.status", check=False), expected)
    exported = xtrain_in_process(str(run_dir), command="xtrain.export", check=False)
    if how == "cut_run_yaml":
        assert_one_line_error(exported, expected)
        assert not (run_dir / "exports").exists() or not any((run_dir / "exports").iterdir())
    else:  # (the export reads the checkpoint and run.yaml, not result.json)
        assert exported.returncode == 0, exported.stderr


def test_an_export_lists_its_files_digests_and_matches_them(run_dir):
    assert owned.foreign_files(run_dir / "model") == [] and owned.manifest_damage(run_dir / "model") is None
    listed = owned.read_manifest(run_dir / "model")
    assert set(listed) == {p.name for p in (run_dir / "model").iterdir()} - {owned.MANIFEST}
    xtrain_in_process(str(run_dir), command="xtrain.export")
    out = run_dir / "exports" / "step_00000012"
    assert owned.manifest_damage(out) is None and set(owned.read_manifest(out)) >= {"config.json", "model.safetensors"}
    assert [p.name for p in (run_dir / "exports").iterdir()] == ["step_00000012"]  # (its snapshot removed)


def test_export_of_a_run_that_prunes_as_it_trains_reads_the_newest_checkpoint(run_dir, monkeypatch):
    """The checkpoint being linked is pruned (the run published a newer one): the export takes the newest; once its
    snapshot is made, pruning the checkpoint under it changes nothing."""
    from xtrain.commands import export

    checkpoints = run_dir / "checkpoints"
    newest, linking = checkpoints / "step_00000012", []
    real_link = os.link

    def link_while_pruned(source, target):
        if not linking:  # the run publishes step 18 and prunes step 12 as the export starts linking it
            shutil.copytree(newest, checkpoints / "step_00000018")
            shutil.rmtree(newest)
        linking.append(source)
        return real_link(source, target)

    monkeypatch.setattr(os, "link", link_while_pruned)
    with export.held(run_dir, None, run_dir / "exports") as (checkpoint, snapshot):
        assert checkpoint.name == "step_00000018"
        shutil.rmtree(checkpoint)  # pruned again, under the export
        state = json.loads((snapshot / "xtrain_state.json").read_text())
        assert all((snapshot / name).stat().st_size == want["bytes"] for name, want in state["files"].items())
    assert not snapshot.exists() and list((run_dir / "exports").iterdir()) == []
