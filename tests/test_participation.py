"""Participation limits with independent noise (docs/privacy.md, "Participation limits"), through a real server with
auth on: each client identity in at most k releases, b apart, enforced on credentials; the ledger's epsilon is
a client's over the releases it can be in, as dp_accounting composes them."""

from __future__ import annotations

import uuid

import grpc
import numpy as np
import pytest
from conftest import ADMIN_TOKEN
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant

from clipd.client import Client, ClipdError, FailedPreconditionError, PermissionDeniedError, Privacy

LAYERS = {"w": (6,)}
UPDATE = {"w": np.full(6, 0.1, np.float32)}


def limited(b: int = 3, k: int = 2, **more) -> Privacy:
    return Privacy(f"limited-{uuid.uuid4().hex[:10]}", 1e-5, noise_multiplier=more.pop("z", 2.0), min_separation=b,
                   max_participations=k, **more)


@pytest.fixture()
def admin(auth_server):
    with Client(f"127.0.0.1:{auth_server.port}", token=ADMIN_TOKEN) as client:
        yield client


def test_a_client_takes_part_at_most_k_times_b_apart_whatever_its_credentials_name(auth_server, admin):
    """b = 3, k = 2 over 7 releases: alice (a client token for the ledger) is in release 0, refused in 1 and 2
    (through her token, unnamed or naming herself, and through the admin naming her), in again at 3, refused
    from then on (k reached); her token can't name anyone else. The ledger's epsilon after each release is
    RdpAccountant's for min(k, ceil(n / b)) Gaussian releases of z (counted here by walking them)."""
    privacy = limited()
    target = f"127.0.0.1:{auth_server.port}"
    alice = admin.client_token("alice", ledger=privacy.ledger_id)
    taken = []
    for release in range(7):
        aggregation = admin.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=privacy, unit="client")
        with Client(target, token=alice) as her:
            if release in (0, 3):
                her.submit(aggregation, UPDATE)
                taken.append(release)
            else:
                for name in (None, "alice"):
                    with pytest.raises(FailedPreconditionError, match="client 'alice' took part in"):
                        her.submit(aggregation, UPDATE, client_id=name)
                with pytest.raises(FailedPreconditionError, match="client 'alice' took part in"):
                    admin.submit(aggregation, UPDATE, client_id="alice")
                with pytest.raises(PermissionDeniedError, match="may not submit as 'alice-2'"):
                    her.submit(aggregation, UPDATE, client_id="alice-2")
        admin.submit(aggregation, UPDATE, client_id=f"other-{release}")
        release_fields = admin.finalize(aggregation).release
        most = len([t for t in range(0, release + 1, 3)][:2])
        accountant = rdp_privacy_accountant.RdpAccountant()
        accountant.compose(dpe.GaussianDpEvent(2.0), most)
        assert release_fields.ledger_epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    ledger = admin.ledger(privacy.ledger_id)
    assert taken == [0, 3] and ledger.epsilon == pytest.approx(release_fields.ledger_epsilon)


def test_what_participation_limits_need_is_refused_plainly(auth_server, server, admin):
    """One aggregation at a time (a client's next release must be known); unit client and credential ids; no
    sampling or correlated noise beside it (INVALID_ARGUMENT)."""
    privacy = limited()
    first = admin.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=privacy, unit="client")
    with pytest.raises(FailedPreconditionError, match="limits each client's participation, release by release"):
        admin.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=privacy, unit="client")
    admin.cancel(first)
    for words, make in [
        ("needs unit client", lambda: admin.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=limited())),
        ("must come from credentials", lambda: admin.create_aggregation(
            LAYERS, l2_norm_clip=1.0, privacy=limited(), unit="client", self_asserted_client_ids=True)),
        ("do not take sampling", lambda: admin.create_aggregation(
            LAYERS, l2_norm_clip=1.0, privacy=limited(sampling="poisson", sampling_rate=0.5), unit="client")),
    ]:
        with pytest.raises(ClipdError, match=words) as e:
            make()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with Client(f"127.0.0.1:{server.port}") as anyone, pytest.raises(ClipdError, match="no admin token"):
        anyone.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=limited(), unit="client")
