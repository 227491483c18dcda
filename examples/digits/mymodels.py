"""A small CNN for 8x8 digit images: the model of a user project (`model._target_=mymodels.cnn`)."""

from torch import nn


def cnn(channels: int = 16, num_classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * 8 * 8, num_classes),
    )
