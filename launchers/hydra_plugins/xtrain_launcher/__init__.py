"""xtrain's Hydra launchers: `hydra/launcher=xtrain` (local sweeps; xtrain's default) and `xtrain_slurm`."""
