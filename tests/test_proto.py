"""The generated gRPC code is what proto/generate.py makes from the .proto (no drift)."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATED = ["clipd_pb2.py", "clipd_pb2.pyi", "clipd_pb2_grpc.py"]


def test_generated_code_matches_the_proto(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.generate(tmp_path)
    for name in GENERATED:
        fresh = (tmp_path / "clipd" / "v1" / name).read_text()
        committed = (ROOT / "proto" / "clipd" / "v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run python proto/generate.py"


def test_package_is_versioned():
    from clipd.v1 import clipd_pb2

    assert clipd_pb2.DESCRIPTOR.package == "clipd.v1"
    assert "Clipd" in clipd_pb2.DESCRIPTOR.services_by_name
