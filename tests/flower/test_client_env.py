"""The client side installs and works without the server extra: beside Flower (protobuf 6.x here), and at its
lowest declared versions (protobuf 5.28.0, grpcio 1.67.1, numpy 1.26.4: CLIPD_FLOOR_PYTHON)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

# what only clipd's server extra brings (flwr itself needs fastapi, uvicorn and grpcio-health-checking)
# dp_accounting is not on the list: this venv installs it for Flower's own RdpAccountant (test_accounting.py),
# as a Flower user who accounts with Flower would; clipd's client side does not need it.
SERVER_ONLY = ["jax", "prometheus_client", "grpc_reflection", "swagger_ui_bundle"]


def _run(python: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([python, *args], capture_output=True, text=True, timeout=timeout)


def test_this_environment_is_flower_without_the_server_extra():
    assert importlib.metadata.version("flwr") == "1.41.0"
    assert int(importlib.metadata.version("protobuf").split(".")[0]) < 7  # what flwr 1.41 allows
    assert [m for m in SERVER_ONLY if importlib.util.find_spec(m) is not None] == []
    from clipd.v1 import clipd_pb2, clipd_pb2_grpc  # the generated code imports on this protobuf

    assert clipd_pb2_grpc.ClipdStub and "GetLedger" in clipd_pb2.DESCRIPTOR.services_by_name["Clipd"].methods_by_name


def test_the_server_says_which_extra_it_needs():
    code = "import clipd.server"
    done = _run(sys.executable, "-c", code)
    assert done.returncode != 0 and "pip install '.[server]'" in done.stderr
    done = _run(sys.executable, "-m", "clipd", "serve", "--grpc-port", "0")
    assert done.returncode == 1
    assert done.stderr.startswith("clipd: error: clipd serve:") and "pip install '.[server]'" in done.stderr
    done = _run(sys.executable, "-m", "clipd", "demo", "--examples", "10")
    assert done.returncode == 1 and "--target" in done.stderr and "'.[server]'" in done.stderr


def test_demo_against_a_server_from_this_environment(clipd_server):
    done = _run(sys.executable, "-m", "clipd", "demo", "--target", clipd_server.target, "--examples", "300")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "result matches the in-process computation" in done.stdout  # against numpy: no JAX here


def test_demo_at_the_lowest_versions_the_client_declares(clipd_server):
    python = os.environ.get("CLIPD_FLOOR_PYTHON")
    if not python:
        pytest.skip("CLIPD_FLOOR_PYTHON is not set: scripts/test.sh builds .cache/client-floor-venv")
    versions = _run(python, "-c", "import google.protobuf, grpc, numpy; "
                                  "print(google.protobuf.__version__, grpc.__version__, numpy.__version__)")
    assert versions.stdout.split() == ["5.28.0", "1.67.1", "1.26.4"], versions.stderr
    done = _run(python, "-m", "clipd", "demo", "--target", clipd_server.target, "--examples", "300",
                "--policy", "per_layer_proportional")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "result matches the in-process computation" in done.stdout
    done = _run(python, "-m", "clipd", "demo", "--target", clipd_server.target, "--examples", "100",
                "--noise-multiplier", "1.0", "--rounds", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "epsilon=" in done.stdout.splitlines()[-1]
