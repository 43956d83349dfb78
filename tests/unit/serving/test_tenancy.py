"""The caller's identity as the transport proved it, and the tenant key derived from it."""

from __future__ import annotations

from typing import Any

from specd.serving.tenancy import TOKEN_IDENTITY, caller_identity, tenant_key


class _Context:
    def __init__(self, auth: dict[str, list[bytes]] | None) -> None:
        self._auth = auth

    def auth_context(self) -> Any:
        return self._auth


def test_a_client_certificate_names_the_caller_before_the_token() -> None:
    cert = _Context({"x509_common_name": [b"billing"], "transport_security_type": [b"ssl"]})
    assert caller_identity(cert, token_checked=True) == "cert:billing"  # type: ignore[arg-type]
    san_only = _Context({"x509_subject_alternative_name": [b"search.internal"]})
    assert caller_identity(san_only, token_checked=False) == "cert:search.internal"  # type: ignore[arg-type]


def test_without_a_certificate_the_token_or_nobody() -> None:
    server_tls_only = _Context({"transport_security_type": [b"ssl"]})
    assert caller_identity(server_tls_only, token_checked=True) == TOKEN_IDENTITY  # type: ignore[arg-type]
    assert caller_identity(_Context(None), token_checked=False) == ""  # type: ignore[arg-type]


def test_tenant_keys_separate_identity_from_salt() -> None:
    assert tenant_key("", "") == ""
    assert tenant_key("a", "bc") != tenant_key("ab", "c")  # length-prefixed parts
    assert tenant_key("cert:x", "") != tenant_key("", "cert:x")
    assert len(tenant_key("cert:x", "s")) == 32
