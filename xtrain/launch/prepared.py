"""What the driver learns of a run before it launches it, learned once: the resolved config, the task, the model's
facts (read on the meta device), the mesh, the checkpoint it resumes from. `preflight.preflight` builds it; the
backend writes the run dir from it, and `prepared.json` hands it to every rank through the run dir (a rank reads
the model's facts there instead of building the model on the meta device again)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xtrain.config.schema import RunConfig
from xtrain.core.files import write_atomic
from xtrain.core.rundir import PREPARED
from xtrain.parallel import dims, plugins
from xtrain.tasks import facts as model_facts


@dataclass
class Prepared:
    cfg: RunConfig  # as run.yaml records it
    task: Any  # the run's Task (tasks/base.py), built once in this process
    parameters: int  # the model's, counted on the meta device
    facts: plugins.ModelFacts
    checkpoint: Path | None  # the one the run resumes from (None: a fresh start)
    checkpoint_step: int | None = None

    def record(self) -> dict:
        layout = dims.of(self.cfg)
        return {**model_facts.as_record(self.parameters, self.facts, model_facts.facts_key(self.cfg)),
                "mesh": layout.as_dict(), "data_parallel_size": layout.data_parallel,
                "effective_batch": dims.effective_batch(self.cfg),
                "checkpoint": None if self.checkpoint is None else str(self.checkpoint),
                "checkpoint_step": self.checkpoint_step}

    def write(self, run_dir: Path) -> None:
        write_atomic(Path(run_dir) / PREPARED, json.dumps(self.record(), indent=1) + "\n")
