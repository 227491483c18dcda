"""A pytest plugin for a time-limited test run on a lent GPU (benchmarks/on_device.sh loads it with
`-p benchmarks.as_it_goes`): each test's outcome and time as it ends, a failure's traceback at once. pytest prints
both only at the end, which a run stopped at its time limit never reaches."""

from __future__ import annotations

import sys


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.failed:
        print(f"\n[{report.outcome} {report.when} {report.duration:.1f} s] {report.nodeid}", file=sys.stderr, flush=True)
    if report.failed:
        print(report.longreprtext, file=sys.stderr, flush=True)
