"""Lanes speak TLS when the operator gave Ray TLS (issue 39, item 6): mutual TLS with the
cluster's CA, the certificates made here with `cryptography`; everything on loopback."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path

import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from actors import lane as lane_module
from actors.lane import TLS, LaneClient, LaneServer, LaneUnreachable, frame, lane_tls, tls_contexts
from kernel.errors import ConfigError


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _issue(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool) -> x509.Certificate:
    """A certificate as a cluster's tooling makes them, with the extensions Python 3.13's strict
    verification (VERIFY_X509_STRICT) asks for: key identifiers, key usage, a critical CA flag."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                              critical=False)
               .add_extension(x509.KeyUsage(digital_signature=not ca, key_cert_sign=ca, crl_sign=ca,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False),
                              critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                        critical=False).add_extension(
            x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def cluster_files(tmp: Path, tag: str) -> tuple[str, str, str]:
    """A CA and one node certificate signed by it, as PEM files: (cert, key, ca)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue(f"{tag} CA", ca_key, _name(f"{tag} CA"), ca_key, ca=True)
    node_key = ec.generate_private_key(ec.SECP256R1())
    node_cert = _issue(f"{tag} node", node_key, ca_cert.subject, ca_key, ca=False)
    paths = tmp / f"{tag}.crt", tmp / f"{tag}.key", tmp / f"{tag}-ca.crt"
    paths[0].write_bytes(node_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(node_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    paths[2].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return tuple(str(p) for p in paths)  # type: ignore[return-value]


class Host:
    def __init__(self) -> None:
        self.calls: list[list] = []

    async def dispatch(self, method: str, args: list) -> bytes:
        self.calls.append(args)
        return msgspec.json.encode({"args": args})


@pytest.fixture
async def tls_lane(tmp_path):
    tls = tls_contexts(*cluster_files(tmp_path, "cluster"))
    host = Host()
    server = LaneServer(host.dispatch, frozenset({"send"}), tls=tls)
    address = await server.start("127.0.0.1")
    yield host, address, tls, tmp_path
    await server.close()


async def test_a_lane_speaks_tls_when_the_cluster_has_it_and_calls_run_over_it(tls_lane):
    host, address, tls, _ = tls_lane
    assert TLS in address.features
    client = LaneClient(address, tls=tls)
    try:
        assert msgspec.json.decode(await client.call("send", "over tls"))["args"] == ["over tls"]
    finally:
        client.close()
    assert host.calls == [["over tls"]]


async def test_a_gateway_without_tls_finds_a_tls_lane_unreachable_having_sent_nothing(tls_lane):
    host, address, _, _ = tls_lane
    client = LaneClient(address, tls=None)
    with pytest.raises(LaneUnreachable, match="speaks TLS and this gateway has no TLS settings"):
        await client.call("send", "plain")
    assert host.calls == []


async def test_a_peer_of_another_ca_or_in_plain_text_gets_nothing_run(tls_lane):
    host, address, _, tmp_path = tls_lane
    stranger = LaneClient(address, tls=tls_contexts(*cluster_files(tmp_path, "stranger")))
    with pytest.raises(LaneUnreachable):
        await stranger.call("send", "forged")
    reader, writer = await asyncio.open_connection(address.host, address.port)  # the token in plain text
    writer.write(frame(msgspec.msgpack.encode(address.token)))
    assert await asyncio.wait_for(reader.read(), 10) == b""  # not TLS: the handshake fails, closed
    writer.close()
    assert host.calls == []


def test_tls_comes_from_rays_settings_and_half_of_them_is_a_config_error(monkeypatch, tmp_path):
    cert, key, ca = cluster_files(tmp_path, "env")
    for name in ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
        monkeypatch.delenv(name, raising=False)
    lane_tls.cache_clear()
    try:
        assert lane_tls() is None
        lane_tls.cache_clear()
        monkeypatch.setenv("RAY_USE_TLS", "1")
        monkeypatch.setenv("RAY_TLS_SERVER_CERT", cert)
        with pytest.raises(ConfigError, match="RAY_TLS_SERVER_KEY and RAY_TLS_CA_CERT"):
            lane_tls()
        lane_tls.cache_clear()
        monkeypatch.setenv("RAY_TLS_SERVER_KEY", key)
        monkeypatch.setenv("RAY_TLS_CA_CERT", ca)
        assert isinstance(lane_module.lane_tls(), lane_module.LaneTLS)
    finally:
        lane_tls.cache_clear()
