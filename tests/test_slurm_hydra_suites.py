"""Hydra's own launcher test suites (shipped with hydra-core) for `hydra/launcher=xtrain_slurm`, run against
the real test cluster, as hydra-submitit-launcher runs them for its launcher: plain Hydra apps, each job a
task of a SLURM job array."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite, IntegrationTestSuite, LauncherTestSuite

from conftest import REPO

# Hydra's own suites: they exercise Hydra as much as xtrain's plugin
pytestmark = [pytest.mark.usefixtures("slurm_cluster"), pytest.mark.slow]

# As xtrain's CLI does for an editable install (xtrain.commands.cli.make_launchers_visible), without importing it here:
# importing xtrain.commands.cli sets Hydra's version base (1.3) for the whole process, which changes the suites' apps.
if str(REPO / "launchers") not in sys.path:
    sys.path.append(str(REPO / "launchers"))


def test_discovery():
    """In a process of its own: importing xtrain.commands.cli sets Hydra's version base for the whole process."""
    code = ("from xtrain.commands.cli import make_launchers_visible; make_launchers_visible(); "  # as xtrain's CLI does
            "from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher; "
            "print(sorted(p.__name__ for p in Plugins.instance().discover(Launcher)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "'LocalLauncher', 'RayLauncher', 'SlurmLauncher'" in out


@pytest.fixture(autouse=True)
def no_version_base(hydra_restore_singletons):
    """The suites' apps leave Hydra's version base unset (1.1 behaviour: each job runs in its own dir). Tests
    before these imported xtrain.commands.cli in this process, which set it to 1.3; hydra_restore_singletons puts it back."""
    from hydra.version import _UNSPECIFIED_, VersionBase

    VersionBase.instance().version_base = _UNSPECIFIED_


@pytest.mark.parametrize("launcher_name, overrides", [("xtrain_slurm", [])])
class TestSlurmLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize("launcher_name, overrides", [("xtrain_slurm", ["hydra/sweeper=basic", "hydra.sweeper.max_batch_size=2"])])
class TestSlurmLauncherBatched(BatchedSweeperTestSuite):
    pass


@pytest.fixture
def launchers_on_path(monkeypatch):
    """A plain Hydra app (not xtrain's CLI) in an editable install sees the plugin through PYTHONPATH
    (a regular install needs nothing: test_sweep.py tests that)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "launchers"), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.usefixtures("launchers_on_path")
@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [
    ({}, ["-m", "hydra/hydra_logging=disabled", "hydra/job_logging=disabled", "hydra/launcher=xtrain_slurm"]),
])
class TestSlurmLauncherIntegration(IntegrationTestSuite):
    pass
