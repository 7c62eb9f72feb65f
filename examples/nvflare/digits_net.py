"""The example's model and data: a small MLP on scikit-learn's digits, the DP-SGD examples' data.

The sites' shards and the public test split are the same on every run (a fixed permutation).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

SPLIT_SEED = 0
TEST_FRACTION = 0.2


class DigitsNet(nn.Module):
    """64 pixels -> 32 tanh units -> 10 classes (2,410 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: the digits scaled to [0, 1], split 80/20."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    test = round(len(y) * TEST_FRACTION)
    return x[order[test:]], y[order[test:]], x[order[:test]], y[order[:test]]


def site_shard(site: int, sites: int) -> tuple[np.ndarray, np.ndarray]:
    """Site ``site``'s (1-based) part of the training split: every ``sites``-th example."""
    x, y, _, _ = digits()
    return x[site - 1 :: sites], y[site - 1 :: sites]


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1) == torch.from_numpy(y)).float().mean())
