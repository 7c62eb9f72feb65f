"""A site of tests/test_nvflare.py's NVFlare jobs: it sends a known update each round, so the test can compute the
expected model with numpy.

Round 0: each site's update is under the clip bound; round 1: over it, and site-3 raises instead of answering
(its script ends there); round 2: bad input (site-1 a layer of another shape, site-2 NaN). It sends its whole
model (FULL), so the aggregator computes ``params - global`` itself; numpy arrays where it received them (NVFlare's
plain FedAvg with its initial model inline), else torch tensors.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

NORMS = {0: 0.1, 1: 2.0}  # the norm of site i's update in round r: NORMS[r] * i


class TinyNet(nn.Module):
    """4 inputs -> 3 outputs (15 parameters), its first weights known."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        with torch.no_grad():
            self.fc.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10)
            self.fc.bias.copy_(torch.tensor([0.5, -0.5, 0.25]))


def update(site: int, round_: int) -> dict[str, np.ndarray]:
    """Site ``site``'s (1-based) update in round ``round_`` (float64): a fixed direction, norm NORMS[r] * site."""
    rng = np.random.default_rng(100 + site)
    parts = {"fc.weight": rng.standard_normal((3, 4)), "fc.bias": rng.standard_normal(3)}
    norm = np.sqrt(sum(float(np.sum(p * p)) for p in parts.values()))
    return {k: p * (NORMS[round_] * site / norm) for k, p in parts.items()}


def main() -> None:
    import nvflare.client as flare

    flare.init()
    site = int(flare.get_site_name().rsplit("-", 1)[1])
    while flare.is_running():
        received = flare.receive()
        round_ = received.current_round
        numpy = not any(isinstance(v, torch.Tensor) for v in received.params.values())  # (FedAvg's inline model)
        current = {k: torch.as_tensor(v).double() for k, v in received.params.items()}
        if round_ == 1 and site == 3:
            raise RuntimeError("site-3 fails in round 1 (as the test asks)")
        if round_ in NORMS:
            new = {k: (current[k] + torch.from_numpy(u)).float() for k, u in update(site, round_).items()}
        else:  # round 2: bad input
            new = {k: v.float() for k, v in current.items()}
            if site == 1:
                new["fc.weight"] = torch.zeros(4, 3)
            else:
                new["fc.bias"] = torch.tensor([float("nan"), 1.0, 1.0])
        flare.send(flare.FLModel(params={k: v.numpy() for k, v in new.items()} if numpy else new,
                                 params_type=flare.ParamsType.FULL))


if __name__ == "__main__":
    main()
