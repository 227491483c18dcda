"""The suite's own figures, each from a variable the test sets: a dense peak for the CPU (so MFU is computed), a
shorter linger for ranks that outlive the first to end, ranks started by spawn as on an accelerator's build of
torch, a checkpoint's files written that much later (a save still in flight when the test acts)."""

from __future__ import annotations

import os

PEAK = "XTRAIN_TEST_PEAK_TFLOPS"
LINGER = "XTRAIN_TEST_LINGER_S"
SPAWN = "XTRAIN_TEST_SPAWN_RANKS"
WRITE_DELAY = "XTRAIN_TEST_WRITE_DELAY_S"


class Timings:
    def peak_tflops(self) -> float | None:
        import torch

        return float(os.environ[PEAK]) if PEAK in os.environ and not torch.cuda.is_available() else None

    def linger_s(self) -> float | None:
        return float(os.environ[LINGER]) if LINGER in os.environ else None

    def spawn_ranks(self) -> bool | None:
        return True if os.environ.get(SPAWN) == "1" else None

    def before_checkpoint_write(self, step: int) -> None:
        if WRITE_DELAY in os.environ:
            import time

            time.sleep(float(os.environ[WRITE_DELAY]))


SEAM = Timings()
