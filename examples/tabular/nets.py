"""A small MLP for tables: the model of a user project (`model._target_=nets.mlp`)."""

from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int, outputs: int, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, outputs))
        self.outputs = outputs

    def forward(self, features):
        out = self.net(features)
        return out.squeeze(-1) if self.outputs == 1 else out  # one output per example: a logit, or a number


mlp = MLP
