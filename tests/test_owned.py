"""xtrain writes only into what is empty or its own, and removes or replaces only what it wrote (core/owned.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import SHORT, assert_one_line_error, read_result, run_xtrain, xtrain_in_process
from xtrain.core import owned
from xtrain.core.errors import ConfigError, WriteFailed


def tree(root: Path) -> dict[str, bytes]:
    """Every file below `root` with its content: what a test compares before and after."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def a_project(root: Path) -> Path:
    """A user's project folder, holding names a run writes too."""
    for name, text in {"model/net.py": "class Net: ...\n", "metrics.jsonl": "my notes\n",
                       "checkpoints/README": "mine\n", "run.yaml": "lr: 3\n", "logs/today.txt": "x\n"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_folder_a_run_may_write_into_is_missing_empty_or_a_run_dir(tmp_path):
    assert owned.run_dir_refusal(tmp_path / "new") is None
    assert owned.run_dir_refusal(tmp_path) is None  # empty
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "h", "started": 0}))  # xtrain's own lock record
    assert owned.run_dir_refusal(tmp_path) is None
    (tmp_path / "run.yaml").write_text("run_dir: x\ntrainer: {}\nstrategy: {}\ncluster: {}\n")
    (tmp_path / "notes.md").write_text("a user's file in a run dir\n")
    assert owned.run_dir_refusal(tmp_path) is None  # a run dir: its run.yaml is a run config


def test_a_folder_holding_only_xtrains_checkpoints_copied_in_is_a_run_dir_to_resume(tmp_path):
    copied = tmp_path / "copied"
    (copied / "checkpoints" / "step_00000004").mkdir(parents=True)
    assert owned.run_dir_refusal(copied) is None
    (copied / "checkpoints" / "notes.txt").write_text("mine")
    assert "(checkpoints/)" in owned.run_dir_refusal(copied)
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert "(checkpoints/)" in owned.run_dir_refusal(tmp_path / "empty")


def test_a_folder_of_the_users_is_refused_naming_what_it_holds(tmp_path):
    project = a_project(tmp_path / "project")
    why = owned.run_dir_refusal(project)
    assert why == (f"run_dir={project}: holds files that are not an xtrain run's (checkpoints/, logs/, metrics.jsonl, "
                   "model/, and 1 more); xtrain writes only into an empty folder or a run dir: choose a new run_dir")
    (tmp_path / "lock-only").mkdir()
    (tmp_path / "lock-only" / ".lock").write_text("the user's own lock file\n")  # not xtrain's record
    assert "(.lock)" in owned.run_dir_refusal(tmp_path / "lock-only")
    (tmp_path / "file").write_text("x")
    assert owned.run_dir_refusal(tmp_path / "file") == f"run_dir={tmp_path / 'file'}: is a file, not a folder; choose a new run_dir"
    link = tmp_path / "link"
    link.symlink_to(project)  # a symlink to a non-empty tree is that tree
    assert "holds files that are not an xtrain run's" in owned.run_dir_refusal(link)


@pytest.mark.parametrize("where", ["/", "/etc", "/usr", "/tmp", "home"])
def test_root_home_and_system_folders_are_never_a_run_dir(tmp_path, where):
    target = str(Path.home()) if where == "home" else where
    link = tmp_path / "link"
    link.symlink_to(target)
    for given in (Path(target), link):
        why = owned.run_dir_refusal(given)
        assert why and ("a system directory" in why or "your home directory" in why), why
        assert why.endswith("choose one, e.g. run_dir=runs/<name>")
    assert owned.run_dir_refusal(Path(target) / "xtrain-runs" / "a") is None or not Path(target).exists()


def test_a_sweep_dir_is_missing_empty_hydras_record_only_or_a_sweep(tmp_path):
    assert owned.sweep_dir_refusal(tmp_path / "new") is None
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")  # Hydra writes it before xtrain is asked
    assert owned.sweep_dir_refusal(tmp_path) is None
    (tmp_path / "summary.md").write_text("my summary\n")
    assert owned.sweep_dir_refusal(tmp_path) == (
        f"run_dir={tmp_path}: holds files that are not an xtrain sweep's (summary.md); xtrain writes only into an "
        "empty folder or a sweep dir: choose a new run_dir")
    (tmp_path / "sweep.json").write_text('{"points": []}')
    assert owned.sweep_dir_refusal(tmp_path) is None


def test_an_export_folder_is_xtrains_where_its_manifest_lists_every_file(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "sub").mkdir()
    (model / "sub" / "w.bin").write_bytes(b"\1" * 10)
    assert owned.foreign_files(model) == ["config.json", "sub/w.bin"]  # no manifest: none of it is xtrain's
    assert owned.foreign_files(model, legacy_ok=True) == []  # (an earlier xtrain's export, result.json says)
    owned.write_manifest(model)
    assert owned.foreign_files(model) == [] and owned.manifest_damage(model) is None
    (model / "net.py").write_text("mine")
    assert owned.foreign_files(model) == ["net.py"]
    (model / "sub" / "w.bin").write_bytes(b"\1" * 9)
    assert owned.manifest_damage(model) == "sub/w.bin holds 9 bytes, 10 were written"
    (model / "sub" / "w.bin").write_bytes(b"\2" * 10)
    assert owned.manifest_damage(model) == "sub/w.bin does not match the checksum it was written with"
    (model / "config.json").unlink()
    assert owned.manifest_damage(model) == "config.json is missing"


def test_a_run_dirs_model_and_checkpoints_holding_a_users_files_are_refused(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "net.py").write_text("mine")
    assert owned.parts_refusal(tmp_path) == (
        f"run_dir={tmp_path}: model/ holds files xtrain did not write (net.py); a run replaces model/ when it "
        "exports: move them out of it, or choose a new run_dir")
    shutil.rmtree(tmp_path / "model")
    for name in ("step_00000006", ".tmp-step_00000012", "step_00000003.corrupt", "step_00000003.corrupt.2"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert owned.parts_refusal(tmp_path) is None
    (tmp_path / "checkpoints" / "README").write_text("mine")
    assert "checkpoints/ holds files xtrain did not write (README)" in owned.parts_refusal(tmp_path)


def test_pruning_and_cleaning_up_remove_only_what_xtrain_wrote(tmp_path):
    from xtrain.engine import checkpoint

    root = tmp_path / "checkpoints"
    kept, pruned = root / "step_00000002", root / "step_00000004"
    for path in (kept, pruned):
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"w")
        (path / "xtrain_state.json").write_text(json.dumps({"step": 2, "files": {"model.safetensors": {}}}))
    (kept / "my_notes.txt").write_text("mine")
    checkpoint.prune(kept)
    checkpoint.prune(pruned)
    assert (kept / "my_notes.txt").read_text() == "mine" and (kept / "model.safetensors").exists()
    assert not pruned.exists()
    (root / ".tmp-step_00000006").mkdir()  # a save that was killed: xtrain's
    (root / "step_00000008").mkdir()  # not a checkpoint xtrain wrote (it has no state file)
    (root / "step_00000008" / "x").write_text("mine")
    checkpoint.remove_partial(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000008.corrupt"]  # set aside
    assert (root / "step_00000008.corrupt" / "x").read_text() == "mine"


def test_an_export_over_a_model_folder_holding_a_users_file_writes_nothing(tmp_path):
    from xtrain.engine import exporting

    class Task:
        def export(self, model, state_dict, out):
            (out / "model").mkdir()
            (out / "model" / "weights").write_text("new")

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "net.py").write_text("mine")
    with pytest.raises(WriteFailed, match=r"step 4's model/ was not written: .*model holds files xtrain did not write "
                                          r"\(net.py\); move them out of it"):
        exporting.write_model(tmp_path, Task(), None, {}, 4)
    assert tree(tmp_path) == {"model/net.py": b"mine"}
    shutil.rmtree(tmp_path / "model")
    exporting.write_model(tmp_path, Task(), None, {}, 4)
    assert sorted(tree(tmp_path)) == ["model/weights", f"model/{owned.MANIFEST}"]
    assert owned.foreign_files(tmp_path / "model") == []


def test_a_fresh_run_or_sweep_into_a_users_folder_changes_nothing(tmp_path):
    project = a_project(tmp_path / "project")
    before = tree(project)
    for command in (["run_dir=."], ["run_dir=.", "dry_run=true"], ["-m", "run_dir=.", "trainer.seed=0,1"],
                    ["run_dir=.", "resume=auto"]):
        proc = xtrain_in_process(*command, *SHORT, check=False, cwd=project)
        assert_one_line_error(proc, "holds files that are not an xtrain")
        assert tree(project) == before and sorted(os.listdir(project)) == sorted(
            ["model", "metrics.jsonl", "checkpoints", "run.yaml", "logs"]), command


def test_a_dry_run_or_a_refusal_keeps_an_empty_folder_that_was_there(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    xtrain_in_process(f"run_dir={mine}", "dry_run=true")
    assert_one_line_error(xtrain_in_process(f"run_dir={mine}", "trainer.lr=-1", check=False), "trainer.lr=-1")
    assert mine.is_dir() and not any(mine.iterdir())
    xtrain_in_process(f"run_dir={tmp_path / 'new' / 'run'}", "dry_run=true")
    assert not (tmp_path / "new").exists()  # (the folders Hydra made for it)
    xtrain_in_process("dry_run=true", cwd=mine)  # the default run_dir, runs/<date>_<time>
    assert not any(mine.iterdir())


def test_a_users_files_in_a_run_dir_survive_every_path(tmp_path, short_run):
    """Files of the user's in every place a run writes: the resumed run, its export and eval, a failed resume and a
    sweep beside them leave each one as it was; in model/ they stop the run before it writes anything."""
    run_dir = tmp_path / "run"
    shutil.copytree(short_run, run_dir)
    planted = {"notes.md": b"top", "logs/mine.txt": b"logs", "evals/mine.txt": b"evals",
               "checkpoints/step_00000006/mine.txt": b"in a checkpoint", "exports/mine.txt": b"exports"}
    for name, content in planted.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(content)
    more = [o for o in SHORT if not o.startswith("trainer.max_steps")]
    run_xtrain(f"run_dir={run_dir}", "resume=auto", "trainer.max_steps=18", "resume_changes=apply", *more)
    assert read_result(run_dir)["steps"] == 18
    xtrain_in_process(str(run_dir), command="xtrain.export")
    xtrain_in_process(str(run_dir), command="xtrain.eval")
    refused = xtrain_in_process(f"run_dir={run_dir}", "resume=auto", "trainer.max_steps=24", "resume_changes=apply",
                                "trainer.lr=-1", *more, check=False)
    assert refused.returncode == 2
    diverged = xtrain_in_process(f"run_dir={run_dir}", "resume=auto", "trainer.max_steps=24", "resume_changes=apply",
                                 "trainer.lr=1e6", "trainer.max_grad_norm=0", *more, check=False)
    assert diverged.returncode == 1 and read_result(run_dir)["status"] == "failed"
    assert {name: (run_dir / name).read_bytes() for name in planted} == planted
    assert (run_dir / "checkpoints" / "step_00000006").is_dir()  # kept past keep_checkpoints: it holds a user's file
    (run_dir / "model" / "net.py").write_text("mine")
    before = tree(run_dir)
    proc = xtrain_in_process(f"run_dir={run_dir}", "resume=auto", "trainer.max_steps=24", "resume_changes=apply",
                             *more, check=False)
    assert_one_line_error(proc, "model/ holds files xtrain did not write (net.py)")
    assert tree(run_dir) == before


def test_a_users_files_in_a_sweep_dir_and_its_points_survive_its_resume(tmp_path):
    sweep_dir = tmp_path / "sweep"
    tiny = ["trainer.max_steps=4", "trainer.warmup_steps=1", "trainer.log_every=2", "trainer.eval_every=2",
            "trainer.save_every=2", "model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=64",
            "model.num_heads=2"]
    run_xtrain("-m", f"run_dir={sweep_dir}", "trainer.seed=0,1", *tiny)
    planted = {"notes.md": b"sweep notes", "0_seed=0/notes.md": b"point notes", "1_seed=1/logs/mine.txt": b"mine"}
    for name, content in planted.items():
        (sweep_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (sweep_dir / name).write_bytes(content)
    longer = [o for o in tiny if not o.startswith("trainer.max_steps")]
    run_xtrain("-m", f"run_dir={sweep_dir}", "trainer.seed=0,1", "resume=auto", "resume_changes=apply",
               "trainer.max_steps=6", *longer)
    assert [read_result(sweep_dir / p)["steps"] for p in ("0_seed=0", "1_seed=1")] == [6, 6]
    assert {name: (sweep_dir / name).read_bytes() for name in planted} == planted
    (sweep_dir / "0_seed=0" / "model" / "net.py").write_text("mine")  # in a folder a point replaces: the sweep refused whole
    before = tree(sweep_dir)
    proc = xtrain_in_process("-m", f"run_dir={sweep_dir}", "trainer.seed=0,1", "resume=auto", "resume_changes=apply",
                             "trainer.max_steps=8", *longer, check=False)
    assert_one_line_error(proc, "point 0 (trainer.seed=0): run_dir=", "model/ holds files xtrain did not write (net.py)")
    assert tree(sweep_dir) == before
