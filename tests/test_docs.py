"""The docs site builds with every link and anchor resolved, and its reference covers every setting."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO, assert_one_line_error, xtrain_in_process

from xtrain.commands import help
from xtrain.config import schema


def test_the_reference_pages_in_the_repository_are_current():
    """docs/reference/*.md hold their generated parts (every setting, the help text, other tools' names), as the
    site shows them: a new setting, option or description is written in with `python docs/hooks.py`."""
    for page in ("config.md", "cli.md"):
        path = REPO / "docs" / "reference" / page
        assert help.refreshed(path.read_text()) == path.read_text(), f"{page} is out of date: run python docs/hooks.py"
    written = (REPO / "docs" / "reference" / "config.md").read_text()
    assert all(f"`{name}`" in written for name in schema.setting_names())
    assert "`trainer.gradient_clip_val`" in written and "betas (0.9, 0.95)" in written


def test_help_for_a_group_lists_its_settings_with_defaults_and_meanings():
    text = help.group_text("trainer")
    assert "trainer.max_grad_norm = 1.0   (float)" in text and "trainer.min_lr_ratio = 0.1   (float)" in text
    assert "betas (0.9, 0.95)" in text and "Cosine decay ends at lr * min_lr_ratio." in text
    strategy = help.group_text("strategy")
    assert "Settings of strategy=fsdp alone" in strategy and "strategy.sharding = " in strategy
    assert "hydra.sweeper.{sampler, seed, direction, objective," in help.text()  # (a study's settings)
    proc = xtrain_in_process("--help", "trainer")
    assert proc.stdout.strip() == text
    assert_one_line_error(xtrain_in_process("--help", "trainr", check=False),
                          "--help trainr: no such config group; choose one of task, model, data")


def test_the_docs_site_builds_strictly_and_its_reference_lists_every_setting(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr
    reference = (site / "reference" / "config" / "index.html").read_text()
    missing = [name for name in schema.setting_names() if f"<code>{name}</code>" not in reference]
    assert not missing, missing
    for group in help.GROUPS:
        for option in help.options(group):
            assert f"<code>{option}</code>" in reference, (group, option)
    assert "Companion commands:" in (site / "reference" / "cli" / "index.html").read_text()
    # the reference renders as written: `_target_` not an italic "target", no escaped pipes, names never wrapped
    assert "<em>target</em>" not in reference and "\\|" not in reference and "<code>_target_</code>" in reference
    assert "stylesheets/xtrain.css" in reference and "white-space: nowrap" in (site / "stylesheets" / "xtrain.css").read_text()
    for page in site.rglob("*.html"):  # no placeholders to fill in before a command works
        assert "&lt;org&gt;" not in page.read_text() and "&lt;repository URL&gt;" not in page.read_text(), page


def test_the_readme_is_a_first_hour_document_whose_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if not target.startswith("http"):
            assert (REPO / target).exists(), target


def test_the_docs_name_the_run_dirs_files_as_a_run_writes_them():
    """Checkpoints, eval arrays and exports are named by the step in 8 digits (`step_00000300`), never `step_N`."""
    from xtrain.core.rundir import CHECKPOINT_NAME, checkpoint_name

    assert CHECKPOINT_NAME.match(checkpoint_name(300)) and checkpoint_name(300) == "step_00000300"
    for page in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]:
        for name in re.findall(r"(?:checkpoints|evals/[^/`]+|exports)/(step_[^/`.\s]*)", page.read_text()):
            assert CHECKPOINT_NAME.match(name), (page, name)
