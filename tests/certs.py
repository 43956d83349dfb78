"""Certificates made by the tests: a CA, server and client certificates, a stranger CA, an impostor.

The impostor's client certificate comes from the right CA under another name
(what any other workload holding a certificate from the cluster's CA has).
`reissue` signs fresh server and client certificates with the same CA, as
cert-manager does when it renews them.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # an unrelated CA: nothing it signed is trusted
    other_client_cert: Path
    other_client_key: Path
    impostor_cert: Path  # right CA, CN "impostor": refused by name
    impostor_key: Path
    ca_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, usage=None) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, name: str, cert: x509.Certificate, key=None) -> tuple[Path, Path | None]:
    cert_path = folder / f"{name}.crt"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = None
    if key is not None:
        key_path = folder / f"{name}.key"
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert_path, key_path


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, other_key = _key(), _key()
    ca = _cert("specd-test-ca", ca_key, "specd-test-ca", ca_key, ca=True)
    other = _cert("stranger-ca", other_key, "stranger-ca", other_key, ca=True)
    server_key, client_key, other_client_key = _key(), _key(), _key()
    server = _cert("localhost", server_key, "specd-test-ca", ca_key, ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client = _cert("coordinator", client_key, "specd-test-ca", ca_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    stranger = _cert(
        "intruder", other_client_key, "stranger-ca", other_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    ca_path, _ = _write(folder, "ca", ca)
    other_path, _ = _write(folder, "other-ca", other)
    s_cert, s_key = _write(folder, "server", server, server_key)
    c_cert, c_key = _write(folder, "client", client, client_key)
    o_cert, o_key = _write(folder, "intruder", stranger, other_client_key)
    impostor_key = _key()
    impostor = _cert("impostor", impostor_key, "specd-test-ca", ca_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    i_cert, i_key = _write(folder, "impostor", impostor, impostor_key)
    ca_key_path = folder / "ca.key"
    ca_key_path.write_bytes(
        ca_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    assert s_key and c_key and o_key and i_key
    return Pki(ca_path, s_cert, s_key, c_cert, c_key, other_path, o_cert, o_key, i_cert, i_key, ca_key_path)


def reissue(pki: Pki, folder: Path, client_name: str = "coordinator") -> tuple[Path, Path, Path, Path]:
    """New server and client key pairs and certificates from the same CA: (server cert, key, client cert, key)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    server_key, client_key = _key(), _key()
    server = _cert("localhost", server_key, "specd-test-ca", ca_key, ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client = _cert(client_name, client_key, "specd-test-ca", ca_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    s_cert, s_key = _write(folder, "server", server, server_key)
    c_cert, c_key = _write(folder, "client", client, client_key)
    assert s_key and c_key
    return s_cert, s_key, c_cert, c_key
