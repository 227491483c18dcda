"""scikit-learn's bundled digits (1,797 8x8 images, no download), split once with a fixed seed: the datasets of a
user project (`data.train._target_=mydata.digits +data.train.split=train`)."""

import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset


class Digits(Dataset):
    """(image, label) pairs: images as 1x8x8 float tensors in [0, 1]."""

    def __init__(self, split: str = "train", val_size: int = 297, seed: int = 0):
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}: choose train or val")
        images, labels = load_digits(return_X_y=True)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
        keep = order[-val_size:] if split == "val" else order[:-val_size]
        self.images = torch.tensor(images, dtype=torch.float32)[keep].reshape(-1, 1, 8, 8) / 16.0
        self.labels = torch.tensor(labels)[keep]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]


digits = Digits
