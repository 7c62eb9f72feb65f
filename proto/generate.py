"""Regenerates the Python gRPC code from proto/clipd/v1/clipd.proto (the API, into clipd/v1/) and
proto/clipd/server/internal/v1/shard_host.proto (the server's internal protocol, into clipd/server/internal/v1/,
where only the server imports it).

Run from anywhere: ``python proto/generate.py`` writes both folders of the repository (or under
``OUT_DIR`` with ``python proto/generate.py OUT_DIR``).
The output is committed; tests/test_proto.py regenerates it into a temporary
folder and fails on drift.

The generator is pinned, and older than the protobuf the server runs on, on
purpose. Generated code checks the runtime it is imported into:

* ``clipd_pb2.py`` calls ``runtime_version.ValidateProtobufRuntimeVersion``
  with the version of the protoc that wrote it, and refuses a protobuf runtime
  OLDER than that (protobuf 5.27 to 7.x only check that direction);
* ``clipd_pb2_grpc.py`` compares ``GRPC_GENERATED_VERSION`` with the installed
  grpcio and refuses an older one.

So the code is written by grpcio-tools 1.67.1 (protoc 27.2: protobuf gencode
5.27.2, GRPC_GENERATED_VERSION 1.67.1). It imports on protobuf 5.28 (Flower
1.41 allows >= 5.28, < 7) as well as on 7.x (the server's grpcio-health-checking
and grpcio-reflection 1.85 need >= 7.35), which a newer generator can't give:
grpcio-tools 1.85.1 (protoc 35) writes gencode that refuses every protobuf below 7.35.1. The generated
code is otherwise the same, byte for byte, as grpcio-tools 1.85.1 writes (the
version stamps and the .pyi's typing imports aside). The client's floors in
pyproject.toml (protobuf >= 5.28, grpcio >= 1.67.1) must stay at or above
these versions; tests/test_proto.py checks that.

grpcio-tools 1.67.1 can't share an environment with protobuf 7 (it requires
protobuf < 6), and only its compiler is needed: it is installed with
``pip install --no-deps --target`` into ``.cache/proto-generator/`` of the
repository (once per Python version; ``CLIPD_PROTO_GENERATOR_DIR`` moves it) and
run in a subprocess with that folder first on ``sys.path``.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTO_FILES = ("clipd/v1/clipd.proto", "clipd/server/internal/v1/shard_host.proto")  # the API; the internal one
GENERATED = {"clipd/v1": ("clipd",), "clipd/server/internal/v1": ("shard_host",)}  # folder: its modules' stems

GENERATOR = "grpcio-tools==1.67.1"
GENCODE_PROTOBUF = (5, 27, 2)  # what GENERATOR's protoc writes into clipd_pb2.py
GENCODE_GRPC = "1.67.1"  # GRPC_GENERATED_VERSION in clipd_pb2_grpc.py

_RUN_PROTOC = """
import sys
generator = sys.argv[1]
sys.path.insert(0, generator)
import grpc_tools
from grpc_tools import protoc
if not grpc_tools.__file__.startswith(generator):
    sys.exit(f"proto/generate.py: imported grpc_tools from {grpc_tools.__file__}, not from {generator}")
include = grpc_tools.__path__[0] + "/_proto"
sys.exit(protoc.main(["protoc", *sys.argv[2:3], "-I" + include, *sys.argv[3:]]))
"""


def generator_dir() -> pathlib.Path:
    """The folder holding the pinned grpcio-tools (installed on first use)."""
    base = pathlib.Path(os.environ.get("CLIPD_PROTO_GENERATOR_DIR") or REPO_ROOT / ".cache" / "proto-generator")
    target = base / f"{GENERATOR.replace('==', '-')}-{sys.implementation.cache_tag}"
    if (target / "grpc_tools" / "protoc.py").is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=target.name + ".", dir=base))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--no-compile", "--target", str(staging), GENERATOR],
            capture_output=True, text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"proto/generate.py: could not install {GENERATOR} into {staging}:\n"
                             f"{done.stderr.strip() or done.stdout.strip()}")
        try:
            staging.rename(target)  # atomic: a concurrent run that won the race keeps its copy
        except OSError:
            if not (target / "grpc_tools" / "protoc.py").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def generate(out_dir: pathlib.Path) -> None:
    """Writes clipd/v1/clipd_pb2*.py(i) and clipd/server/internal/v1/shard_host_pb2*.py(i) under ``out_dir``."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *PROTO_FILES]
    done = subprocess.run([sys.executable, "-c", _RUN_PROTOC, str(generator_dir()), *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"proto/generate.py: protoc failed:\n{done.stderr.strip() or done.stdout.strip()}")
    stamp = "# Protobuf Python Version: {}.{}.{}".format(*GENCODE_PROTOBUF)
    if any(stamp not in (out_dir / folder / f"{name}_pb2.py").read_text()
           for folder, names in GENERATED.items() for name in names):
        raise SystemExit(f"proto/generate.py: {GENERATOR} did not write protobuf {GENCODE_PROTOBUF} gencode")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT)
