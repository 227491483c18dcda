"""scikit-learn's bundled tables (no download), split once with a fixed seed (a fifth each held out as val and
test) and standardised with the train split's statistics: the datasets of a user project (`data.train._target_=tables.table +data.train.name=wine`).

Items are (features, target) pairs as numpy gives them: float64 features, and targets as class ids (`targets=ids`),
as 0./1. floats (`targets=floats`, what binary_cross_entropy_with_logits takes) or as numbers (a regression's,
standardised with the train split's statistics too: `targets=standardized`)."""

import numpy as np
from sklearn import datasets
from torch.utils.data import Dataset

LOADERS = {"breast_cancer": datasets.load_breast_cancer, "wine": datasets.load_wine,
           "diabetes": datasets.load_diabetes}


class Table(Dataset):
    def __init__(self, name: str, split: str = "train", targets: str = "ids", val_fraction: float = 0.2,
                 test_fraction: float = 0.2, seed: int = 0):
        if split not in ("train", "val", "test"):
            raise ValueError(f"split={split!r}: choose train, val or test")
        features, labels = LOADERS[name](return_X_y=True)
        order = np.random.default_rng(seed).permutation(len(labels))
        n_test, n_val = round(len(labels) * test_fraction), round(len(labels) * val_fraction)
        held = {"test": order[:n_test], "val": order[n_test:n_test + n_val]}
        train = order[n_test + n_val:]
        mean, std = features[train].mean(axis=0), features[train].std(axis=0) + 1e-8
        keep = held.get(split, train)
        self.features = (features[keep] - mean) / std
        self.targets = labels[keep].astype(np.float64 if targets == "floats" else labels.dtype)
        if targets == "standardized":
            self.targets = (labels[keep] - labels[train].mean()) / labels[train].std()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.features[index], self.targets[index]


table = Table
