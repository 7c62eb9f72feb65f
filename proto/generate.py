"""Regenerates the Python gRPC code from proto/clipd/v1/clipd.proto.

Run from anywhere: ``python proto/generate.py``. The output is committed; a test
(tests/test_proto.py) regenerates it into a temporary folder and fails on drift.
The grpcio/protobuf floors in pyproject.toml must match the grpcio-tools pin.
"""

from __future__ import annotations

import pathlib
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
PROTO_FILE = "clipd/v1/clipd.proto"


def generate(out_dir: pathlib.Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO_FILE,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
