"""Large updates from the client: no whole copies of the caller's arrays (a batch is encoded a message at a
time, as it is sent), the 16-bit wire formats of float32 layers (against ml_dtypes and numpy, bit for bit),
and the progress line. Unit tests without a server, but for one submission through the test server."""

from __future__ import annotations

import gc
import io
import queue
import threading
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from clipd import wire
from clipd.client import _client as client_internals
from clipd.client.updates import Layer, as_batch, example_nbytes, iter_updates, rebatch
from clipd.v1 import clipd_pb2 as pb

MiB = 1 << 20


# 16-bit wire formats ------------------------------------------------------------------------------
def _hard_floats() -> np.ndarray:
    """float32 values where a rounding goes wrong if it can: every bfloat16 (the upper 16 bits) with the
    low halves of a tie, just under and over one, the extremes; the specials; random bit patterns."""
    uppers = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    grid = (uppers[:, None] | lows[None, :]).reshape(-1)
    specials = np.array([
        0x00000000, 0x80000000,  # +-0
        0x7F800000, 0xFF800000,  # +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC08000,  # NaNs
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7E8000,  # max float, near it, ties below it
        0x00800000, 0x80800000, 0x007FFFFF, 0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x00017FFF,  # subnormals
        0x3F808000, 0x3F818000, 0x3F800001, 0xBF808000,  # ties at 1: to even (down), to even (up), just over
    ], np.uint32)
    rng = np.random.default_rng(0)
    random = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([specials, grid, random]).view(np.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # ml_dtypes warns of the NaNs and infs it converts
def test_bfloat16_is_ml_dtypes_conversion_bit_for_bit():
    x = _hard_floats()
    mine = wire.to_wire_dtype(x, "bfloat16")
    assert mine.dtype == np.dtype("<u2") and mine.shape == x.shape
    expected = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    wrong = np.flatnonzero(mine != expected)
    assert wrong.size == 0, [(hex(x.view(np.uint32)[i]), hex(mine[i]), hex(expected[i])) for i in wrong[:5]]
    # The spot checks: ties to even, the largest float rounds to inf, NaN stays NaN (quiet, its sign), no flush.
    def bits(*v):
        return wire.to_wire_dtype(np.array(v, np.uint32).view(np.float32), "bfloat16").tolist()

    assert bits(0x3F808000, 0x3F818000, 0x3F808001) == [0x3F80, 0x3F82, 0x3F81]
    assert bits(0x7F7FFFFF, 0xFF7FFFFF, 0x7F800001, 0xFFFFFFFF) == [0x7F80, 0xFF80, 0x7FC0, 0xFFC0]
    assert bits(0x00010000, 0x00018000, 0x00008000) == [0x0001, 0x0002, 0x0000]


def test_bfloat16_is_jax_conversion_bit_for_bit():
    jnp = pytest.importorskip("jax.numpy")
    x = _hard_floats()
    expected = np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16)
    np.testing.assert_array_equal(wire.to_wire_dtype(x, "bfloat16"), expected)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy warns of the values beyond float16's range
def test_float16_is_numpy_conversion_and_overflows_to_inf():
    x = np.concatenate([_hard_floats(), np.array([65504, 65519.99, 65520, -1e9, 6e-8, 2e-8], np.float32)])
    mine = wire.to_wire_dtype(x, "float16")
    assert mine.dtype == np.dtype("<f2")
    np.testing.assert_array_equal(mine.view(np.uint16), x.astype(np.float16).view(np.uint16))
    assert mine[-6:].tolist()[:4] == [65504, 65504, np.inf, -np.inf]  # beyond 65504 (after rounding): inf


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_widening_the_wire_data_is_the_oracles_round_trip(name):
    x = _hard_floats()
    oracle = x.astype(ml_dtypes.bfloat16 if name == "bfloat16" else np.float16).astype(np.float32)
    data = wire.to_wire_dtype(x, name).tobytes()
    out = np.full(x.size, 7.0, np.float32)
    assert wire.widen_into(memoryview(data), name, out) is out
    np.testing.assert_array_equal(out.view(np.uint32), oracle.view(np.uint32))  # NaNs too, bit for bit
    part = np.empty(3, np.float32)  # a chunk's slice of the data, as the server hands it over
    wire.widen_into(memoryview(data)[20:26], name, part)
    np.testing.assert_array_equal(part.view(np.uint32), oracle[10:13].view(np.uint32))


def test_widen_into_refuses_what_does_not_fit():
    data = wire.to_wire_dtype(np.ones(4, np.float32), "bfloat16").tobytes()
    for out in (np.empty(3, np.float32), np.empty(4, np.float64), np.empty((2, 2), np.float32)):
        with pytest.raises(ValueError):
            wire.widen_into(data, "bfloat16", out)
    with pytest.raises(ValueError):
        wire.widen_into(data[:7], "bfloat16", np.empty(3, np.float32))
    with pytest.raises(ValueError):
        wire.widen_into(data, "float32", np.empty(4, np.float32))
    with pytest.raises(ValueError, match="wire_dtype"):
        wire.submit_batch("a", "c", 1, [np.ones((1, 2), np.float32)], 64, wire_dtype="int8")
    assert wire.accepts_wire_dtype("float32", "float16") and not wire.accepts_wire_dtype("float16", "bfloat16")


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("max_bytes", [1, 7, 64, 1 << 20])
def test_a_narrow_batch_parses_back_into_chunks_covering_the_2_byte_tensors(wire_dtype, max_bytes):
    rng = np.random.default_rng(max_bytes)
    batch = [rng.standard_normal((3, 5, 4)).astype(np.float32), rng.standard_normal((3, 2)),  # float64: as it is
             rng.standard_normal((3, 7)).astype(np.float32)]
    code = wire.DTYPES[wire_dtype]
    received = [bytearray() for _ in batch]
    messages = wire.submit_batch("agg", "c", 4, batch, max_bytes, "w", wire_dtype=wire_dtype)
    assert messages == list(wire.iter_submit_batch("agg", "c", 4, batch, max_bytes, "w", wire_dtype))
    for message in messages:
        parsed = wire.parse_submit_request(message)
        assert (parsed.sequence, parsed.writer_id) == (4, "w")
        assert sum(len(c.data) for c in parsed.chunks) <= max(max_bytes, 8)  # a chunk holds one element at least
        for chunk in parsed.chunks:
            array = batch[chunk.layer]
            assert chunk.shape == array.shape  # the whole tensor's
            assert chunk.offset == len(received[chunk.layer])  # in order, contiguous
            if array.dtype == np.float32:
                assert chunk.dtype == code and chunk.offset % 2 == 0 and len(chunk.data) % 2 == 0
            else:
                assert chunk.dtype == pb.FLOAT64
            received[chunk.layer] += chunk.data
    for array, data in zip(batch, received):
        if array.dtype != np.float32:
            np.testing.assert_array_equal(wire.as_array(data, "float64", array.shape), array)
            continue
        assert len(data) == 2 * array.size  # covers the whole 2-byte tensor
        assert bytes(data) == wire.to_wire_dtype(array.reshape(-1), wire_dtype).tobytes()
        out = wire.widen_into(data, wire_dtype, np.empty(array.size, np.float32))
        oracle = array.astype(ml_dtypes.bfloat16 if wire_dtype == "bfloat16" else np.float16).astype(np.float32)
        np.testing.assert_array_equal(out.reshape(array.shape), oracle)
    assert wire.wire_nbytes(batch, wire_dtype) == (60 + 21) * 2 + 6 * 8 == sum(map(len, received))
    assert wire.wire_nbytes(batch) == (60 + 21) * 4 + 6 * 8


def test_a_big_endian_array_is_swapped_piece_by_piece():
    values = np.arange(30, dtype=np.float64).reshape(3, 10) / 7
    for max_bytes in (5, 16, 1000):
        messages = wire.submit_batch("agg", "c", 1, [values.astype(">f8")], max_bytes)
        data = b"".join(bytes(c.data) for m in messages for c in wire.parse_submit_request(m).chunks)
        assert data == values.astype("<f8").tobytes()
    narrow = wire.submit_batch("agg", "c", 1, [values.astype(">f4")], 16, wire_dtype="bfloat16")
    data = b"".join(bytes(c.data) for m in narrow for c in wire.parse_submit_request(m).chunks)
    assert data == wire.to_wire_dtype(values.astype(np.float32).reshape(-1), "bfloat16").tobytes()


# No whole copies ----------------------------------------------------------------------------------
def test_one_large_example_passes_through_as_a_view():
    layers = [Layer("w", (1 << 16,), "float32"), Layer("b", (8,), "float32")]
    example = {"w": np.ones(1 << 16, np.float32), "b": np.ones(8, np.float32)}
    batch = as_batch(example, layers)
    assert np.shares_memory(batch[0], example["w"]) and np.shares_memory(batch[1], example["b"])
    [rebatched] = rebatch(iter_updates(example, layers), example_nbytes(layers), 1024)
    assert np.shares_memory(rebatched[0], example["w"])
    rows = np.ones((3, 1 << 16), np.float32), np.ones((3, 8), np.float32)  # a batch of large examples: a view each
    for k, part in enumerate(rebatch(iter_updates(list(rows), layers), example_nbytes(layers), 1024)):
        assert part[0].shape == (1, 1 << 16) and np.shares_memory(part[0], rows[0][k])
    assert not np.shares_memory(as_batch(example["w"].astype(np.float64), layers[:1])[0], example["w"])  # converted
    assert example_nbytes(layers, "bfloat16") == example_nbytes(layers) // 2


def _stream(batches, *, message_bytes=2 * MiB, window_bytes=256 * MiB, wire_dtype=None):
    stream = client_internals._BatchStream("agg", "c", iter(batches), message_bytes, window_bytes, wire_dtype)
    requests = stream.requests()
    hello = next(requests)
    assert wire.parse_submit_request(hello).chunks == []
    stream.greet(pb.SubmitResponse())  # a new client: its batches are numbered from 1
    return stream, requests


@pytest.mark.parametrize("wire_dtype", [None, "bfloat16", "float16"])
def test_encoding_a_64_mib_update_holds_a_few_messages_not_the_update(wire_dtype):
    """The memory test: the request generator of a stream over one example of 64 MiB, messages of 2 MiB
    consumed and dropped: the peak of traced memory (numpy's allocations included) stays a few messages,
    not the update's size. (Encoding the whole batch up front, as the client once did, peaks at 64 MiB.)"""
    layers = [Layer("model", (1 << 24,), "float32")]
    update = np.random.default_rng(1).standard_normal(1 << 24, dtype=np.float32)  # 64 MiB, not traced
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        batches = rebatch(iter_updates(update, layers), example_nbytes(layers, wire_dtype), 2 * MiB)
        stream, requests = _stream(batches, wire_dtype=wire_dtype)
        count = data_bytes = 0
        for message in requests:
            count += 1
            data_bytes += sum(len(chunk.data) for chunk in wire.parse_submit_request(message).chunks)
            del message
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    wire_bytes = update.nbytes // (2 if wire_dtype else 1)
    assert data_bytes == wire_bytes and count == wire_bytes // (2 * MiB)
    assert peak < 16 * MiB, f"peak {peak / MiB:.1f} MiB while encoding"
    assert current < 4 * MiB, f"{current / MiB:.1f} MiB still held after encoding"
    [entry] = stream._window  # sent, not acknowledged: the caller's array, no serialized bytes
    assert len(entry.batch) == 1 and np.shares_memory(entry.batch[0], update)
    assert not [v for v in vars(entry).values() if isinstance(v, (bytes, bytearray, memoryview))]
    assert (entry.nbytes, entry.wire_bytes, entry.sent_bytes) == (update.nbytes, wire_bytes, wire_bytes)
    assert stream.wire_bytes_sent == wire_bytes and stream.in_flight() == (1, wire_bytes, wire_bytes)
    stream.acknowledge(1)
    assert stream.complete and stream.wire_bytes_acked == wire_bytes and stream.bytes_acked == update.nbytes


def test_iter_submit_batch_makes_a_message_at_a_time():
    update = np.ones((1, 1 << 24), np.float32)  # 64 MiB
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        messages = wire.iter_submit_batch("agg", "c", 1, [update], 2 * MiB, "w", "bfloat16")
        assert sum(1 for _ in messages) == 16
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * MiB, f"peak {peak / MiB:.1f} MiB"


def _pump(requests) -> queue.Queue:
    """The messages of a request generator, read on a thread of their own (as gRPC reads them)."""
    out: queue.Queue = queue.Queue()

    def run() -> None:
        for message in requests:
            out.put(wire.parse_submit_request(message))
        out.put(None)

    threading.Thread(target=run, daemon=True).start()
    return out


def _take(out: queue.Queue, n: int) -> list:
    return [out.get(timeout=10) for _ in range(n)]


def test_a_batch_larger_than_the_window_is_sent_alone_and_resent_after_a_reconnect():
    examples = [np.full((1, 1024), k, np.float32) for k in range(3)]  # 4 KiB each, the window 1 KiB
    stream, requests = _stream([[e] for e in examples], message_bytes=1024, window_bytes=1024)
    out = _pump(requests)
    first = _take(out, 4)  # batch 1, in 4 messages; then nothing until it is acknowledged
    assert {m.sequence for m in first} == {1}
    with pytest.raises(queue.Empty):
        out.get(timeout=0.2)
    assert stream.unacknowledged == 1 and stream.wire_bytes_sent == 4096
    stream.acknowledge(1)
    assert {m.sequence for m in _take(out, 4)} == {2}
    # A reconnect: the new attempt encodes batch 2 again, from the arrays, the same messages.
    again = stream.requests()
    next(again)
    stream.greet(pb.SubmitResponse(accepted_sequence=2, acknowledged_sequence=1))
    resent = [wire.parse_submit_request(m) for m in [next(again) for _ in range(4)]]
    assert [m.sequence for m in resent] == [2] * 4
    assert b"".join(bytes(c.data) for m in resent for c in m.chunks) == examples[1].tobytes()
    assert out.get(timeout=10) is None  # the old attempt's generator ends
    stream.acknowledge(2)
    assert [m.sequence for m in [wire.parse_submit_request(next(again)) for _ in range(4)]] == [3] * 4
    stream.acknowledge(3)
    assert list(again) == [] and stream.complete and stream.examples_acked == 3


# Progress -----------------------------------------------------------------------------------------
class _Fake:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_the_progress_line_shows_a_bar_and_what_the_server_says():
    stream = client_internals._BatchStream("agg", "c", iter(()), 1024, 1 << 20)
    stream.greet(pb.SubmitResponse())
    stream._window.append(client_internals._Sent(1, 1, 8192, [], 4096, sent_bytes=1024))
    file = io.StringIO()
    bar = client_internals._ProgressBar(stream, 1024, file=file)
    bar.show()
    bar.show()  # drawn less than INTERVAL ago: not again
    assert file.getvalue().count("\r") == 1
    bar.INTERVAL = 0
    assert "[######" in file.getvalue() and " 25% of batch 1" in file.getvalue()
    assert "received" not in file.getvalue() and "summed" not in file.getvalue()
    stream.observe(pb.SubmitResponse(acknowledged_sequence=0))  # a server without the new fields
    stream.observe(_Fake(acknowledged_sequence=0, received_bytes=3_000_000, summed_sequence=1))  # one with them
    stream._window[0].sent_bytes = 4096
    bar.show()
    stream.acknowledge(1)
    bar.close()
    bar.close()
    text = file.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    lines = text[1:-1].split("\r")
    assert "100% of batch 1" in lines[1] and "received 3.0 MB" in lines[1] and "summed #1" in lines[1]
    assert "[" not in lines[-1] and "durable #1" in lines[-1] and "1 examples summed" in lines[-1]
    assert "sent 0.0 MB" in lines[-1] and "acked 0.0 MB" in lines[-1]  # 4096 bytes


def test_the_bar_moves_as_the_messages_of_one_batch_are_handed_over():
    file = io.StringIO()
    stream, requests = _stream([[np.ones((1, 1536), np.float32)]], message_bytes=2048, wire_dtype="bfloat16")
    bar = client_internals._ProgressBar(stream, 2048, file=file)
    bar.INTERVAL = 0
    stream.on_sent = bar.show
    assert len(list(requests)) == 2  # 3072 bytes in bfloat16: 2 messages
    stream.acknowledge(1)
    bar.close()
    lines = file.getvalue()[1:-1].split("\r")
    assert [line.split(" of batch")[0][-4:] for line in lines[:2]] == [" 67%", "100%"]
    assert "[" not in lines[2] and "acked 0.0 MB" in lines[2] and "durable #1" in lines[2]


def test_a_large_update_through_the_server_with_progress(client, capfd):
    """One example of 4 MiB in messages of 64 KiB, sent without a copy; the progress line ends with a newline."""
    agg = client.create_aggregation({"model": (1 << 20,)}, l2_norm_clip=float("inf"))
    update = np.random.default_rng(3).standard_normal(1 << 20, dtype=np.float32)
    report = client.submit(agg, {"model": update}, progress=True)
    assert (report.examples, report.bytes) == (1, update.nbytes)
    result = client.finalize(agg)
    np.testing.assert_array_equal(result.sums["model"], update)
    err = capfd.readouterr().err
    assert err.startswith("\r") and err.endswith("\n") and "sent 4.2 MB" in err and "acked 4.2 MB" in err
