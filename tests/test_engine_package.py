"""The engine package: its boundary (no service code) and its docstring examples."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import subprocess
import sys

import pytest

import clipd.engine


def test_engine_imports_neither_grpc_nor_fastapi():
    code = (
        "import sys, clipd.engine; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'grpc', 'fastapi', 'starlette', 'uvicorn', 'google'}); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


ENGINE_MODULES = sorted(
    f"clipd.engine.{m.name}" for m in pkgutil.iter_modules(clipd.engine.__path__)
)


@pytest.mark.parametrize("name", ENGINE_MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_every_public_name_is_documented_with_an_example():
    undocumented = [
        n for n in clipd.engine.__all__
        if callable(getattr(clipd.engine, n)) and ">>>" not in (getattr(clipd.engine, n).__doc__ or "")
        and n not in {"AccumulatorState", "BoundKind", "NonFinite", "LayerSpec", "merge"}
    ]
    assert undocumented == []
