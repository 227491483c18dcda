"""What a user types: cli.py (`python -m xtrain`: Hydra composes the run config, a backend runs it),
help.py (`--help`), prepare.py (`python -m xtrain.prepare`), status.py (`python -m xtrain.status`) and env.py
(`python -m xtrain.env`). The three `python -m xtrain.<command>` modules at the package root only call these.

May import: core, config, data, parallel, tasks, engine, launch, backends, sweeps.
"""
