"""Certificates and the API token rotated under load: no request is lost, and the new ones are used.

The TLS files are laid out as Kubernetes mounts a Secret (each name a symlink
into `..data`, a symlink to a timestamped folder), and rotated the way the
kubelet does it when cert-manager renews: a new folder, then one atomic swap
of `..data`. The new client certificate carries a new name, so that a target
restarted to accept only that name proves the coordinator presents it.
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import threading
import time
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from coordinator.client import CoordinatorClient
from tests.certs import Pki, make_pki, reissue
from tests.cluster import Cluster

OLD_TOKEN = "old-token-0123456789abcdef"
NEW_TOKEN = "new-token-fedcba9876543210"
GRACE_S = 6.0


def _mount(folder: Path, files: dict[str, Path], generation: int) -> None:
    """Write `files` as a Secret volume (name -> ..data/name), swapping ..data atomically."""
    data = folder / f"..{generation}"
    data.mkdir(parents=True)
    for name, source in files.items():
        (data / name).write_bytes(source.read_bytes())
    tmp = folder / "..data_tmp"
    tmp.symlink_to(data.name)
    os.replace(tmp, folder / "..data")
    for name in files:
        link = folder / name
        if not link.is_symlink():
            link.symlink_to(Path("..data") / name)


def _reloaded_at(lines: list[str]) -> float:
    """When the coordinator logged the API token's reload (epoch seconds, from its log line)."""
    for line in reversed(lines):
        if "API token reloaded" in line:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise AssertionError("the coordinator never logged the API token's reload:\n" + "".join(lines[-20:]))


def _fingerprint(pem_or_der: bytes) -> str:
    der = ssl.PEM_cert_to_DER_cert(pem_or_der.decode()) if pem_or_der.startswith(b"-----") else pem_or_der
    return hashlib.sha256(der).hexdigest()


def _served_certificate(address: str, ca: Path, client: tuple[Path, Path] | None = None) -> str:
    """Fingerprint of the certificate a fresh TLS handshake to `address` gets."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    with socket.create_connection((host, int(port)), timeout=10) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return _fingerprint(der)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_certificates_and_token_rotate_under_load_without_a_lost_request(
    tiny_pair: tuple[Path, Path], pki: Pki, tmp_path: Path
) -> None:
    server_dir, client_dir, token_dir = tmp_path / "tls", tmp_path / "client-tls", tmp_path / "token"
    _mount(server_dir, {"tls.crt": pki.server_cert, "tls.key": pki.server_key, "ca.crt": pki.ca}, 1)
    _mount(client_dir, {"tls.crt": pki.client_cert, "tls.key": pki.client_key, "ca.crt": pki.ca}, 1)
    old_token, new_token = tmp_path / "old-token", tmp_path / "new-token"
    old_token.write_text(OLD_TOKEN)
    new_token.write_text(NEW_TOKEN)
    _mount(token_dir, {"token": old_token}, 1)
    tls = ["--tls-cert", str(server_dir / "tls.crt"), "--tls-key", str(server_dir / "tls.key")]
    internal = [*tls, "--tls-client-ca", str(server_dir / "ca.crt"), "--tls-client-names", "coordinator,coordinator-2"]
    coordinator = [
        *tls,
        *("--peer-tls-ca", str(client_dir / "ca.crt")),
        *("--peer-tls-cert", str(client_dir / "tls.crt"), "--peer-tls-key", str(client_dir / "tls.key")),
        *("--api-token-file", str(token_dir / "token"), "--api-token-grace-s", str(GRACE_S)),
    ]
    target, draft = tiny_pair
    cluster = Cluster(
        target,
        draft,
        cache_dir=tmp_path / "cache",
        target_args=internal,
        draft_args=internal,
        coordinator_args=coordinator,
    )
    with cluster as c:
        assert c.draft is not None and c.target.address and c.draft.address
        old_server = _fingerprint(pki.server_cert.read_bytes())
        assert _served_certificate(c.address, pki.ca) == old_server

        token = [OLD_TOKEN]  # what the load's clients send; switched after the rotation
        stop = threading.Event()
        replies: list[list[int]] = []
        failures: list[str] = []

        def load() -> None:
            while not stop.is_set():
                sent = token[0]
                with CoordinatorClient(c.address, tls_ca=str(pki.ca), token=sent, timeout=120) as client:
                    try:
                        reply = client.generate(
                            "rotate",
                            max_new_tokens=8,
                            temperature=0,
                            ignore_eos=True,
                            speculation="fixed",
                            draft_length=3,
                        )
                        replies.append(list(reply.token_ids))
                    except grpc.RpcError as err:
                        failures.append(f"{err.code().name}: {err.details()} (token {sent[:3]})")

        threads = [threading.Thread(target=load) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(replies) < 6 and time.monotonic() < deadline:
            time.sleep(0.2)

        # Rotate: new server and client certificates (the client's under a new name), and the token.
        s_cert, s_key, c_cert, c_key = reissue(pki, tmp_path / "new", client_name="coordinator-2")
        _mount(server_dir, {"tls.crt": s_cert, "tls.key": s_key, "ca.crt": pki.ca}, 2)
        _mount(client_dir, {"tls.crt": c_cert, "tls.key": c_key, "ca.crt": pki.ca}, 2)
        _mount(token_dir, {"token": new_token}, 2)
        rotated_at, before = time.monotonic(), len(replies)
        while len(replies) < before + 6 and time.monotonic() < deadline:
            time.sleep(0.2)
        token[0] = NEW_TOKEN  # within the grace period: the old token still worked until now
        assert time.monotonic() - rotated_at < GRACE_S + 30
        while len(replies) < before + 12 and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(180)

        assert not failures, failures  # no lost request
        assert len(replies) >= before + 12 and all(r == replies[0] for r in replies), replies
        # Fresh handshakes get the new server certificate, on all three services.
        # (A server looks at its files at most once a second: give each a few looks.)
        new_server = _fingerprint(s_cert.read_bytes())
        for address, client in (
            (c.address, None),
            (c.target.address, (c_cert, c_key)),
            (c.draft.address, (c_cert, c_key)),
        ):
            served, until = "", time.monotonic() + 5
            while served != new_server and time.monotonic() < until:
                served = _served_certificate(address, pki.ca, client)
                time.sleep(0.25)
            assert served == new_server, address
        # The previous token expires after its grace period, which starts when the coordinator
        # saw the new file (its log line's time: a look at the files comes at most once a second,
        # and only on a call, so it can be later than the rotation itself); the new one works.
        time.sleep(max(0.0, rotated_at + GRACE_S + 1.5 - time.monotonic()))
        time.sleep(max(0.0, _reloaded_at(c.coordinator.lines) + GRACE_S + 1.0 - time.time()))
        with CoordinatorClient(c.address, tls_ca=str(pki.ca), token=OLD_TOKEN, timeout=30) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate("x", max_new_tokens=1)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The coordinator presents its new client certificate: a target restarted to admit only
        # the new name serves it (a new connection; the old one ended with the old process).
        only_new = [a for a in internal if a != "coordinator,coordinator-2"] + ["coordinator-2"]
        c.target.kill()
        c.target.restart(c.env, [*c.target.args[: c.target.args.index("--tls-cert")], *only_new])
        with CoordinatorClient(c.address, tls_ca=str(pki.ca), token=NEW_TOKEN, timeout=120) as client:
            reply = client.generate("rotate", max_new_tokens=8, temperature=0, ignore_eos=True)
        assert list(reply.token_ids) == replies[0]
