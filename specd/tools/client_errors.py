"""What a failed call to the coordinator means, in one line, with an exit code per cause.

`specd generate` prints the line instead of a traceback (`--verbose` adds
the traceback). The exit codes are part of the CLI's contract (README,
"Troubleshooting"):

    0 ok · 1 other error · 2 bad usage or argument · 3 coordinator unreachable
    4 TLS mismatch · 5 API token refused · 6 deadline exceeded · 130 interrupted
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import grpc

__all__ = ["EXIT_AUTH", "EXIT_DEADLINE", "EXIT_OTHER", "EXIT_TLS", "EXIT_UNREACHABLE", "CallContext", "explain"]

EXIT_OTHER = 1
EXIT_UNREACHABLE = 3
EXIT_TLS = 4
EXIT_AUTH = 5
EXIT_DEADLINE = 6

# gRPC's own UNAVAILABLE details when the client could not connect (as opposed to an UNAVAILABLE
# the coordinator sent, e.g. when its target is down), and the words that point at the TLS handshake.
_CONNECT_FAILED = ("failed to connect to all addresses", "connections to all backends failing")
_TLS_WORDS = ("tls handshake", "ssl_error", "ssl routines", "certificate_verify_failed", "wrong_version_number")


@dataclass(frozen=True)
class CallContext:
    """What the caller asked for: where, with TLS or not, with a token or not, and its timeout."""

    address: str
    tls: bool
    token: bool
    timeout_s: float | None


def _accepts_connections(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at HOST:PORT (a server that is up, whatever it speaks)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def explain(exc: grpc.RpcError, ctx: CallContext, elapsed_s: float = 0.0) -> tuple[int, str]:
    """(exit code, one line) for a call that failed after elapsed_s; the line says what to check or change."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    lowered = details.lower()
    where = f"the coordinator at {ctx.address}"
    out_of_time = ctx.timeout_s is not None and elapsed_s >= ctx.timeout_s
    if code == grpc.StatusCode.UNAVAILABLE and any(w in lowered for w in _CONNECT_FAILED):
        if any(word in lowered for word in _TLS_WORDS):
            return EXIT_TLS, (
                f"TLS handshake with {where} failed: it serves plaintext (drop --tls-ca), or its certificate "
                "is not signed by the CA in --tls-ca, or not issued for this address"
            )
        if not ctx.tls and "connection refused" not in lowered and _accepts_connections(ctx.address):
            return EXIT_TLS, f"{where} accepts connections but not plaintext gRPC: it may expect TLS (pass --tls-ca)"
        return EXIT_UNREACHABLE, (
            f"cannot reach {where}: nothing accepts connections there. Is it running (`specd up`), "
            "and is --address right?"
        )
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        given = "the token in --token-file" if ctx.token else "no API token"
        return EXIT_AUTH, (
            f"{where} refused the call ({details or code.name}): it was sent {given}; pass the coordinator's "
            "token with --token-file"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or out_of_time:
        limit = f"--timeout {ctx.timeout_s:g} s" if ctx.timeout_s else "the deadline"
        return EXIT_DEADLINE, (
            f"no complete answer from {where} within {limit}: raise --timeout, or ask for fewer tokens"
        )
    name = code.name if code is not None else "an error"
    return EXIT_OTHER, f"{where} answered {name}: {details}"
