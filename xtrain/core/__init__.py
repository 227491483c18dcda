"""The bottom layer: what every other layer may use, and nothing of training.

errors.py (ConfigError and the other failures that end a run in one line), files.py (atomic writes,
private files, directory swaps), stopping.py (signals → a stop request the ranks agree on), memory.py (peak
RSS and device memory), machine.py (cores, GPUs, when this process was launched) and rundir.py (the run dir's
contract: its file names, result.json's one writer, sweep.json).

May import: nothing of xtrain.
"""
