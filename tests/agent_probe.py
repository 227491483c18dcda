"""A rank for the agent fork server's test: `run([NAME, WAIT_FOR])` prints its name, its working directory and
XTRAIN_PROBE, then waits until the file WAIT_FOR exists and exits with the number written in it."""

from __future__ import annotations

import os
import time
from pathlib import Path

PRELOAD = ()


def run(argv: list[str]) -> None:
    name, wait_for = argv
    print(f"probe {name} in {os.getcwd()} with {os.environ.get('XTRAIN_PROBE')}", flush=True)
    while not Path(wait_for).exists():
        time.sleep(0.05)
    raise SystemExit(int(Path(wait_for).read_text()))
