"""The example app (examples/flower_app) end to end: three rounds in flwr's own simulation runtime.

flwr.simulation.run_simulation runs the ServerApp in a thread with an InMemoryGrid over an in-memory
LinkState, and the Simulation Engine routes each message to a ClientApp with its node's context, as
`flwr run` does locally. Only the backend that executes ClientApps is swapped: Ray's actor pool for
calls in this process (flower_helpers.install_in_process_backend), since Ray is not installed here.
"""

from __future__ import annotations

import sys
import uuid

import numpy as np
import pytest
from flower_helpers import ROOT, install_in_process_backend

sys.path.insert(0, str(ROOT / "examples" / "flower_app"))

from clipd_flower_app import client_app, server_app, task  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402


def test_three_rounds_of_the_example_app(clipd_server, client, monkeypatch):
    install_in_process_backend()
    ledger_id = f"simulation-{uuid.uuid4().hex[:12]}"
    for key, value in {"clipd-target": clipd_server.target, "ledger-id": ledger_id, "num-server-rounds": 3,
                       "clients-per-round": 4, "noise-multiplier": 0.3, "clipping-norm": 2.0}.items():
        monkeypatch.setitem(server_app.DEFAULTS, key, value)
    server_app.last_run.clear()

    run_simulation(server_app=server_app.app, client_app=client_app.app, num_supernodes=5,
                   backend_name="in-process")

    result, strategy = server_app.last_run["result"], server_app.last_run["strategy"]
    assert strategy.stopped is None and len(strategy.releases) == 3
    ledger = client.ledger(ledger_id)
    assert len(ledger.entries) == 3
    epsilons = [entry.epsilon_after for entry in ledger.entries]
    assert epsilons == sorted(epsilons) and epsilons[0] > 0
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    assert result.train_metrics_clientapp[3]["ledger-epsilon"] == pytest.approx(epsilons[-1])
    assert "train-loss" not in result.train_metrics_clientapp[3]  # clients' own metrics are not released
    # the clients evaluated each round's model: it learned despite the clipping and the noise
    losses = [result.evaluate_metrics_clientapp[t]["eval-loss"] for t in (1, 2, 3)]
    start = np.mean([task.loss(task.initial_model(), *task.load_data(p)) for p in range(5)])
    assert losses[-1] < 0.6 * start, (start, losses)
