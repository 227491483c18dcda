"""Many runs from one command: sweep.py (a grid's points validated, written and run by a backend),
summary.py (summary.csv and summary.md from the points' run dirs), and Optuna studies: study.py (the study:
ask, launch, tell, resume), study_on_slurm.py (the study's SLURM workers, each asking for trials) and
search_space.py (`interval(...)`, `choice(...)`, `tag(log, ...)` overrides).

May import: core, config, data, parallel, tasks, engine, launch, backends.
"""
