"""Smoke runs of the benchmark scripts: they run to the end and print their closing ratio line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_service_benchmark_quick_run():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "service.py"), "--quick"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"service_vs_bare_grpc_ratio=\d+\.\d{3}", last), out.stdout


def test_engine_benchmark_quick_run():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--quick"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 new compilations" in out.stdout
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"engine_vs_optax_median_ratio=\d+\.\d{3}", last), out.stdout
