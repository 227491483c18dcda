"""The typed schemas Hydra composes from xtrain/conf/: schema.py (`RunConfig` and its model, data, trainer,
precision and tracker groups), with the groups that grew their own module beside it: cluster.py, strategy.py,
task.py and lora.py. point.py is a sweep's point: one composed config, its number and swept overrides.

May import: core.
"""
