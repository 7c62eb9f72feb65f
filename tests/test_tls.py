"""TLS and mutual TLS on gRPC, HTTPS on the admin API, with certificates made here (``cryptography``)."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib
import ssl

import grpc
import httpx
import numpy as np
import pytest
from conftest import TEST_SETTINGS
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clipd import wire
from clipd.client import Client
from clipd.client.errors import FailedPreconditionError, PermissionDeniedError, UnavailableError
from clipd.server.app import create_server
from clipd.server.settings import Settings

TIMEOUT = 5.0


@dataclasses.dataclass(frozen=True)
class Pem:
    cert: pathlib.Path
    key: pathlib.Path

    @property
    def cert_bytes(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_bytes(self) -> bytes:
        return self.key.read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(directory: pathlib.Path, stem: str, subject: str, issuer: tuple | None = None, *,
           ca: bool = False, server: bool = False, client_too: bool = False) -> tuple[Pem, tuple]:
    """A P-256 key and a certificate for ``subject``, signed by ``issuer`` (cert, key), or self-signed.

    ``client_too``: a server certificate that may also authenticate as a client (clipd's hosts present it).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    issuer_cert, issuer_key = issuer if issuer else (None, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_cert.subject if issuer_cert else _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH] * server
                                  + [ExtendedKeyUsageOID.CLIENT_AUTH] * (client_too or not server)),
            critical=False)
    if issuer_cert is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    pem = Pem(directory / f"{stem}.crt", directory / f"{stem}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return pem, (cert, key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate (localhost, 127.0.0.1) and a client one it signed; a rogue CA and its client."""
    d = tmp_path_factory.mktemp("pki")
    ca, ca_pair = _issue(d, "ca", "clipd test CA", ca=True)
    server, _ = _issue(d, "server", "localhost", ca_pair, server=True)
    client, _ = _issue(d, "client", "clipd client", ca_pair)
    rogue_ca, rogue_pair = _issue(d, "rogue-ca", "rogue CA", ca=True)
    rogue_client, _ = _issue(d, "rogue-client", "clipd client", rogue_pair)
    return dict(ca=ca, server=server, client=client, rogue_ca=rogue_ca, rogue_client=rogue_client)


def _start(pki, **settings):
    tls = dict(tls_cert_file=str(pki["server"].cert), tls_key_file=str(pki["server"].key))
    server, port = create_server(Settings(**{**TEST_SETTINGS, **tls, **settings}))
    return server, port


@pytest.fixture(scope="module")
def tls_server(pki):
    server, _ = _start(pki, admin_port=0)
    yield server
    server.stop(grace=1.0)


@pytest.fixture(scope="module")
def mtls_server(pki):
    server, _ = _start(pki, tls_client_ca_file=str(pki["ca"].cert))
    yield server
    server.stop(grace=1.0)


def _trusting(ca: Pem) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca.cert))


def _health(channel: grpc.Channel) -> int:
    """One health check over ``channel``: the serving status, or the RpcError it raised."""
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT).status


def _assert_refused(channel: grpc.Channel) -> None:
    with channel, pytest.raises(grpc.RpcError) as info:
        _health(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def _round_trip(client: Client) -> None:
    """Create, submit, finalize; the bound is far above every norm, so the sums are the plain sums."""
    rng = np.random.default_rng(7)
    updates = {"w": rng.standard_normal((5, 3)).astype(np.float32)}
    agg = client.create_aggregation({"w": (3,)}, l2_norm_clip=1e6)
    report = client.submit(agg, updates)
    result = client.finalize(agg)
    assert report.examples == 5 and result.examples == 5
    assert result.clip_counts == {"w": 0}
    np.testing.assert_allclose(result.sums["w"], updates["w"].astype(np.float64).sum(axis=0), rtol=1e-6)


def test_tls_client_trusting_the_ca_round_trips(tls_server, pki):
    target = f"localhost:{tls_server.port}"
    with Client(target, root_certificates=pki["ca"].cert_bytes, timeout=TIMEOUT, retry_timeout=TIMEOUT) as client:
        _round_trip(client)


def test_tls_server_refuses_plaintext(tls_server):
    _assert_refused(grpc.insecure_channel(f"127.0.0.1:{tls_server.port}"))


def test_tls_client_not_trusting_the_ca_fails_the_handshake(tls_server, pki):
    credentials = grpc.ssl_channel_credentials(pki["rogue_ca"].cert_bytes)
    _assert_refused(grpc.secure_channel(f"localhost:{tls_server.port}", credentials))
    with Client(f"localhost:{tls_server.port}", root_certificates=pki["rogue_ca"].cert_bytes,
                timeout=TIMEOUT, retry_timeout=0.5) as client, pytest.raises(UnavailableError):
        client.create_aggregation({"w": (3,)})


def test_tls_server_certificate_names_the_ip(tls_server, pki):
    credentials = grpc.ssl_channel_credentials(pki["ca"].cert_bytes)
    with grpc.secure_channel(f"127.0.0.1:{tls_server.port}", credentials) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_mtls_refuses_a_client_without_a_certificate(mtls_server, pki):
    credentials = grpc.ssl_channel_credentials(pki["ca"].cert_bytes)
    _assert_refused(grpc.secure_channel(f"localhost:{mtls_server.port}", credentials))


def test_mtls_refuses_a_certificate_from_another_ca(mtls_server, pki):
    rogue = pki["rogue_client"]
    credentials = grpc.ssl_channel_credentials(pki["ca"].cert_bytes, rogue.key_bytes, rogue.cert_bytes)
    _assert_refused(grpc.secure_channel(f"localhost:{mtls_server.port}", credentials))
    with Client(f"localhost:{mtls_server.port}", root_certificates=pki["ca"].cert_bytes,
                client_certificate=rogue.cert_bytes, client_key=rogue.key_bytes,
                timeout=TIMEOUT, retry_timeout=0.5) as client, pytest.raises(UnavailableError):
        client.create_aggregation({"w": (3,)})


def test_mtls_accepts_a_client_certificate_from_the_ca(mtls_server, pki):
    good = pki["client"]
    with Client(f"localhost:{mtls_server.port}", root_certificates=pki["ca"].cert_bytes,
                client_certificate=good.cert_bytes, client_key=good.key_bytes,
                timeout=TIMEOUT, retry_timeout=TIMEOUT) as client:
        _round_trip(client)


def test_client_certificate_needs_its_key(pki):
    with pytest.raises(ValueError, match="client_key"):
        Client("localhost:1", root_certificates=pki["ca"].cert_bytes, client_certificate=pki["client"].cert_bytes)


def test_admin_api_serves_https_with_the_same_certificate(tls_server, pki):
    assert tls_server.admin.scheme == "https"
    port = tls_server.admin.port
    response = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=_trusting(pki["ca"]), timeout=TIMEOUT)
    assert response.status_code == 200
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=TIMEOUT)
    with pytest.raises(httpx.HTTPError):  # a certificate the client does not trust
        httpx.get(f"https://127.0.0.1:{port}/healthz", verify=_trusting(pki["rogue_ca"]), timeout=TIMEOUT)


def test_admin_api_does_not_ask_for_client_certificates_under_mtls(pki):
    server, _ = _start(pki, tls_client_ca_file=str(pki["ca"].cert), admin_port=0)
    try:
        response = httpx.get(f"https://localhost:{server.admin.port}/healthz", verify=_trusting(pki["ca"]),
                             timeout=TIMEOUT)
        assert response.status_code == 200
    finally:
        server.stop(grace=1.0)


def test_settings_client_ca_needs_a_server_certificate(pki):
    with pytest.raises(ValueError, match="tls_client_ca_file"):
        Settings(**{**TEST_SETTINGS, "tls_client_ca_file": str(pki["ca"].cert)})


@pytest.mark.parametrize("field", ["tls_cert_file", "tls_key_file", "tls_client_ca_file"])
def test_settings_name_a_missing_file(pki, tmp_path, field):
    files = dict(tls_cert_file=str(pki["server"].cert), tls_key_file=str(pki["server"].key),
                 tls_client_ca_file=str(pki["ca"].cert))
    missing = str(tmp_path / "nowhere.pem")
    with pytest.raises(ValueError, match=field) as info:
        Settings(**{**TEST_SETTINGS, **files, field: missing})
    assert missing in str(info.value)


def test_settings_tls_from_environment(pki):
    settings = Settings.from_env({"CLIPD_TLS_CERT_FILE": str(pki["server"].cert),
                                  "CLIPD_TLS_KEY_FILE": str(pki["server"].key),
                                  "CLIPD_TLS_CLIENT_CA_FILE": str(pki["ca"].cert),
                                  "CLIPD_DATA_DIR": "memory"})
    assert settings.tls_client_ca_file == str(pki["ca"].cert)


def test_shard_process_endpoints_have_the_public_ports_mutual_tls(pki, tmp_path):
    """``--processes 2`` with mutual TLS: each shard process's own port (from GetPlacement) has the same TLS."""
    server, port = _start(pki, processes=2, tls_client_ca_file=str(pki["ca"].cert), data_dir=str(tmp_path / "data"),
                          advertise_host="localhost")
    try:
        good, rogue = pki["client"], pki["rogue_client"]
        with Client(f"localhost:{port}", root_certificates=pki["ca"].cert_bytes, client_certificate=good.cert_bytes,
                    client_key=good.key_bytes, timeout=TIMEOUT, retry_timeout=TIMEOUT, message_bytes=64 << 10) as client:
            rng = np.random.default_rng(3)
            updates = [{"w": rng.standard_normal((4, 4096)).astype(np.float32)} for _ in range(6)]  # 64 KiB each
            agg = client.create_aggregation({"w": (4096,)}, l2_norm_clip=1e6)
            endpoints = list(client.placement(agg).endpoints)
            assert len(endpoints) == 2 and all(e.startswith("localhost:") for e in endpoints)
            report = client.submit(agg, iter(updates), client_id="tls")  # spread: straight to both endpoints
            result = client.finalize(agg)
        assert report.examples == result.examples == 24 and report.batches == 6
        np.testing.assert_allclose(result.sums["w"], sum(u["w"].astype(np.float64).sum(0) for u in updates),
                                   rtol=1e-5, atol=1e-5)
        for endpoint in endpoints:  # each endpoint: no plaintext, no certificate of another CA
            _assert_refused(grpc.insecure_channel(endpoint))
            _assert_refused(grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(
                pki["ca"].cert_bytes, rogue.key_bytes, rogue.cert_bytes)))
        assert server.servicer.payload_bytes == 0
    finally:
        server.stop(grace=1.0)


def _certified_pki(pki, tmp_path) -> dict[str, Pem]:
    """Client certificates of the test CA for two sites, ``site-a`` and ``site-b``, named so that neither is on the
    shard of the empty client id (2 shards): a client that names no id reaches the process of that shard, which
    must forward it to its certificate's."""
    ca_cert = x509.load_pem_x509_certificate(pki["ca"].cert_bytes)
    ca_key = serialization.load_pem_private_key(pki["ca"].key_bytes, password=None)
    names = [n for n in (f"site-{i}" for i in range(64)) if wire.shard_of(n, 2) != wire.shard_of("", 2)][:2]
    return {name: _issue(tmp_path, name, name, (ca_cert, ca_key))[0] for name in names}


@pytest.mark.parametrize("processes", [0, 2])
def test_a_client_certificate_is_its_holders_client_id_where_identities_count(pki, tmp_path, processes):
    """Mutual TLS, unit client: a site with its certificate and the aggregation's submit token is counted as its
    certificate's Common Name (naming none, its own, or a spread id of it), never as another (PERMISSION_DENIED),
    and contributes once. A certificate whose Common Name is no client id is refused. With ``--processes 2`` a
    site that reaches the process of another shard is forwarded with its certificate's id vouched for."""
    sites = _certified_pki(pki, tmp_path)
    (a_name, a_pem), (b_name, b_pem) = sites.items()
    server, port = _start(pki, tls_client_ca_file=str(pki["ca"].cert), admin_token="admin-mtls",
                          processes=processes, data_dir=str(tmp_path / "data"))

    def connect(pem: Pem, token: str) -> Client:
        return Client(f"localhost:{port}", root_certificates=pki["ca"].cert_bytes, client_certificate=pem.cert_bytes,
                      client_key=pem.key_bytes, token=token, timeout=30, retry_timeout=0.5)

    try:
        with connect(pki["client"], "admin-mtls") as admin:
            agg = admin.create_aggregation({"w": (3,)}, l2_norm_clip=1.0, unit="client")
            submit_token = admin.get_aggregation(agg).submit_token
        with connect(a_pem, submit_token) as site:
            with pytest.raises(PermissionDeniedError, match=f"client certificate is for client '{a_name}'; it may not"
                                                            f" submit as '{b_name}'"):
                site.submit(agg, {"w": np.ones((1, 3), np.float32)}, client_id=b_name)
            assert site.submit(agg, {"w": np.ones((2, 3), np.float32)}).client_id == a_name
            with pytest.raises(FailedPreconditionError, match=f"client '{a_name}' contributes one batch"):
                site.submit(agg, {"w": np.ones((1, 3), np.float32)}, client_id=a_name)
        with connect(b_pem, submit_token) as site:
            assert site.submit(agg, {"w": np.full((1, 3), -0.1, np.float32)}, client_id=b_name).client_id == b_name
        with connect(pki["client"], submit_token) as unnamed, pytest.raises(
                PermissionDeniedError, match="Common Name 'clipd client' is not a client id"):
            unnamed.submit(agg, {"w": np.ones((1, 3), np.float32)})
        with connect(pki["client"], "admin-mtls") as admin:
            result = admin.finalize(agg)
        assert result.examples == 2
        np.testing.assert_allclose(result.sums["w"], np.full(3, 1 / np.sqrt(3)) - 0.1, rtol=1e-6)
    finally:
        server.stop(grace=1.0)
