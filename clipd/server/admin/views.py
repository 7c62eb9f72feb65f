"""The admin API's JSON views of an aggregation and a ledger (host-side snapshots; never the device)."""

from __future__ import annotations

import math
from typing import Any

from clipd.server.admin.facade import Aggregation, Stats


def quantile_from_histogram(counts, upper_bounds, q: float) -> float | None:
    """The ``q`` quantile of norm/bound ratios from bucket counts, interpolated within a bucket.

    >>> quantile_from_histogram([0, 2, 2], [1.0, 2.0], 0.5)
    2.0
    """
    total = sum(counts)
    if total == 0:
        return None
    target, seen = q * total, 0
    for i, c in enumerate(counts):
        if c and seen + c >= target:
            lower = upper_bounds[i - 1] if i > 0 else 0.0
            upper = upper_bounds[i] if i < len(upper_bounds) else upper_bounds[-1] * 2
            return lower + (upper - lower) * (target - seen) / c
        seen += c
    return upper_bounds[-1]


def aggregation_view(aggregation: Aggregation, stats: Stats) -> dict[str, Any]:
    """The JSON view of one aggregation: spec, policy, counters, per-layer statistics.

    Under a privacy policy (not in debug mode) the raw counters and statistics
    are absent (null): only the release's noised ones, under "privacy".
    """
    view = _full_view(aggregation, stats)
    if aggregation.privacy is None:
        return view
    view["privacy"] = {
        "ledger_id": aggregation.privacy.ledger_id,
        "debug_raw_statistics": aggregation.privacy.debug_raw_statistics,
        "notice": stats.privacy_notice,
        "planned_ledger_epsilon": json_float(aggregation.planned_epsilon),
        "mechanism": (aggregation.privacy.correlated.mechanism.value if aggregation.privacy.correlated is not None
                      else "independent"),
        "release": {k: json_float(v) if isinstance(v, float) else v for k, v in stats.release.items()}
        if stats.release else None,
    }
    if aggregation.withheld:
        for key in RAW_FIELDS:
            view[key] = None
        view["layers"] = [{k: layer[k] for k in ("name", "shape", "dtype", "bound")} for layer in view["layers"]]
    return view


RAW_FIELDS = ("updated_unix_seconds", "examples", "batches", "bytes", "non_finite", "clipped", "examples_per_second",
              "example_norm_histogram", "clients")


def _full_view(aggregation: Aggregation, stats: Stats) -> dict[str, Any]:
    policy = aggregation.policy
    return {
        "aggregation_id": aggregation.id,
        "state": stats.state.value,
        "policy": {
            "kind": policy.kind.value,
            "l2_norm_clip": json_float(policy.l2_norm_clip),
            "layer_clips": [json_float(c) for c in policy.layer_clips],
            "rescale_to_unit_norm": policy.rescale_to_unit_norm,
            "non_finite": "reject" if aggregation.reject_non_finite else policy.non_finite.value,
        },
        "unit": aggregation.unit.value,
        "client_ids": aggregation.client_ids,
        "created_unix_seconds": aggregation.created,
        "finished_unix_seconds": aggregation.finished,
        "failure_reason": stats.failure_reason,
        "updated_unix_seconds": stats.updated_unix_seconds,
        "clients": stats.clients,
        "examples": stats.examples,
        "batches": stats.batches,
        "bytes": stats.bytes,
        "non_finite": stats.non_finite,
        "clipped": stats.clipped,
        "examples_per_second": stats.examples_per_second,
        "bucket_upper_bounds": list(stats.bucket_upper_bounds),
        "example_bound": json_float(stats.example_bound),
        "example_norm_histogram": list(stats.example_norm_histogram),
        "layers": [
            {
                "name": layer.name,
                "shape": list(spec.shape),
                "dtype": spec.dtype,
                "bound": json_float(layer.bound),
                "clipped": layer.clipped,
                "clip_fraction": layer.clipped / stats.examples if stats.examples else 0.0,
                "norm_mean": layer.norm_mean,
                "norm_max": layer.norm_max,
                "norm_histogram": list(layer.norm_histogram),
                "norm_ratio_quantiles": {
                    str(q): quantile_from_histogram(layer.norm_histogram, stats.bucket_upper_bounds, q)
                    for q in (0.5, 0.9, 0.99)
                },
            }
            for layer, spec in zip(stats.layers, aggregation.layers)
        ],
    }


def ledger_view(ledger: dict, participation_refusals: dict[str, int]) -> dict[str, Any]:
    """A ledger's JSON view; ``participation_refusals``: every process's, by ledger (the server snapshot's)."""
    entries = [{**e, "epsilon_after": json_float(e["epsilon_after"])} for e in ledger["entries"]]
    audit = ledger.get("audit")
    if audit is not None:  # open: its size and progress; closed: its bound beside the claim, and its scores
        audit = {k: json_float(v) if isinstance(v, float) else v for k, v in audit.items()}
    return {**{k: json_float(v) if isinstance(v, float) else v for k, v in ledger.items()}, "entries": entries,
            "audit": audit, "participation_refusals": participation_refusals.get(ledger["ledger_id"], 0)}


def stream_view(stream: dict) -> dict[str, Any]:
    """A buffered stream's JSON view (``BufferedStream.describe`` with its ledger's epsilon), floats JSON can
    carry at every depth (an unbounded ``max_wait_seconds``, a budget of inf).

    >>> stream_view({"max_epsilon": float("inf"), "buffer": {"max_wait_seconds": float("inf"), "size": 2}})
    {'max_epsilon': 'inf', 'buffer': {'max_wait_seconds': 'inf', 'size': 2}}
    """
    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return json_float(v) if isinstance(v, float) else v

    return plain(stream)


def json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # JSON has no inf or NaN
