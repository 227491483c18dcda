"""A study's sampler and pruner names (`hydra.sweeper.sampler=tpe`, `hydra/sweeper/sampler=tpe`,
`hydra.sweeper.pruner=median`) and the Optuna classes they name. Imports nothing: Hydra reads it at every start."""

SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler", "qmc": "QMCSampler", "cmaes": "CmaEsSampler",
            "gp": "GPSampler", "nsgaii": "NSGAIISampler"}
PRUNERS = {"median": "MedianPruner", "percentile": "PercentilePruner", "successive_halving": "SuccessiveHalvingPruner",
           "hyperband": "HyperbandPruner", "none": "NopPruner"}
