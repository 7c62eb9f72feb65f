"""Helpers of the Flower tests: a clipd server subprocess, replies as a Grid delivers them, and Flower's
simulation runtime without Ray."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import threading
import types

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVER_START_TIMEOUT = 90.0


class ServerProcess:
    """``clipd serve`` on an ephemeral loopback port (the port it prints), state in memory."""

    def __init__(self, python: str, cwd: pathlib.Path, *args: str) -> None:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [python, "-m", "clipd", "serve", "--host", "127.0.0.1", "--grpc-port", "0", "--admin-port", "-1",
             "--data-dir", "memory", "--log-level", "warning", *args],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        found: list[str] = []
        reader = threading.Thread(target=self._read_port, args=(found,), daemon=True)
        reader.start()
        reader.join(SERVER_START_TIMEOUT)
        if not found:
            self.stop()
            raise RuntimeError(f"clipd serve did not report its port within {SERVER_START_TIMEOUT:g} s:\n"
                               + "".join(self.stderr)[-3000:])
        self.target = found[0]

    def _read_port(self, found: list[str]) -> None:
        for line in self.proc.stdout:
            match = re.search(r"serving gRPC on (\S+):(\d+)", line)
            if match:
                found.append(f"127.0.0.1:{match.group(2)}")
                break
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()



# Replies as the Grid hands them to a strategy ---------------------------------------------------------
def instruction(node_id: int, arrays: ArrayRecord, server_round: int = 1) -> Message:
    return Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round})}),
                   dst_node_id=node_id, message_type=MessageType.TRAIN)


def reply(node_id: int, arrays: list[np.ndarray] | dict[str, np.ndarray], num_examples: int = 1) -> Message:
    """The ClientApp's answer to a train instruction from node ``node_id``."""
    record = ArrayRecord(arrays) if isinstance(arrays, list) else ArrayRecord(
        {k: Array(np.asarray(v)) for k, v in arrays.items()})
    return Message(RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": num_examples})}),
                   reply_to=instruction(node_id, record))


def error_reply(node_id: int) -> Message:
    return Message(Error(code=0, reason="the ClientApp raised"), reply_to=instruction(node_id, ArrayRecord()))


class FixedGrid:
    """What ``configure_train`` needs of a Grid: the node ids (sampling)."""

    def __init__(self, nodes: int) -> None:
        self.nodes = list(range(1001, 1001 + nodes))

    def get_node_ids(self):
        return list(self.nodes)


# Flower's simulation runtime, without Ray --------------------------------------------------------------
def install_in_process_backend(workers: int = 1) -> None:
    """Lets ``flwr.simulation.run_simulation`` run ClientApps in this process instead of Ray actors.

    Everything else is flwr's own simulation runtime: the in-memory LinkState and InMemoryGrid, the
    ServerApp thread, the node contexts and message routing of the Simulation Engine. Only the backend
    that executes a ClientApp (flwr's RayBackend, which ``start_vce`` imports by name) is replaced by
    one that calls ``client_app(message, context)`` here, ``workers`` messages at a time (the Simulation
    Engine's worker threads); ``run_simulation`` must then be called with a backend name other than "ray" (its
    check for the ray package).
    """
    from flwr.server.superlink.fleet.vce.backend.backend import Backend

    class InProcessBackend(Backend):
        def __init__(self, backend_config) -> None:
            self.app_fn = None

        def build(self, app_fn) -> None:
            self.app_fn = app_fn

        @property
        def num_workers(self) -> int:
            return workers

        def is_worker_idle(self) -> bool:
            return True

        def terminate(self) -> None:
            pass

        def process_message(self, message, context):
            return self.app_fn()(message=message, context=context), context

    module = types.ModuleType("flwr.server.superlink.fleet.vce.backend.raybackend")
    module.RayBackend = InProcessBackend
    sys.modules[module.__name__] = module
