"""The typed schemas Hydra composes from xtrain/conf/: one module per config group, as xtrain/conf/<group>/ holds
the group's options (model.py with lora.py, data.py, task.py, strategy.py, precision.py, cluster.py, trainer.py,
tracker.py), and schema.py: `RunConfig`, which composes them and checks what spans groups. point.py is a sweep's
point: one composed config, its number and swept overrides.

May import: core.
"""
