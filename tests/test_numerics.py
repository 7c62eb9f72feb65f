"""Numerics of long streams: float32 device deltas flushed into float64 host totals.

The server runs one-row steps when examples trickle in one at a time. A single
float32 sum then drifts with the step count (and a norm sum stops moving at
about 2**24 examples); clipd adds the device delta into float64 totals every
``FLUSH_STEPS`` steps (``PartialState.absorb``), which bounds the error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from clipd.engine import ClipAccumulator, ClipPolicy, LayerSpec, PartialState
from clipd.engine._accumulator import _accumulate
from clipd.server.summing.slots import FLUSH_STEPS

N_EXAMPLES = 4_000_000  # a single float32 state drifts past 1e-4 by here (2.4e-4 on its norm sum)
WIDTH = 8
CLIP = 2.0


def test_four_million_one_row_steps_stay_within_1e5_of_float64():
    layers = (LayerSpec("w", (WIDTH,)),)
    acc = ClipAccumulator(layers, ClipPolicy(l2_norm_clip=CLIP))

    # FLUSH_STEPS one-row steps of the real step function, one after the other, on two states:
    # `fresh` starts from zero each call (clipd: flushed into float64 after it), `carried` never
    # restarts (a single float32 state, as before the flushes).
    @jax.jit
    def run(carried, rows):
        def step(states, row):
            fresh, carried = states
            one = (row[None],), jnp.ones((1,), bool), acc._limits, acc._config
            return (_accumulate(fresh, *one), _accumulate(carried, *one)), None

        (fresh, carried), _ = jax.lax.scan(step, (acc.init(), carried), rows)
        return fresh, carried

    rng = np.random.default_rng(0)
    totals = PartialState.empty(layers)
    carried = acc.init()
    ref_sum = np.zeros(WIDTH)
    ref_norm_sum = 0.0
    ref_clipped = 0
    for _ in range(N_EXAMPLES // FLUSH_STEPS + 1):
        n = min(FLUSH_STEPS, N_EXAMPLES - totals.examples)
        if n == 0:
            break
        rows = (1.0 + 0.5 * rng.standard_normal((n, WIDTH))).astype(np.float32)
        fresh, carried = run(carried, rows)
        totals = totals.absorb(jax.device_get(fresh))
        x = rows.astype(np.float64)  # the float64 reference, computed with numpy
        norms = np.sqrt((x**2).sum(axis=1))
        ref_sum += np.minimum(1.0, CLIP / norms) @ x
        ref_norm_sum += norms.sum()
        ref_clipped += int((norms > CLIP).sum())

    assert totals.examples == N_EXAMPLES
    assert totals.clip_counts[0] == ref_clipped
    assert np.max(np.abs(totals.sums[0] - ref_sum) / np.abs(ref_sum)) < 1e-5
    assert abs(totals.norm_sum[0] - ref_norm_sum) / ref_norm_sum < 1e-5
    # The control: one float32 state for the whole stream misses the bar (so this test can fail).
    carried = jax.device_get(carried)
    drift = np.max(np.abs(np.asarray(carried.sums[0], np.float64) - ref_sum) / np.abs(ref_sum))
    norm_drift = abs(float(carried.norm_sum[0]) - ref_norm_sum) / ref_norm_sum
    assert max(drift, norm_drift) > 1e-4


def test_counts_past_int32_and_float64_totals_survive_serialization():
    layers = (LayerSpec("w", (2,)),)
    big = PartialState.empty(layers).absorb_totals(examples=2**31 - 1, clip_counts=np.array([2**31 - 5]))
    more = big.absorb_totals(examples=10, clip_counts=np.array([10]), sums=[np.array([1e300, 1.0])])
    again = PartialState.from_bytes(more.to_bytes())
    assert again.examples == 2**31 + 9
    assert int(again.clip_counts[0]) == 2**31 + 5
    assert again.sums[0].dtype == np.float64 and again.sums[0][0] == 1e300


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in a jaxpr, sub-jaxprs (cond branches) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(sub, "jaxpr"):
                    found += _dot_precisions(sub.jaxpr)
    return found


def test_the_step_pins_dots_to_full_precision():
    acc = ClipAccumulator([LayerSpec("w", (4,)), LayerSpec("b", (2,))], ClipPolicy(l2_norm_clip=1.0))
    closed = jax.make_jaxpr(lambda s, x, y, v: _accumulate(s, (x, y), v, acc._limits, acc._config))(
        acc.init(), jnp.ones((3, 4)), jnp.ones((3, 2)), jnp.ones(3, bool))
    precisions = _dot_precisions(closed.jaxpr)
    assert len(precisions) >= 2
    assert all(p == (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST) for p in precisions), precisions
