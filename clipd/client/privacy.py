"""What a client asks of a differentially private release (the ``privacy=`` of ``create_aggregation``).

Plain data for the proto's ``PrivacyPolicy``; the server validates it, calibrates
the noise and accounts the release (with ``dp_accounting``). No dependency
beyond the generated code.

Example::

    privacy = Privacy(ledger_id="training-7", delta=1e-5, noise_multiplier=1.1,
                      sampling="poisson", sampling_rate=0.01, max_epsilon=8.0)
    agg = client.create_aggregation({"w": (10,)}, l2_norm_clip=1.0, privacy=privacy)
    ...
    result = client.finalize(agg)
    result.release.ledger_epsilon, result.release.noise_stddev
"""

from __future__ import annotations

import dataclasses

from clipd import wire
from clipd.v1 import clipd_pb2 as pb


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Adaptive clipping (Andrew et al. 2021; TF Privacy's defaults where it has them)."""

    target_unclipped_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float = 0.0  # sigma_b; TFF uses 0.05 * clients per round
    initial_bound: float = 0.1
    min_bound: float = 0.0
    max_bound: float = 0.0  # 0: none
    arithmetic_update: bool = False

    def to_proto(self) -> pb.AdaptiveClipping:
        return pb.AdaptiveClipping(**dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class Audit:
    """A canary audit of the ledger (docs/privacy.md, "Canary audits"): ``canaries`` held in and as many held
    out (the model needs twice as many parameters); the lower bound on epsilon holds with ``confidence``.
    Close it with ``Client.close_audit`` or ``clipd audit LEDGER``; ``Client.ledger(...).audit`` shows it."""

    canaries: int
    confidence: float = 0.95


@dataclasses.dataclass(frozen=True)
class Privacy:
    """A privacy policy; see ``PrivacyPolicy`` in ``proto/clipd/v1/clipd.proto``.

    Give ``noise_multiplier``, or ``target_epsilon`` with ``planned_releases``.
    ``sampling``: ``none``, ``poisson`` (with ``sampling_rate``) or ``fixed_size``
    (``sample_size`` of ``population``), drawn by the caller (``drawn_by="caller"``: its
    promise) or, for ``poisson`` under ``unit="client"`` with client ids from credentials,
    by the server (``drawn_by="server"``: its own keyed coin per client and release; a
    client it did not draw is refused, ``Client.draw_clients`` says which candidates were
    drawn; docs/privacy.md, "Sampling the server draws"). ``max_epsilon`` 0 means no budget.
    ``seed`` is for tests only: the noise is then reproducible and not private.
    ``noise="secure"`` (with ``accountant="zcdp"``): the sum on an integer grid plus a
    discrete Gaussian from a CSPRNG (OpenDP), every released value a whole number of
    ``Release.grid_step``; see docs/privacy.md, "Secure noise".
    ``mechanism="blt"`` or ``"banded"``: the ledger's releases share one correlated noise stream (DP-FTRL)
    planned for ``releases`` releases, each contributor in at most ``max_participations`` of them (0: 1), at
    least ``min_separation`` apart (enforced per client id unless ``declared_participation``); ``buffers``: a
    BLT's buffers or a banded strategy's bands (0: chosen). See docs/privacy.md, "Correlated noise".
    With independent noise, ``max_participations`` > 0 limits each client identity (``unit="client"``, ids
    from credentials) to that many releases, ``min_separation`` apart, enforced by the server, and the
    ledger's epsilon is a client's over the releases it can be in (docs/privacy.md, "Participation limits").
    """

    ledger_id: str
    delta: float
    noise_multiplier: float | None = None
    target_epsilon: float = 0.0
    planned_releases: int = 0
    neighbouring: str = "add_remove_one"
    sampling: str = "none"
    sampling_rate: float = 0.0
    population: int = 0
    sample_size: int = 0
    drawn_by: str = "caller"
    accountant: str = "rdp"
    max_epsilon: float = 0.0
    adaptive: Adaptive | None = None
    public_denominator: float = 0.0
    release_mean: bool = False
    metrics_noise_multiplier: float = 0.0
    seed: int | None = None
    debug_raw_statistics: bool = False
    noise: str = "gaussian"
    mechanism: str = "independent"
    releases: int = 0
    min_separation: int = 1
    max_participations: int = 0
    buffers: int = 0
    declared_participation: bool = False
    audit: Audit | None = None

    def to_proto(self) -> pb.PrivacyPolicy:
        """The message; ValueError naming a ``sampling``, ``neighbouring`` or ``accountant`` it has not."""
        return wire.privacy_policy(**dataclasses.asdict(self))
