"""ClipdAsyncStrategy (FedBuff through a clipd stream on Flower's Grid), in flwr's own simulation runtime with
nodes trained four at a time (flower_helpers.install_in_process_backend): two slow nodes and four fast ones.
Training goes on while the slow nodes work, every contribution lands in the stream with the version it trained
from, and the model is the releases applied in order."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
from conftest import ADMIN_TOKEN
from flower_helpers import install_in_process_backend
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from clipd.client import Buffer, Client, Privacy
from clipd.client.flower_async import VERSION_KEY, ClipdAsyncStrategy

SLOW = {0, 1}  # node partitions whose training takes long
WIDTH = 8


def _warm(target: str) -> None:
    """A throwaway stream of the same shape, one contribution and its release: the fresh server compiles its
    steps and its release's programs here (seconds), not while the test's slow nodes race the fast ones."""
    with Client(target, token=ADMIN_TOKEN, retry_timeout=30.0) as clipd:
        sid = clipd.create_stream({"0": (WIDTH,)}, l2_norm_clip=1.0, buffer=Buffer(size=1),
                                  privacy=Privacy(f"warm-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=0.0,
                                                  max_participations=1, release_mean=True))
        clipd.submit_to_stream(sid, {"0": np.zeros(WIDTH, np.float32)}, trained_from=0, client_id="warm")
        next(clipd.watch_releases(sid, timeout=60))


def test_training_goes_on_while_slow_nodes_work_and_the_model_is_the_releases_in_order(auth_clipd_server):
    install_in_process_backend(workers=4)
    _warm(auth_clipd_server.target)
    seen: list[tuple[int, int, float]] = []  # (partition, version trained from, when it replied)
    lock = threading.Lock()
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        time.sleep(4.0 if partition in SLOW else 0.05)
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        step = np.full(WIDTH, 0.01 * (partition + 1), np.float32)
        with lock:
            seen.append((partition, int(msg.content["config"][VERSION_KEY]), time.monotonic()))
        return Message(RecordDict({"arrays": ArrayRecord([arrays[0] + step])}), reply_to=msg)

    server_app = ServerApp()
    outcome: dict = {}

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        with Client(auth_clipd_server.target, token=ADMIN_TOKEN, retry_timeout=30.0) as clipd:
            strategy = ClipdAsyncStrategy(
                clipd, clipping_norm=1.0, concurrency=6, buffer=Buffer(size=3, max_staleness=20),
                privacy=Privacy(f"async-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=0.0, max_participations=50,
                                min_separation=1), server_learning_rate=0.5)
            outcome["started"] = time.monotonic()
            outcome["result"] = strategy.start(grid, ArrayRecord([np.zeros(WIDTH, np.float32)]), num_versions=8,
                                               timeout=120)
            outcome["strategy"] = strategy

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=6, backend_name="in-process")

    strategy, result = outcome["strategy"], outcome["result"]
    assert strategy.stopped is None and strategy.version >= 8
    first_slow = min(t for p, _, t in seen if p in SLOW)
    # No waiting on them: before a slow node's first reply, fast nodes had trained on released versions.
    assert max(v for p, v, t in seen if p not in SLOW and t < first_slow) >= 1
    model = np.zeros(WIDTH)
    for release in strategy.releases:  # the model: each release's mean, times the server's step, in order
        model = model + 0.5 * np.asarray(release.sums["0"], np.float64)
    np.testing.assert_allclose(result.arrays.to_numpy_ndarrays()[0], model, rtol=1e-5, atol=1e-6)
    assert [r.version for r in strategy.releases] == list(range(1, len(strategy.releases) + 1))
    assert any(max(r.release.staleness) > 0 for r in strategy.releases)  # slow nodes' updates landed stale
