"""One rank's training, the same under every launcher: loop.py (`train`: build, resume, step, evaluate,
checkpoint, stop, export), accelerator.py (the Accelerator from the config), optim.py, evaluation.py,
checkpoint.py, resume.py (what a resumed run may change), monitor.py (the monitored metric, best and early
stop), tracking.py (W&B, TensorBoard, metrics.jsonl), reporting.py (log lines), sampler.py, and a study's
trial side: pruning.py (report, prune) over study_settings.py (the study's settings and storage).

May import: core, config, data, parallel, tasks.
"""
