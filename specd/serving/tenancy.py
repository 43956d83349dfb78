"""Who a caller is, for what the draft learns across requests (specd.core.draft.tenant_index).

The tenant key is derived from the caller's identity, as the coordinator's
transport proved it, and the request's cache salt:

- identity: the client certificate's common name (or its first DNS subject
  alternative name) under mutual TLS; otherwise "api-token" when the API
  token was checked (every holder of the one token is one principal);
  otherwise none.
- the salt narrows it: the same identity with different salts are different
  tenants. With no identity the salt alone is the scope, so it works like a
  shared secret.

The key is a hash, so neither the salt nor the name travels to the draft or
into its logs. No identity and no salt: the empty key, which learns nothing
across requests.
"""

from __future__ import annotations

import hashlib

import grpc

from specd.core.errors import InvalidArgument

MAX_SALT_CHARS = 256
TOKEN_IDENTITY = "api-token"


def caller_identity(context: grpc.aio.ServicerContext, *, token_checked: bool) -> str:
    """The caller's proven identity: 'cert:<name>', TOKEN_IDENTITY, or '' (anonymous)."""
    auth = context.auth_context() or {}
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names = auth.get(key) or ()
        if names:
            name = names[0]
            return "cert:" + (name.decode(errors="replace") if isinstance(name, bytes) else str(name))
    return TOKEN_IDENTITY if token_checked else ""


def tenant_key(identity: str, cache_salt: str) -> str:
    """An opaque key for (identity, salt); '' when both are empty."""
    if len(cache_salt) > MAX_SALT_CHARS:
        raise InvalidArgument(f"cache_salt has {len(cache_salt)} characters; the limit is {MAX_SALT_CHARS}")
    if not identity and not cache_salt:
        return ""
    digest = hashlib.sha256()
    for part in (identity, cache_salt):  # length-prefixed: ("a", "bc") and ("ab", "c") differ
        data = part.encode()
        digest.update(len(data).to_bytes(4, "big") + data)
    return digest.hexdigest()[:32]
