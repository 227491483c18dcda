"""Hydra's own launcher test suites (shipped with hydra-core) for `hydra/launcher=xtrain`: a plain Hydra app runs
under it as under Hydra's basic launcher (its task function, job after job, here). `xtrain_slurm`'s run against the
SLURM test cluster (test_slurm_hydra_suites.py); `xtrain_ray` refuses a plain app in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite, IntegrationTestSuite, LauncherTestSuite

from conftest import REPO

# As xtrain's CLI does for an editable install, without importing it here (it sets Hydra's version base)
if str(REPO / "launchers") not in sys.path:
    sys.path.append(str(REPO / "launchers"))


@pytest.fixture(autouse=True)
def no_version_base(hydra_restore_singletons):
    """The suites' apps leave Hydra's version base unset, as test_slurm_hydra_suites.py explains."""
    from hydra.version import _UNSPECIFIED_, VersionBase

    VersionBase.instance().version_base = _UNSPECIFIED_


@pytest.mark.parametrize("launcher_name, overrides", [("xtrain", [])])
class TestLocalLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize("launcher_name, overrides", [("xtrain", ["hydra/sweeper=basic", "hydra.sweeper.max_batch_size=2"])])
class TestLocalLauncherBatched(BatchedSweeperTestSuite):
    pass


ON_PATH = os.pathsep.join([str(REPO / "launchers"), os.environ.get("PYTHONPATH", "")])


@pytest.fixture(scope="module")
def plugin_visible() -> None:
    """A plain Hydra app (not xtrain's CLI) in an editable install sees the plugin through PYTHONPATH (a regular
    install needs nothing: test_sweep.py tests that); the suites' apps are processes of their own."""
    code = ("from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher; "
            "print(sorted(p.__name__ for p in Plugins.instance().discover(Launcher)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ON_PATH}).stdout
    assert "'LocalLauncher', 'RayLauncher', 'SlurmLauncher'" in out


@pytest.fixture
def launchers_on_path(monkeypatch, plugin_visible):
    monkeypatch.setenv("PYTHONPATH", ON_PATH)


@pytest.mark.usefixtures("launchers_on_path")
@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [
    ({}, ["-m", "hydra/hydra_logging=disabled", "hydra/job_logging=disabled", "hydra/launcher=xtrain"]),
    ({}, ["-m", "hydra/launcher=xtrain"]),  # Hydra's logging on: the app's own lines and files
])
class TestLocalLauncherIntegration(IntegrationTestSuite):
    pass


@pytest.mark.parametrize("flags,line", [
    (["hydra/launcher=xtrain_ray"], "error: hydra/launcher=xtrain_ray runs xtrain's own runs (python -m xtrain) only; "
                                    "for __main__'s jobs use hydra/launcher=xtrain (here, job after job), xtrain_slurm, "
                                    "or hydra-ray-launcher"),
    (["hydra/launcher=xtrain", "hydra.launcher.n_jobs=2"],
     "error: hydra.launcher.n_jobs=2: hydra/launcher=xtrain runs another app's jobs one after another; drop it, or use "
     "hydra/launcher=joblib for jobs at once"),
])
def test_what_a_launcher_cannot_do_for_a_plain_app_is_refused_in_one_line(tmp_path, launchers_on_path, flags, line):
    app = tmp_path / "app.py"
    app.write_text("import hydra\n\n@hydra.main(version_base=None, config_path=None, config_name=None)\n"
                   "def main(cfg):\n    print('ran')\n\nmain()\n")
    proc = subprocess.run([sys.executable, str(app), "-m", *flags, "+x=1,2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ})
    assert proc.returncode == 2 and "ran" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == line
