"""The clipd command, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys


def test_demo_against_a_running_server(server):
    out = subprocess.run(
        [sys.executable, "-m", "clipd", "demo", "--target", f"127.0.0.1:{server.port}", "--examples", "300"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "aggregated 300 examples" in out.stdout
    assert "result matches the in-process computation" in out.stdout
    assert "dense/kernel" in out.stdout


def test_demo_fails_when_the_server_is_unreachable():
    out = subprocess.run(
        [sys.executable, "-m", "clipd", "demo", "--target", "127.0.0.1:1", "--examples", "10"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode != 0


def test_serve_help_lists_the_ports():
    out = subprocess.run([sys.executable, "-m", "clipd", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--host", "--grpc-port", "--admin-port"):
        assert flag in out.stdout
