"""model/: the task's export of the model, written aside and renamed into place (a failure leaves the one before)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from xtrain.core import memory, owned, rundir
from xtrain.core.errors import WriteFailed
from xtrain.core.files import replace_dir, write_failure
from xtrain.engine import checkpoint
from xtrain.parallel import fp8

log = logging.getLogger("xtrain")


def write_model(run_dir: Path, task, model, state_dict: dict, step: int) -> None:
    """The main process: the task's export of `model` (its `state_dict`, gathered) into the run dir (model/, with
    LoRA adapter/ too), each directory listing its files (owned.MANIFEST) and replacing the run dir's
    (files.replace_dir), where the run dir's holds no file xtrain did not write. A failure (the disk full) is one
    line and removes what it wrote."""
    log.info("step %d | exporting model/", step)
    for name in owned.EXPORTED:  # (planted while it trained: preflight refused them before)
        foreign = owned.export_foreign(run_dir, name)
        if foreign:
            raise WriteFailed(f"step {step}'s {name}/ was not written: {run_dir / name} holds files xtrain did not "
                              f"write ({', '.join(foreign[:4])}); move them out of it, then run the same command with "
                              f"run_dir={run_dir} resume=auto")
    tmp = run_dir / f".tmp-{rundir.MODEL}"  # (a kill's leftover, xtrain's own: the next export starts it again)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        task.export(model, fp8.unwrapped(state_dict), tmp)
        for made in sorted(tmp.iterdir()):
            owned.write_manifest(made)
        for made in sorted(tmp.iterdir()):
            replace_dir(made, run_dir / made.name)
        tmp.rmdir()
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        newest = checkpoint.newest(run_dir)
        kept = f"the newest checkpoint ({newest.name}) is kept" if newest else "there is no checkpoint"
        raise WriteFailed(write_failure(err, f"step {step}'s {rundir.MODEL}/", run_dir,
                                                   memory.parameter_bytes(model), kept, run_dir)) from err
