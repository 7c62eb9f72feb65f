"""Shared fixtures: a real clipd server on loopback (ephemeral port), one with an admin token, and a real client."""

from __future__ import annotations

import shutil
import tempfile

import background
import pytest

from clipd.client import Client
from clipd.server.app import create_server
from clipd.server.settings import Settings

TEST_SETTINGS = dict(host="127.0.0.1", grpc_port=0, admin_port=-1, max_device_rows=16,
                     max_message_bytes=4 << 20, max_aggregations=1000, data_dir="memory")
ADMIN_TOKEN = "admin-secret-4c1f"  # the admin credential of ``auth_server``

_JAX_CACHE: list[str] = []


def pytest_configure(config):
    """One JAX persistent compilation cache for this test process, fresh for the run (set before anything
    compiles): a program compiled again (jax_privacy's BLT optimizer for the same plan in the server and in
    an oracle, a step program of a layout that another test's server compiled) is read back, not compiled.
    It changes no result: a cached executable is the one XLA would compile."""
    import jax

    _JAX_CACHE.append(tempfile.mkdtemp(prefix="clipd-tests-jax-cache-"))
    jax.config.update("jax_compilation_cache_dir", _JAX_CACHE[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def jax_cache_dir() -> str:
    """This test process's JAX compilation cache (a server process given it shares its programs with the tests)."""
    return _JAX_CACHE[0]


def pytest_unconfigure(config):
    for path in _JAX_CACHE:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_finish(session):
    """Starts the selected tests' background jobs (tests/background.py), module by module in the order of the
    tests, on one thread beside the tests."""
    if session.config.option.collectonly or not session.items:
        return
    modules: dict = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and callable(getattr(module, "background_jobs", None)):
            modules.setdefault(module, []).append(item)
    jobs = [job for module, items in modules.items() for job in module.background_jobs(items, session.config)]
    if jobs:
        background.run_in_thread(background.register(jobs), "clipd-tests-background")


def pytest_sessionfinish(session):
    background.end_session()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server with a real (SQLite) store in a fresh directory: acknowledgements wait for checkpoints."""
    data_dir = tmp_path_factory.mktemp("clipd-data")
    server, _ = create_server(Settings(**{**TEST_SETTINGS, "data_dir": str(data_dir)}))
    yield server
    server.stop(grace=1.0)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """Auth on: a server with the admin token ``ADMIN_TOKEN``, the admin API on an ephemeral port, and a real
    (SQLite) store in a fresh directory."""
    data_dir = tmp_path_factory.mktemp("clipd-auth")
    server, _ = create_server(Settings(**{**TEST_SETTINGS, "admin_port": 0, "admin_token": ADMIN_TOKEN,
                                          "data_dir": str(data_dir)}))
    yield server
    server.stop(grace=1.0)


@pytest.fixture()
def client(server):
    with Client(f"127.0.0.1:{server.port}", message_bytes=64 << 10, max_message_bytes=4 << 20) as client:
        yield client
