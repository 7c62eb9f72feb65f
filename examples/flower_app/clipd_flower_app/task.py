"""The model and the data: linear regression on synthetic data, one partition per node (numpy only)."""

from __future__ import annotations

import numpy as np

FEATURES = 8
TRUE_WEIGHTS = np.linspace(-1.0, 1.0, FEATURES).astype(np.float32)
TRUE_BIAS = np.float32(0.5)


def initial_model() -> dict[str, np.ndarray]:
    return {"weights": np.zeros(FEATURES, np.float32), "bias": np.zeros((), np.float32)}


def load_data(partition_id: int, examples: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """This node's examples: y = x . w + b + noise, features drawn per partition."""
    rng = np.random.default_rng(1000 + partition_id)
    x = rng.standard_normal((examples, FEATURES)).astype(np.float32)
    y = x @ TRUE_WEIGHTS + TRUE_BIAS + 0.1 * rng.standard_normal(examples).astype(np.float32)
    return x, y


def loss(model: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    residual = x @ model["weights"] + model["bias"] - y
    return float(np.mean(residual**2))


def train(model: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, steps: int, lr: float) -> dict[str, np.ndarray]:
    """Full-batch gradient descent on the mean squared error."""
    w, b = model["weights"].copy(), model["bias"].copy()
    for _ in range(steps):
        residual = x @ w + b - y
        w -= lr * 2.0 * (x.T @ residual) / len(y)
        b -= lr * 2.0 * np.mean(residual)
    return {"weights": w.astype(np.float32), "bias": np.asarray(b, np.float32)}
