"""The generated gRPC code is what proto/generate.py makes from the .proto (no drift), and it imports on
every runtime the client's dependencies allow."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATED_DIR = ROOT / "clipd" / "v1"
GENERATED = ["clipd/v1/clipd_pb2.py", "clipd/v1/clipd_pb2.pyi", "clipd/v1/clipd_pb2_grpc.py",
             "clipd/server/internal/v1/shard_host_pb2.py", "clipd/server/internal/v1/shard_host_pb2.pyi",
             "clipd/server/internal/v1/shard_host_pb2_grpc.py"]


def _load_generate():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    return generate


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _client_requirement(name: str) -> str:
    """The client-side (not extra) requirement on ``name`` in pyproject.toml, e.g. ``>=5.28,<8``."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = [d[len(name):].strip() for d in dependencies if re.match(rf"{re.escape(name)}\s*[<>=!~]", d)]
    assert len(found) == 1, f"pyproject.toml: expected one client requirement on {name}, got {found}"
    return found[0]


def _bound(spec: str, operator: str) -> tuple[int, ...]:
    found = re.findall(rf"{re.escape(operator)}\s*([0-9.]+)", spec)
    assert len(found) == 1, f"expected one {operator} in {spec!r}"
    return _version(found[0])


def test_generated_code_matches_the_proto(tmp_path):
    _load_generate().generate(tmp_path)
    for name in GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / name).read_text()
        assert fresh == committed, f"{name} is stale: run python proto/generate.py"


def test_generated_code_fits_the_client_dependency_floors():
    """Generated code refuses a protobuf older than its protoc and a grpcio older than its grpcio-tools:
    the client's floors must be at or above both, and the protobuf range must reach the server's 7.x."""
    generate = _load_generate()
    pb2 = (GENERATED_DIR / "clipd_pb2.py").read_text()
    found = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),"
                      r"\s*(\d+),\s*''", pb2)
    assert found, "clipd_pb2.py no longer validates the protobuf runtime the way this test expects"
    gencode = tuple(int(g) for g in found.groups())
    assert gencode == generate.GENCODE_PROTOBUF
    grpc_generated = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'",
                               (GENERATED_DIR / "clipd_pb2_grpc.py").read_text()).group(1)
    assert grpc_generated == generate.GENCODE_GRPC

    protobuf = _client_requirement("protobuf")
    assert _bound(protobuf, ">=") >= gencode, f"protobuf{protobuf} allows runtimes older than gencode {gencode}"
    assert _bound(protobuf, ">=") <= (5, 28), f"protobuf{protobuf} no longer admits Flower's protobuf 5.28"
    assert _bound(protobuf, "<") > (7,), f"protobuf{protobuf} excludes the server's protobuf 7"
    grpcio = _client_requirement("grpcio")
    assert _bound(grpcio, ">=") >= _version(grpc_generated), f"grpcio{grpcio} admits grpcio < {grpc_generated}"


def test_package_is_versioned():
    from clipd.v1 import clipd_pb2

    assert clipd_pb2.DESCRIPTOR.package == "clipd.v1"
    assert "Clipd" in clipd_pb2.DESCRIPTOR.services_by_name
