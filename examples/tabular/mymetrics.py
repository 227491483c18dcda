"""A metric of a user project: the coefficient of determination, better when higher
(`{_target_: mymetrics.r2, name: r2, direction: maximize}`)."""

import torch


def r2(preds: torch.Tensor, targets: torch.Tensor) -> float:
    preds, targets = preds.double(), targets.double()
    return float(1 - ((targets - preds) ** 2).sum() / ((targets - targets.mean()) ** 2).sum())
