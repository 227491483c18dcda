"""xtrain: declarative experiment configs for distributed PyTorch training."""

__version__ = "0.1.0"
