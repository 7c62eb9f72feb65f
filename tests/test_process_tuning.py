"""`clipd serve` tunes its own process (clipd/_process.py): glibc's mmap threshold, OpenBLAS's threads and the garbage collector, with no
environment variable set; its threads carry their names natively."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from service_helpers import ServerProcess, free_port, get_json

VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "OPENBLAS_NUM_THREADS")

# Where glibc puts an 8 MiB malloc: mallinfo2's hblkhd counts the bytes in mmapped chunks. By default (an mmap
# threshold of 128 KiB at first) it is mapped; under clipd's 32 MiB threshold it comes from the heap.
PROBE = """
import ctypes, json, os, sys
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
applied = {}
if sys.argv[1] == "tuned":
    from clipd import _process
    applied = _process.tune()
    assert "numpy" not in sys.modules
elif sys.argv[1].startswith("trainer"):  # a DP-SGD trainer's process: one call a step (or the separate calls)
    from clipd import _process
    from clipd.client import Client
    from clipd.client.dpsgd import DpSgd
    DpSgd(Client("127.0.0.1:1"), {"w": (4,)}, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.5,
          dataset_size=8, delta=1e-5, one_call=sys.argv[1] == "trainer")
    applied = _process.TUNED
before = libc.mallinfo2().hblkhd
block = libc.malloc(8 << 20)
mapped = libc.mallinfo2().hblkhd - before
step = libc.malloc(3 << 20)  # a DP-SGD step's request, freed: kept at the top of the heap for the next, or not
libc.free(step)
kept = libc.mallinfo2().keepcost
names = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "OPENBLAS_NUM_THREADS")
print(json.dumps({"mapped": mapped, "kept": kept, "applied": applied,
                  "env": {k: os.environ.get(k) for k in names}}))
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in VARIABLES}


def _probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], env=_clean_env(), capture_output=True, text=True,
                          timeout=60, check=True)
    return json.loads(done.stdout)


def test_tune_moves_large_mallocs_to_the_heap_and_passes_the_settings_to_children():
    plain, tuned = _probe("plain"), _probe("tuned")
    assert plain["mapped"] >= 8 << 20  # glibc's default: mapped, its pages faulted in again on each reuse
    assert tuned["mapped"] == 0  # below the 32 MiB threshold: from the heap
    assert plain["kept"] < 1 << 20 and tuned["kept"] >= 3 << 20  # a freed 3 MiB: given back, or kept for reuse
    assert tuned["applied"] == {
        "MALLOC_MMAP_THRESHOLD_": {"value": str(32 << 20), "source": "mallopt"},
        "MALLOC_TRIM_THRESHOLD_": {"value": str(8 << 20), "source": "mallopt"},
        "OPENBLAS_NUM_THREADS": {"value": "1", "source": "environment"},
    }
    assert tuned["env"] == {k: v["value"] for k, v in tuned["applied"].items()}  # what child processes read
    assert plain["env"] == dict.fromkeys(VARIABLES)


def test_a_one_call_dp_sgd_trainer_keeps_its_step_buffers_and_leaves_openblas_alone():
    """A trainer's process sends a step's megabytes every few milliseconds: a one-call DpSgd makes glibc keep them
    (the server's malloc settings), and leaves its OpenBLAS threads as they are; the separate calls change nothing."""
    trainer, separate = _probe("trainer"), _probe("trainer-separate")
    assert trainer["mapped"] == 0 and trainer["kept"] >= 3 << 20
    assert trainer["applied"] == {
        "MALLOC_MMAP_THRESHOLD_": {"value": str(32 << 20), "source": "mallopt"},
        "MALLOC_TRIM_THRESHOLD_": {"value": str(8 << 20), "source": "mallopt"},
    }
    assert trainer["env"]["OPENBLAS_NUM_THREADS"] is None
    assert separate["applied"] == {} and separate["mapped"] >= 8 << 20 and separate["kept"] < 1 << 20


def test_a_variable_in_the_environment_wins():
    env = {**_clean_env(), "MALLOC_MMAP_THRESHOLD_": "65536"}  # glibc read it at start-up: 8 MiB is mapped
    done = subprocess.run([sys.executable, "-c", PROBE, "tuned"], env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    probed = json.loads(done.stdout)
    assert probed["applied"]["MALLOC_MMAP_THRESHOLD_"] == {"value": "65536", "source": "environment"}
    assert probed["applied"]["OPENBLAS_NUM_THREADS"]["source"] == "environment"
    assert probed["mapped"] >= 8 << 20


def test_clipd_serve_tunes_itself_without_any_variable(tmp_path, monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    admin = free_port()
    server = ServerProcess(tmp_path / "data", tmp_path / "cache", free_port(), args=("--admin-port", str(admin)))
    server.start()
    try:
        tuning = get_json(f"http://127.0.0.1:{admin}/api/v1/server")["process_tuning"]
        names = set()
        for task in os.listdir(f"/proc/{server.proc.pid}/task"):
            with open(f"/proc/{server.proc.pid}/task/{task}/comm") as f:
                names.add(f.read().strip())
    finally:
        server.stop()
    # top -H shows which part of the server is busy: its Python threads' names (15 bytes) are the native ones.
    assert {"clipd-admin", "clipd-janitor"} <= names and any(n.startswith("clipd-device-wo") for n in names), names
    gc_tuning = tuning.pop("python_gc")
    assert {k: v["source"] for k, v in tuning.items()} == {
        "MALLOC_MMAP_THRESHOLD_": "mallopt", "MALLOC_TRIM_THRESHOLD_": "mallopt", "OPENBLAS_NUM_THREADS": "environment"}
    assert tuning["MALLOC_MMAP_THRESHOLD_"]["value"] == str(32 << 20)
    assert tuning["MALLOC_TRIM_THRESHOLD_"]["value"] == str(8 << 20)
    # Once serving, the start-up's objects (numpy's, JAX's, gRPC's: about 150,000) are out of the
    # collector's scans, and a young generation waits for 20,000 new objects (Python's default: 700).
    assert gc_tuning["value"] == "20000,20,20"
    frozen = int(gc_tuning["source"].removeprefix("gc.freeze (").removesuffix(" objects)"))
    assert frozen > 100_000, gc_tuning

