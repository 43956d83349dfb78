"""TLS, mutual TLS between services, and the API token (certificates made by the tests)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.client import CoordinatorClient
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.certs import Pki, make_pki
from tests.cluster import Cluster
from tests.round_messages import answers, one_per_message

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_cluster(tiny_pair: tuple[Path, Path], pki: Pki, tmp_path_factory: pytest.TempPathFactory):
    target, draft = tiny_pair
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    internal = [
        *("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)),
        *("--tls-client-names", "coordinator"),  # the CN of the coordinator's client certificate
    ]
    coordinator = [
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--peer-tls-ca",
        str(pki.ca),
        "--peer-tls-cert",
        str(pki.client_cert),
        "--peer-tls-key",
        str(pki.client_key),
        "--api-token-file",
        str(token_file),
        *("--http-port", "0"),  # the OpenAI HTTP API: HTTPS with the same certificate and token
    ]
    with Cluster(
        target,
        draft,
        cache_dir=tmp_path_factory.mktemp("cache"),
        target_args=internal,
        draft_args=internal,
        coordinator_args=coordinator,
    ) as c:
        yield c


def _generate(client: CoordinatorClient):
    return client.generate(
        "hello", max_new_tokens=8, temperature=0, ignore_eos=True, speculation="fixed", draft_length=3
    )


def test_right_ca_and_token_work_with_mutual_tls_to_peers(secure_cluster: Cluster, pki: Pki) -> None:
    with CoordinatorClient(secure_cluster.address, tls_ca=str(pki.ca), token=TOKEN, timeout=60) as client:
        reply = _generate(client)
    assert len(reply.token_ids) == 8
    assert reply.stats.draft_tokens > 0  # the coordinator reached the draft over mutual TLS


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", ""])
def test_missing_or_wrong_token_is_refused(secure_cluster: Cluster, pki: Pki, token: str | None) -> None:
    with (
        CoordinatorClient(secure_cluster.address, tls_ca=str(pki.ca), token=token, timeout=30) as client,
        pytest.raises(grpc.RpcError) as err,
    ):
        _generate(client)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "token" in err.value.details()


def test_health_needs_no_token(secure_cluster: Cluster, pki: Pki) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    with grpc.secure_channel(secure_cluster.address, creds) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_and_wrong_ca_are_refused_by_the_coordinator(secure_cluster: Cluster, pki: Pki) -> None:
    for client in (
        CoordinatorClient(secure_cluster.address, token=TOKEN, timeout=10),  # plaintext to a TLS port
        CoordinatorClient(secure_cluster.address, tls_ca=str(pki.other_ca), token=TOKEN, timeout=10),
    ):
        with client, pytest.raises(grpc.RpcError) as err:
            _generate(client)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def _target_info(address: str, creds: grpc.ChannelCredentials | None) -> common_pb2.ModelInfo:
    channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    with channel:
        return target_pb2_grpc.TargetStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)


def test_internal_services_require_the_coordinators_client_certificate(secure_cluster: Cluster, pki: Pki) -> None:
    address = secure_cluster.target.address
    assert address is not None
    ca = pki.ca.read_bytes()
    good = grpc.ssl_channel_credentials(ca, pki.client_key.read_bytes(), pki.client_cert.read_bytes())
    assert _target_info(address, good).vocab_size > 0
    refused = [
        None,  # plaintext
        grpc.ssl_channel_credentials(ca),  # TLS but no client certificate
        grpc.ssl_channel_credentials(ca, pki.other_client_key.read_bytes(), pki.other_client_cert.read_bytes()),
    ]
    for creds in refused:
        with pytest.raises(grpc.RpcError) as err:
            _target_info(address, creds)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_certificate_from_the_same_ca_with_another_name_is_refused(secure_cluster: Cluster, pki: Pki) -> None:
    ca = pki.ca.read_bytes()
    impostor = grpc.ssl_channel_credentials(ca, pki.impostor_key.read_bytes(), pki.impostor_cert.read_bytes())
    assert secure_cluster.draft is not None
    services = [
        (secure_cluster.target.address, target_pb2_grpc.TargetStub, target_pb2.TargetRequest),
        (secure_cluster.draft.address, draft_pb2_grpc.DraftStub, draft_pb2.DraftRequest),
    ]
    for address, stub_class, request_class in services:
        assert address is not None
        with grpc.secure_channel(address, impostor) as channel:
            stub = stub_class(channel)
            calls = [
                lambda stub=stub: stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10),
                lambda stub=stub, req=request_class: list(
                    answers(stub.Rounds(one_per_message([req(session_id="s")]), timeout=10))
                ),
                lambda channel=channel: health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                ),
            ]
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (address, err.value.details())
    # The coordinator's own certificate still gets through to both (a request speculates).
    with CoordinatorClient(secure_cluster.address, tls_ca=str(pki.ca), token=TOKEN, timeout=60) as client:
        assert _generate(client).stats.draft_tokens > 0


def _curl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    body = json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    return subprocess.run(
        ["curl", "-sS", "-w", "\n%{http_code}", url, "-H", "Content-Type: application/json", "-d", body, *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_http_api_is_https_with_the_same_certificate_and_token(secure_cluster: Cluster, pki: Pki) -> None:
    assert secure_cluster.coordinator is not None and secure_cluster.coordinator.http_address
    url = f"https://{secure_cluster.coordinator.http_address}/v1/completions"
    ok = _curl(url, "--cacert", str(pki.ca), "-H", f"Authorization: Bearer {TOKEN}")
    text, _, status = ok.stdout.rpartition("\n")
    assert (ok.returncode, status) == (0, "200"), ok.stderr
    assert json.loads(text)["usage"]["completion_tokens"] == 4
    refused = _curl(url, "--cacert", str(pki.ca), "-H", "Authorization: Bearer wrong-token")
    assert refused.stdout.rpartition("\n")[2] == "401"
    assert json.loads(refused.stdout.rpartition("\n")[0])["error"]["code"] == "invalid_api_key"
    assert _curl(url, "--cacert", str(pki.other_ca), "-H", f"Authorization: Bearer {TOKEN}").returncode == 60
    plain = _curl(url.replace("https://", "http://"), "-H", f"Authorization: Bearer {TOKEN}")
    assert plain.stdout.rpartition("\n")[2] != "200"  # plaintext to the TLS port: no answer
