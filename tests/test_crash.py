"""Exactly once through crashes: ``clipd serve --data-dir`` as a real process, killed with SIGKILL.

Three clients with fixed ids stream throttled batches (each example is chunked
over several messages, so kills land mid-batch) while the server is killed at
random moments three times: once wherever it lands (between or inside batches),
and twice while a checkpoint file is being written (the test waits for a ``*.tmp``
file to appear under the store's ``states/`` directory). Each time it is restarted
on the same directory and port. In the end the example and clip counts are
exact and the sums equal a float64 numpy reference computed here, independently
of clipd's code. A finalized result then survives one more SIGKILL, bit for bit.
"""

from __future__ import annotations

import os
import pathlib
import random
import threading
import time

import numpy as np
from helpers import wait_until
from service_helpers import ServerProcess, free_port

from clipd.client import Client

LAYERS = {"big": (1 << 18,), "w": (16, 8)}  # 1 MiB + 512 B per example: 4+ chunks of 256 KiB
CLIP = 20.0
EXAMPLES_PER_BATCH = 2


def _batch(client: int, index: int) -> dict[str, np.ndarray]:
    """Batch ``index`` of client ``client``: deterministic, norms spread around the bound."""
    rng = np.random.default_rng([client, index])
    scale = np.exp(rng.uniform(-1.5, 1.5, EXAMPLES_PER_BATCH)) * CLIP / np.sqrt(1 << 18)
    return {
        name: (rng.standard_normal((EXAMPLES_PER_BATCH, *shape)) * scale.reshape((-1,) + (1,) * len(shape)))
        .astype(np.float32)
        for name, shape in LAYERS.items()
    }


def _reference(batches) -> tuple[dict[str, np.ndarray], int, int]:
    """Global-norm clipped sums in float64 numpy, the clip count and the example count."""
    sums = {name: np.zeros(shape) for name, shape in LAYERS.items()}
    clipped = examples = 0
    for batch in batches:
        x = {name: batch[name].astype(np.float64).reshape(EXAMPLES_PER_BATCH, -1) for name in LAYERS}
        norms = np.sqrt(sum((v**2).sum(axis=1) for v in x.values()))
        factor = np.minimum(1.0, CLIP / norms)
        clipped += int((norms > CLIP).sum())
        examples += len(norms)
        for name, shape in LAYERS.items():
            sums[name] += (factor @ x[name]).reshape(shape)
    return sums, clipped, examples


def _states_dir_has_tmp(states: pathlib.Path) -> bool:
    try:
        return any(f.name.endswith(".tmp") for d in os.scandir(states) if d.is_dir() for f in os.scandir(d.path))
    except FileNotFoundError:
        return False


def test_sigkill_at_random_points_loses_nothing_and_counts_nothing_twice(tmp_path):
    rng = random.Random(8)
    server = ServerProcess(tmp_path / "data", tmp_path / "jax-cache", free_port())
    server.start()
    target = f"127.0.0.1:{server.port}"
    stop_producing = threading.Event()
    produced = {c: 0 for c in range(3)}  # batches handed to each client (regenerated for the reference)
    reports, errors = {}, []
    try:
        with Client(target, message_bytes=256 << 10, retry_delay=0.05) as admin:
            agg = admin.create_aggregation(LAYERS, l2_norm_clip=CLIP, aggregation_id="crash-test")

        def updates(client: int):
            index = 0
            while not stop_producing.is_set() or index < 4:
                batch = _batch(client, index)
                produced[client] = index + 1
                yield batch
                index += 1
                time.sleep(0.1)

        def run_client(client: int) -> None:
            try:
                with Client(target, message_bytes=256 << 10, window_bytes=8 << 20, retry_delay=0.05) as c:
                    reports[client] = c.submit(agg, updates(client), client_id=f"client-{client}")
            except Exception as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=run_client, args=(c,)) for c in range(3)]
        for t in threads:
            t.start()
        # Three kills (there were four: a second kill at a random moment added a restart, ~3 s, and no case the
        # others miss): one at a random moment, then two during a checkpoint write.
        for round_ in range(3):
            time.sleep(rng.uniform(0.3, 1.2))
            if round_ in (1, 2):  # during a checkpoint write
                wait_until(lambda: _states_dir_has_tmp(server.data_dir / "states"), 5, "a checkpoint write seen",
                           step=0.0005)
            server.kill()
            time.sleep(rng.uniform(0.0, 0.5))
            server.start()
        stop_producing.set()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert server.kills == 3

        with Client(target, message_bytes=256 << 10) as admin:
            result = admin.finalize(agg)
        sums, clipped, examples = _reference(_batch(c, i) for c in range(3) for i in range(produced[c]))
        assert sum(r.examples for r in reports.values()) == examples  # reports count acknowledged only
        assert result.examples == examples
        assert result.clip_counts == {"big": clipped, "w": clipped}
        for name in LAYERS:
            scale = np.abs(sums[name]).max()
            np.testing.assert_allclose(result.sums[name], sums[name], rtol=1e-5, atol=1e-5 * scale)

        server.kill()  # a finalized result survives another crash, bit for bit
        server.start()
        with Client(target, message_bytes=256 << 10) as admin:
            again = admin.finalize(agg)
            assert admin.get_aggregation(agg).state == 3  # FINALIZED
        assert again.examples == result.examples and again.clip_counts == result.clip_counts
        for name in LAYERS:
            assert again.sums[name].tobytes() == result.sums[name].tobytes()
    finally:
        stop_producing.set()
        server.stop()
