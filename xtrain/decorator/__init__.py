"""`xtrain.run_with_accelerate`: a user's own training function on N processes (run_with_accelerate.py),
each a fork running `xtrain.decorator.worker`, under the supervisor every xtrain run uses.

May import: core, config, data, parallel, tasks, engine, launch, backends, sweeps.
"""
