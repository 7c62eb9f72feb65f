"""Golden values for adaptive clipping from the REAL TensorFlow Privacy library.

Generates ``tests/golden/tf_privacy_adaptive.json``: per-round trajectories of
``tensorflow_privacy.QuantileAdaptiveClipSumQuery`` (Andrew et al. 2021,
"Differentially Private Learning with Adaptive Clipping") with noise switched
off, plus the DpEvent the query reports for noisy configurations.

This script is NOT part of the clipd test suite and is not importable from it:
it needs TensorFlow, which clipd does not depend on. Run it once in a separate
virtual environment; the tests only read the JSON it writes (the input records
are stored in the JSON, so nothing has to be regenerated).

How to run (from the repository root), versions it was generated with::

    python3.11 -m venv /tmp/tfp-venv
    /tmp/tfp-venv/bin/pip install tensorflow-privacy==0.9.0 \\
        'tensorflow==2.15.*' 'keras==2.15.*'
    /tmp/tfp-venv/bin/python tests/golden/make_tf_privacy_adaptive.py

    # tensorflow-privacy 0.9.0, tensorflow 2.15.1, keras 2.15.0,
    # tensorflow-estimator 2.15.0, tensorflow-probability 0.22.1,
    # dp-accounting 0.4.3, numpy 1.26.4, Python 3.11.7
    # (a plain ``pip install tensorflow-privacy==0.9.0`` resolves to
    # tensorflow 2.21 / keras 3, with which ``import tensorflow_privacy`` fails
    # in tensorflow_estimator; hence the 2.15 pins.)

The query is driven only through the public DPQuery protocol
(initial_global_state, derive_sample_params, initial_sample_state,
accumulate_record, get_noised_result). The one value the library computes but
does not return -- the clamped unclipped-fraction estimate ``below_estimate``
inside ``QuantileEstimatorQuery.get_noised_result`` -- is captured by
observing the library's own ``tf.minimum(1.0, tf.maximum(0.0, ...))`` call in
that module (see ``_ClampRecorder``); it is not recomputed here. As a check,
the next clip is recomputed from it with float32 TF ops and must match the
library's next clip bit for bit.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import dp_accounting  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_privacy  # noqa: E402
from tensorflow_privacy.privacy.dp_query import (  # noqa: E402
    quantile_adaptive_clip_sum_query as qacsq,
)
from tensorflow_privacy.privacy.dp_query import (  # noqa: E402
    quantile_estimator_query as qeq,
)

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_PATH = os.path.join(HERE, "tf_privacy_adaptive.json")

# name, initial_l2_norm_clip, target_unclipped_quantile, learning_rate,
# m (records per round = expected_num_records), d, rounds, geometric_update, seed
CASES = [
    ("median_from_small", 0.1, 0.5, 0.2, 10, 3, 200, True, 20210001),
    ("median_from_large", 10.0, 0.5, 0.2, 10, 3, 200, True, 20210002),
    ("q80_lr05", 1.0, 0.8, 0.5, 20, 4, 60, True, 20210003),
    ("arithmetic_update", 1.0, 0.5, 0.2, 10, 3, 40, False, 20210004),
]

NORM_LOG_STD = 0.5


class _ClampRecorder:
    """Stands in for the ``tf`` module inside quantile_estimator_query.

    Every attribute is the real TensorFlow one, except ``minimum``, which calls
    the real ``tf.minimum`` and records its result. In that module
    ``tf.minimum`` is used exactly once, in get_noised_result:
    ``below_estimate = tf.minimum(1.0, tf.maximum(0.0, below_estimate))``.
    """

    def __init__(self, real_tf):
        self._real_tf = real_tf
        self.recorded = []

    def __getattr__(self, name):
        return getattr(self._real_tf, name)

    def minimum(self, *args, **kwargs):
        out = self._real_tf.minimum(*args, **kwargs)
        self.recorded.append(out)
        return out


def f32(x):
    """A Python float holding exactly the float32 value of x."""
    return float(np.float32(x))


def make_records(rng, m, d):
    """m records of dimension d: unit direction times exp(N(0, 0.5^2)) norm."""
    direction = rng.standard_normal((m, d))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    norm = np.exp(rng.normal(0.0, NORM_LOG_STD, size=(m, 1)))
    return (direction * norm).astype(np.float32)


def run_case(recorder, name, clip0, target, lr, m, d, rounds, geometric, seed):
    rng = np.random.default_rng(seed)
    query = qacsq.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=clip0,
        noise_multiplier=0.0,
        target_unclipped_quantile=target,
        learning_rate=lr,
        clipped_count_stddev=0.0,
        expected_num_records=m,
        geometric_update=geometric,
    )
    global_state = query.initial_global_state()
    template = tf.zeros([d], tf.float32)
    out_rounds = []
    for _ in range(rounds):
        records = make_records(rng, m, d)
        clip = global_state.sum_state.l2_norm_clip
        params = query.derive_sample_params(global_state)
        sample_state = query.initial_sample_state(template)
        for r in records:
            sample_state = query.accumulate_record(
                params, sample_state, tf.constant(r, tf.float32))
        # Library's count of records with norm <= clip, shifted by -0.5 each.
        shifted_count = float(sample_state.quantile_estimator_state.numpy())
        n_before = len(recorder.recorded)
        result, new_global_state, event = query.get_noised_result(
            sample_state, global_state)
        assert len(recorder.recorded) == n_before + 1, "clamp not observed"
        fraction = recorder.recorded[-1]
        next_clip = new_global_state.sum_state.l2_norm_clip
        assert isinstance(event, dp_accounting.ComposedDpEvent)

        # Consistency checks (float32 TF ops; must agree bit for bit).
        qe_state = new_global_state.quantile_estimator_state
        assert float(qe_state.current_estimate) == float(next_clip)
        update = tf.constant(lr, tf.float32) * (
            fraction - tf.constant(target, tf.float32))
        if geometric:
            recomputed = clip * tf.math.exp(-update)
        else:
            recomputed = clip - update
        recomputed = tf.maximum(recomputed, 0.0)
        assert float(recomputed) == float(next_clip), (
            name, float(recomputed), float(next_clip))

        unclipped_count = shifted_count + m / 2.0
        assert unclipped_count == round(unclipped_count)
        out_rounds.append({
            "records": [[float(v) for v in r] for r in records],
            "clip": float(clip.numpy()),
            "sum": [float(v) for v in result.numpy()],
            "unclipped_count": int(round(unclipped_count)),
            "unclipped_fraction": float(fraction.numpy()),
            "next_clip": float(next_clip.numpy()),
        })
        global_state = new_global_state
    return {
        "name": name,
        "initial_l2_norm_clip": clip0,
        "target_unclipped_quantile": target,
        "learning_rate": lr,
        "expected_num_records": m,
        "geometric_update": geometric,
        "dimension": d,
        "seed": seed,
        "rounds": out_rounds,
    }


def event_to_jsonable(event):
    """DpEvent -> nested dicts with Python floats (tensors converted)."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return {"type": "GaussianDpEvent",
                "noise_multiplier": float(np.asarray(event.noise_multiplier))}
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return {"type": "ComposedDpEvent",
                "events": [event_to_jsonable(e) for e in event.events]}
    raise TypeError(f"unexpected event {event!r}")


def event_with_floats(event):
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return dp_accounting.GaussianDpEvent(
            float(np.asarray(event.noise_multiplier)))
    return dp_accounting.ComposedDpEvent(
        [event_with_floats(e) for e in event.events])


def noisy_event(noise_multiplier, clipped_count_stddev, expected_num_records,
                clip=1.0, d=3):
    """One noisy round; returns the reported event and the library's noise."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    tf.random.set_seed(0)
    query = qacsq.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=clip,
        noise_multiplier=noise_multiplier,
        target_unclipped_quantile=0.5,
        learning_rate=0.2,
        clipped_count_stddev=clipped_count_stddev,
        expected_num_records=expected_num_records,
        geometric_update=True,
    )
    global_state = query.initial_global_state()
    params = query.derive_sample_params(global_state)
    sample_state = query.initial_sample_state(tf.zeros([d], tf.float32))
    rng = np.random.default_rng(7)
    for r in make_records(rng, expected_num_records, d):
        sample_state = query.accumulate_record(
            params, sample_state, tf.constant(r, tf.float32))
    _, _, event = query.get_noised_result(sample_state, global_state)
    sum_state = global_state.sum_state
    below_state = global_state.quantile_estimator_state.below_estimate_state
    count_gs = below_state.numerator_state
    value_z = float(sum_state.stddev) / float(sum_state.l2_norm_clip)
    effective = rdp._effective_gaussian_noise_multiplier(  # pylint: disable=protected-access
        event_with_floats(event))
    return {
        "inputs": {
            "initial_l2_norm_clip": clip,
            "noise_multiplier": noise_multiplier,
            "clipped_count_stddev": clipped_count_stddev,
            "expected_num_records": expected_num_records,
        },
        "event": event_to_jsonable(event),
        "event_repr": repr(event_with_floats(event)),
        "event_named_tuple_repr": repr(event_with_floats(event).to_named_tuple()),
        "value_sum_stddev": float(sum_state.stddev),
        "value_sum_l2_norm_clip": float(sum_state.l2_norm_clip),
        "z_v": value_z,
        "count_sum_stddev": float(count_gs.stddev),
        "count_sum_l2_norm_clip": float(count_gs.l2_norm_clip),
        "count_denominator": float(below_state.denominator),
        "count_noise_multiplier": float(count_gs.stddev) / float(
            count_gs.l2_norm_clip),
        "rdp_effective_noise_multiplier_of_event": float(effective),
    }


def main():
    recorder = _ClampRecorder(tf)
    qeq.tf = recorder  # observe the library's clamp; see _ClampRecorder
    try:
        cases = [run_case(recorder, *c) for c in CASES]
    finally:
        qeq.tf = tf

    noisy = noisy_event(1.0, 0.5, 10)
    noisy_extra = [noisy_event(1.0, 2.5, 10), noisy_event(2.0, 0.5, 100)]

    doc = {
        "generator": "tests/golden/make_tf_privacy_adaptive.py",
        "versions": {
            "tensorflow_privacy": tensorflow_privacy.__version__,
            "tensorflow": tf.__version__,
            "dp_accounting": _dist_version("dp-accounting"),
            "numpy": np.__version__,
            "python": ".".join(map(str, sys.version_info[:3])),
        },
        "notes": NOTES,
        "cases": cases,
        "noisy_event": noisy,
        "noisy_events_extra": noisy_extra,
    }
    with open(OUT_PATH, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=None, separators=(",", ":"))
        f.write("\n")
    for c in cases:
        last = c["rounds"][-1]
        print(f'{c["name"]}: final next_clip={last["next_clip"]!r}')
    print("noisy_event z_v:", noisy["z_v"], "event:", noisy["event_repr"])
    print("wrote", OUT_PATH, os.path.getsize(OUT_PATH), "bytes")


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


NOTES = (
    "Generated with tensorflow_privacy.QuantileAdaptiveClipSumQuery driven through "
    "the DPQuery protocol, noise_multiplier=0, clipped_count_stddev=0, "
    "expected_num_records=m. All arithmetic is float32 in TF; records are float32 "
    "values stored as Python floats. "
    "clip: global_state.sum_state.l2_norm_clip used for this round (C_t). "
    "sum: the query's get_noised_result value, i.e. the float32 sum, accumulated "
    "in record order, of every record clipped by tf.clip_by_global_norm(record, C_t) "
    "(scale = C_t * min(1/norm, 1/C_t), norm = sqrt(2*l2_loss(record)); so an "
    "unclipped record is multiplied by C_t*(1/C_t), which is 1 up to float32 "
    "rounding). NOT normalized (no division by m); the added Gaussian noise has "
    "stddev 0. "
    "unclipped_count: number of records with norm <= C_t (inclusive comparison "
    "'record <= params.current_estimate' in QuantileEstimatorQuery.preprocess_record), "
    "read from the library's sample state (sum of indicator-0.5, plus m/2). "
    "unclipped_fraction: the library's below_estimate = "
    "min(1, max(0, sum(indicator-0.5)/expected_num_records + 0.5)) in float32, "
    "captured from the library's own clamp call. "
    "next_clip: C_{t+1} = max(0, C_t*exp(-lr*(unclipped_fraction - target))) "
    "(geometric) or max(0, C_t - lr*(unclipped_fraction - target)) (arithmetic), "
    "as computed by the library in float32. "
    "noisy_event: event returned by get_noised_result for a noisy configuration. "
    "TF Privacy 0.9.0 does NOT split the noise between value and count: the sum "
    "query's stddev is noise_multiplier * clip (z_v == noise_multiplier), the event "
    "is ComposedDpEvent([GaussianDpEvent(z_v), GaussianDpEvent(clipped_count_stddev/0.5)]) "
    "and rdp_effective_noise_multiplier_of_event is dp_accounting's composition "
    "(z_v^-2 + (2*sigma_b)^-2)^(-1/2)."
)


if __name__ == "__main__":
    main()
