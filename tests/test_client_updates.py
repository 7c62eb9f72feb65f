"""The client's checks of user updates against an aggregation's layers (pure unit tests, no server).

Before these checks a misspelled key was matched by position, and a bad update
in a stream raised a plain ValueError, or was swallowed by the "maybe it is an
iterable of updates" fallback.
"""

from __future__ import annotations

import doctest
import itertools

import ml_dtypes
import numpy as np
import pytest

from clipd.client import InvalidArgumentError, InvalidUpdateError, updates
from clipd.client.updates import Layer, as_batch, example_nbytes, iter_updates, rebatch

# The aggregation's order (not sorted), as in the service tests.
LAYERS = [Layer("w", (6, 4), "float32"), Layer("b", (4,), "float32"),
          Layer("v", (3, 2, 2), "float32")]


def _update(rows=None, dtype=np.float32, seed=0):
    """One example ({name: shape}) or, with ``rows``, a batch of them, random values."""
    rng = np.random.default_rng(seed)
    lead = () if rows is None else (rows,)
    return {layer.name: rng.standard_normal(lead + layer.shape).astype(dtype) for layer in LAYERS}


def _error(update, layers=LAYERS) -> InvalidUpdateError:
    with pytest.raises(InvalidUpdateError) as info:
        as_batch(update, layers)
    return info.value


# Good paths --------------------------------------------------------------------------------------


def test_a_single_example_gets_a_batch_axis_of_one_in_layer_order():
    update = _update()
    batch = as_batch(update, LAYERS)
    assert [a.shape for a in batch] == [(1, 6, 4), (1, 4), (1, 3, 2, 2)]
    for array, layer in zip(batch, LAYERS):
        np.testing.assert_array_equal(array[0], update[layer.name])


def test_a_batch_keeps_its_rows():
    update = _update(rows=5)
    batch = as_batch(update, LAYERS)
    assert [a.shape for a in batch] == [(5, 6, 4), (5, 4), (5, 3, 2, 2)]
    for array, layer in zip(batch, LAYERS):
        np.testing.assert_array_equal(array, update[layer.name])
        assert array.flags.c_contiguous


def test_a_list_is_matched_by_position():
    update = _update(rows=2)
    batch = as_batch([update["w"], update["b"], update["v"]], LAYERS)
    for array, layer in zip(batch, LAYERS):
        np.testing.assert_array_equal(array, update[layer.name])


def test_an_iterator_mixing_single_examples_and_batches():
    singles = [_update(seed=1), _update(seed=2)]
    batch = _update(rows=3, seed=3)
    batches = list(iter_updates(iter([singles[0], batch, singles[1]]), LAYERS))
    assert [b[0].shape[0] for b in batches] == [1, 3, 1]
    np.testing.assert_array_equal(batches[0][1][0], singles[0]["b"])
    np.testing.assert_array_equal(batches[1][2], batch["v"])
    np.testing.assert_array_equal(batches[2][0][0], singles[1]["w"])


def test_a_list_of_updates_is_an_iterable_and_a_list_of_arrays_is_one_update():
    a, b = _update(rows=2, seed=1), _update(rows=3, seed=2)
    assert [x[0].shape[0] for x in iter_updates([a, b], LAYERS)] == [2, 3]
    as_lists = [[u["w"], u["b"], u["v"]] for u in (a, b)]
    assert [x[0].shape[0] for x in iter_updates(as_lists, LAYERS)] == [2, 3]
    assert [x[0].shape[0] for x in iter_updates(as_lists[1], LAYERS)] == [3]
    assert list(iter_updates([], LAYERS)) == []


def test_nested_dicts_match_the_flattened_names():
    layers = [Layer("dense/kernel", (3, 2), "float32"), Layer("dense/bias", (2,), "float32"),
              Layer("scale", (1,), "float32")]
    kernel, bias, scale = np.ones((3, 2)), np.full(2, 2.0), np.full(1, 3.0)
    for update in ({"scale": scale, "dense": {"bias": bias, "kernel": kernel}},
                   {"dense/kernel": kernel, "dense/bias": bias, "scale": scale}):
        batch = as_batch(update, layers)
        assert [a.shape for a in batch] == [(1, 3, 2), (1, 2), (1, 1)]
        np.testing.assert_array_equal(batch[1][0], bias)
    error = _error({"dense": {"kernal": kernel, "bias": bias}, "scale": scale}, layers)
    assert "'dense/kernal'" in str(error) and "did you mean 'dense/kernel'" in str(error)
    assert error.layer == "dense/kernel"


def test_jax_arrays():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(4)
    examples = [{"w": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32),
                 "b": jnp.asarray(rng.standard_normal(4), jnp.bfloat16),
                 "v": jnp.asarray(rng.standard_normal((2, 3, 2, 2)), jnp.float32)[0]}  # a view
                for _ in range(3)]
    batches = list(iter_updates(iter(examples), LAYERS))
    assert len(batches) == 3
    for batch, example in zip(batches, examples):
        assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in batch)
        np.testing.assert_array_equal(batch[0][0], np.asarray(example["w"]))
        np.testing.assert_array_equal(batch[1][0], np.asarray(example["b"]).astype(np.float32))
    one_layer = [Layer("x", (4,), "float32")]
    assert as_batch(jnp.ones((7, 4)), one_layer)[0].shape == (7, 4)
    with pytest.raises(InvalidUpdateError, match=r"layer 'x': shape \(4, 7\)"):
        as_batch(jnp.ones((4, 7)), one_layer)


def test_float64_is_cast_to_the_layer_dtype():
    update = _update(rows=2, dtype=np.float64)
    batch = as_batch(update, LAYERS)
    assert [a.dtype for a in batch] == [np.float32] * 3
    np.testing.assert_array_equal(batch[0], update["w"].astype(np.float32))


def test_big_endian_input_is_sent_in_native_byte_order():
    update = {k: v.astype(">f4") for k, v in _update(rows=2).items()}
    batch = as_batch(update, LAYERS)
    assert all(a.dtype == np.dtype("float32") and a.dtype.isnative for a in batch)
    np.testing.assert_array_equal(batch[0], update["w"])


def test_a_bfloat16_layer():
    layers = [Layer("w", (2, 3), "bfloat16")]
    values = np.arange(12, dtype=np.float32).reshape(2, 2, 3) / 3
    (batch,) = as_batch({"w": values}, layers)
    assert batch.dtype == np.dtype(ml_dtypes.bfloat16) and batch.shape == (2, 2, 3)
    np.testing.assert_array_equal(batch, values.astype(ml_dtypes.bfloat16))
    assert as_batch({"w": values[0].astype(ml_dtypes.bfloat16)}, layers)[0].shape == (1, 2, 3)
    assert example_nbytes(layers) == 12


def test_bfloat16_input_is_floating():
    (batch,) = as_batch({"w": np.ones((2, 3), ml_dtypes.bfloat16)}, [Layer("w", (2, 3), "float32")])
    assert batch.dtype == np.float32 and batch.sum() == 6


def test_non_finite_values_are_left_to_the_server():
    update = _update(rows=3)
    update["w"][1, 0, 0], update["b"][2, 1] = np.nan, np.inf
    batch = as_batch(update, LAYERS)
    assert np.isnan(batch[0][1, 0, 0]) and np.isinf(batch[1][2, 1])


def test_checked_batches_rebatch():
    batches = rebatch(iter_updates(iter([_update(rows=5), _update(), _update(rows=4)]), LAYERS),
                      example_nbytes(LAYERS), 4 * example_nbytes(LAYERS))
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]


def test_rebatch_sends_the_rows_before_a_bad_update_then_raises():
    good = [_update(seed=i) for i in range(3)]
    bad = dict(good[0], w=good[0]["w"].T)
    packed = rebatch(iter_updates(iter(good + [bad, good[0]]), LAYERS),
                     example_nbytes(LAYERS), 100 * example_nbytes(LAYERS))
    first = next(packed)  # the three good examples, though the message is not full
    assert first[0].shape == (3, 6, 4)
    np.testing.assert_array_equal(first[1][2], good[2]["b"])
    with pytest.raises(InvalidUpdateError, match=r"^update #3: layer 'w'"):
        next(packed)


# Failure modes ---------------------------------------------------------------------------------


def test_a_transposed_layer():
    update = _update()
    update["w"] = update["w"].T
    error = _error(update)
    assert str(error).startswith(
        "layer 'w': shape (4, 6) is neither one example (6, 4) nor a batch (B, 6, 4)")
    assert "transposed" in str(error)
    assert (error.layer, error.expected, error.got) == ("w", (6, 4), (4, 6))
    assert isinstance(error, InvalidArgumentError) and isinstance(error, ValueError)


def test_a_batch_of_transposed_examples():
    update = _update(rows=5)
    update["w"] = update["w"].transpose(0, 2, 1)
    error = _error(update)
    message = str(error)
    assert all(part in message for part in ("'w'", "(5, 4, 6)", "(6, 4)", "(4, 6)"))
    assert error.layer == "w"


def test_a_missing_layer():
    update = _update()
    del update["b"]
    error = _error(update)
    assert "missing layer 'b'" in str(error)
    assert error.layer == "b"


def test_a_misspelled_key_is_not_matched_by_position():
    update = _update()
    update["W"] = update.pop("w")
    error = _error(update)
    assert "unknown key 'W'" in str(error) and "did you mean 'w'?" in str(error)
    assert "missing layer 'w'" in str(error)


def test_keys_that_match_no_layer_are_never_matched_by_position():
    # Three arrays of the right shapes in the layers' order, under the wrong names.
    update = dict(zip(["x", "y", "z"], _update().values()))
    error = _error(update)
    assert "missing layers 'w', 'b', 'v'" in str(error)
    assert all(f"unknown key {k!r}" in str(error) for k in "xyz")


def test_an_extra_key():
    update = _update()
    update["extra"] = np.zeros(3, np.float32)
    error = _error(update)
    assert "unknown key 'extra'" in str(error) and "did you mean" not in str(error)
    assert "missing" not in str(error)


def test_a_list_with_the_wrong_number_of_arrays():
    update = _update()
    message = "has 2 arrays, matched by position to 3 layers 'w', 'b', 'v'"
    with pytest.raises(InvalidUpdateError, match=message):
        list(iter_updates([update["w"], update["b"]], LAYERS))


def test_one_array_for_several_layers():
    with pytest.raises(InvalidUpdateError, match=r"one array of shape \(6, 4\).*3 layers"):
        list(iter_updates(np.zeros((6, 4), np.float32), LAYERS))


def test_mismatched_batch_sizes_across_layers():
    update = _update(rows=5)
    update["b"] = update["b"][:4]
    error = _error(update)
    assert "different batch sizes" in str(error)
    assert "'w' 5" in str(error) and "'b' 4" in str(error) and "'v' 5" in str(error)
    assert error.got == {"w": 5, "b": 4, "v": 5}


def test_a_batch_of_zero_rows():
    error = _error(_update(rows=0))
    assert "0 examples" in str(error) and "'w' (0, 6, 4)" in str(error)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_])
def test_an_integer_or_bool_array_is_refused(dtype):
    update = _update()
    update["b"] = np.ones(4, dtype)
    error = _error(update)
    assert f"layer 'b': dtype {np.dtype(dtype)} is not a floating type" in str(error)
    assert (error.layer, error.expected, error.got) == ("b", "float32", str(np.dtype(dtype)))


def test_a_complex_array_is_refused():
    update = _update()
    update["v"] = update["v"].astype(np.complex128)
    error = _error(update)
    assert "layer 'v': dtype complex128 is not a floating type" in str(error)
    assert error.layer == "v"


@pytest.mark.parametrize("leaf", [None, "abc", np.array(["a", "b", "c", "d"])],
                         ids=["None", "str", "str-array"])
def test_objects_and_strings_are_refused(leaf):
    update = _update()
    update["b"] = leaf
    error = _error(update)
    assert "layer 'b': dtype" in str(error) and "not a floating type" in str(error)


def test_an_update_mixing_single_examples_and_batches():
    update = _update()
    update["b"] = np.zeros((1, 4), np.float32)
    error = _error(update)
    assert "mixes single examples and batches" in str(error)
    assert "'w' one example (6, 4)" in str(error) and "'b' a batch (1, 4)" in str(error)


def test_a_bad_update_in_an_iterator_raises_when_reached_with_its_index():
    pulled = []

    def source():
        for i in range(6):
            pulled.append(i)
            update = _update(seed=i)
            if i == 3:
                update["w"] = update["w"].T
            yield update

    stream = iter_updates(source(), LAYERS)
    got = [next(stream) for _ in range(3)]  # the first three come out before anything is wrong
    assert len(got) == 3 and pulled == [0, 1, 2]
    with pytest.raises(InvalidUpdateError) as info:
        next(stream)
    message = str(info.value)
    assert message.startswith("update #3: layer 'w':")
    assert "(4, 6)" in message and "(6, 4)" in message
    assert info.value.layer == "w" and pulled == [0, 1, 2, 3]


def test_a_bad_item_in_a_list_of_updates_is_not_swallowed():
    good = _update(rows=2)
    bad = dict(good, b=good["b"][:1])
    stream = iter_updates([good, good, bad, good], LAYERS)
    assert [b[0].shape[0] for b in itertools.islice(stream, 2)] == [2, 2]
    with pytest.raises(InvalidUpdateError, match=r"^update #2: the layers of a batch have diff"):
        next(stream)


def test_a_bad_single_update_is_not_retried_as_an_iterable():
    update = _update()
    update["w"] = update["w"].T
    with pytest.raises(InvalidUpdateError, match=r"^layer 'w': shape \(4, 6\)"):  # no "update #"
        list(iter_updates(update, LAYERS))
    as_list = [update["w"], update["b"], update["v"]]
    with pytest.raises(InvalidUpdateError, match=r"^layer 'w': shape \(4, 6\)"):
        list(iter_updates(as_list, LAYERS))


def test_iter_updates_is_lazy():
    pulled = []

    def source():
        for i in range(1000):
            pulled.append(i)
            yield _update()

    assert len(list(itertools.islice(iter_updates(source(), LAYERS), 3))) == 3
    assert pulled == [0, 1, 2]


def test_the_module_doctests():
    assert doctest.testmod(updates).failed == 0


def test_a_result_s_chunks_are_placed_at_their_offsets_and_one_past_its_tensor_is_refused():
    """A Finalize answer's sums as they stream in (the server's chunks of each tensor, in any order; a bfloat16 layer
    beside a float32 one): each tensor equal to what was cut, writable; a chunk reaching past its tensor's size is an
    INTERNAL error, not a silently longer array."""
    import grpc

    from clipd import wire
    from clipd.client import ClipdError
    from clipd.client._client import _result_from
    from clipd.v1 import clipd_pb2 as pb

    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([1.5, -2.0, 3.0], ml_dtypes.bfloat16)
    stats = pb.AggregationStats(layers=[pb.LayerStats(name="w"), pb.LayerStats(name="b")])

    def chunks(layer: int, array: np.ndarray, step: int) -> list[pb.TensorChunk]:
        data = wire.tensor_bytes(array)
        return [pb.TensorChunk(layer=layer, dtype=wire.dtype_code(array.dtype), shape=array.shape, offset=offset,
                               data=bytes(data[offset:offset + step])) for offset in range(0, len(data), step)]

    cut = chunks(0, w, 10) + chunks(1, b, 4)
    result = _result_from(stats, cut[::-1])
    assert result.sums["w"].dtype == np.float32 and np.array_equal(result.sums["w"], w)
    assert result.sums["b"].dtype == b.dtype and np.array_equal(result.sums["b"], b)
    result.sums["w"][0, 0] = 7.0  # (a trainer updates them in place)
    past = pb.TensorChunk(layer=0, dtype=wire.dtype_code(w.dtype), shape=w.shape, offset=44, data=bytes(8))
    with pytest.raises(ClipdError) as refused:
        _result_from(stats, [past])
    assert refused.value.code == grpc.StatusCode.INTERNAL and "past its size 48" in str(refused.value)
